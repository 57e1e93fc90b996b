#!/usr/bin/env bash
# Session 6 call 4 (nvidia-h200-x2): the persistent warp-specialized kernel (items walked by one block
# per SM, producer running on across items). GPU 0: test_gpu ws / auto / wgmma (BF16 layout),
# memcheck ws, racecheck auto; GPU 1: bench ws against wgmma (NVFP4 T=128..8192, BF16 T=512..8192),
# the auto table for the docs; then the 2-GPU pytest.
set -u
OUT=${OUT:-device-out}
L=$OUT/logs
mkdir -p "$L"
tar xJf .devpack/devbin.tar.xz
. bench/device_env.sh
start=$(date +%s)
(
  export CUDA_VISIBLE_DEVICES=0
  for k in ws auto; do
    MEGAMOE_GEMM=$k timeout 150 .devbin/test_gpu > "$L/test_gpu_$k.log" 2>&1
    echo "test_gpu $k: exit $? $(grep -E '^\[  (PASSED|FAILED)' "$L/test_gpu_$k.log" | tr '\n' ' ') at $(( $(date +%s) - start )) s"
  done
  MEGAMOE_GEMM=ws timeout 100 compute-sanitizer --tool memcheck --report-api-errors no --error-exitcode 9 \
    .devbin/test_gpu --quick > "$L/sanitize_ws_memcheck.log" 2>&1
  echo "memcheck ws: exit $? $(tail -n 1 "$L/sanitize_ws_memcheck.log") at $(( $(date +%s) - start )) s"
  timeout 100 compute-sanitizer --tool racecheck --report-api-errors no --error-exitcode 9 \
    --kernel-name-exclude kns=sm90_expert_stream_kernel --kernel-name-exclude kns=sm90_expert_ws_kernel \
    .devbin/test_gpu --quick > "$L/sanitize_auto_racecheck.log" 2>&1
  echo "racecheck auto: exit $? $(tail -n 1 "$L/sanitize_auto_racecheck.log") at $(( $(date +%s) - start )) s"
) > "$L/gpu0.txt" 2>&1 &
(
  export CUDA_VISIBLE_DEVICES=1
  for shape in "256 8 7168 2048" "128 8 2048 768" "8 2 4096 14336"; do
    set -- $shape
    for g in ws wgmma; do
      timeout 100 .devbin/megamoe bench --backend cuda --format nvfp4 --experts $1 --top-k $2 --hidden $3 --inter $4 \
        --tokens 128,512,2048,8192 --iters 10 --gemm $g 2>&1 | sed "s/^bench:/bench[$g]:/" >> "$L/bench.log"
      timeout 100 .devbin/megamoe bench --backend cuda --format bf16 --experts $1 --top-k $2 --hidden $3 --inter $4 \
        --tokens 512,2048,8192 --iters 10 --gemm $g 2>&1 | sed "s/^bench:/bench[$g]:/" >> "$L/bench.log"
    done
  done
  echo "bench done at $(( $(date +%s) - start )) s"
  grep -E "^bench\[.*median" "$L/bench.log" | sed -E 's/R=1 backend=cuda: //; s/ over 10//; s/ of touched expert weights//' | cut -c1-150
) > "$L/gpu1.txt" 2>&1 &
wait
if [ $(( $(date +%s) - start )) -lt 470 ]; then
  MEGAMOE_CLI=.devbin/megamoe timeout $(( 540 - ($(date +%s) - start) )) python3 -m pytest -q -p no:cacheprovider -rs \
    tests/py/test_multi_gpu.py > "$L/multi_gpu.txt" 2>&1
  echo "multi-GPU: $(tail -n 1 "$L/multi_gpu.txt")" >> "$L/gpu0.txt"
fi
tar czf "$OUT/logs.tar.gz" -C "$OUT" logs
cat "$L/gpu0.txt" "$L/gpu1.txt"
