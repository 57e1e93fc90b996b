#!/usr/bin/env bash
# One device call's benchmark batch (after bench/stage_device.sh): the default build's NVFP4 table for
# the three shapes, the GEMM kernels forced each way on the prefill sizes, BF16 prefill, and, when
# .devbin holds them, the mma.sync kernel of build variants (megamoe_<variant>) at one size.
set -uo pipefail
OUT=${OUT:-device-out}
mkdir -p "$OUT"
. bench/device_env.sh
B=.devbin
bench() { timeout 200 "$@" --iters 10 2>&1 | sed 's/bench: //; s/ backend=cuda//; s/ over 10//' | tee -a "$OUT/bench.log"; }
DS="--experts 256 --top-k 8 --hidden 7168 --inter 2048"
for v in $B/megamoe_*; do
  [ -x "$v" ] || continue
  echo "== variant ${v##*/} (mma.sync forced)"; bench $v bench --gemm mma --backend cuda --format nvfp4 $DS --tokens 2048
done
echo "== default build, mma.sync forced"; bench $B/megamoe bench --gemm mma --backend cuda --format nvfp4 $DS --tokens 2048
for gemm in wgmma; do
  echo "== $gemm forced"; bench $B/megamoe bench --gemm $gemm --backend cuda --format nvfp4 $DS --tokens 128,512,2048,8192
done
echo "== NVFP4, kernels chosen per forward"
for shape in "256 8 7168 2048" "128 8 2048 768" "8 2 4096 14336"; do set -- $shape
  bench $B/megamoe bench --backend cuda --format nvfp4 --experts $1 --top-k $2 --hidden $3 --inter $4 --tokens ${TOKENS:-1,8,32,128,512,2048,8192}
done
echo "== BF16 prefill"
for shape in "256 8 7168 2048" "128 8 2048 768" "8 2 4096 14336"; do set -- $shape
  bench $B/megamoe bench --backend cuda --format bf16 --experts $1 --top-k $2 --hidden $3 --inter $4 --tokens 2048,8192
done
