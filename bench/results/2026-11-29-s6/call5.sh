#!/usr/bin/env bash
# Session 6 call 5 (nvidia-h200-x2, the last ~5 minutes of device time): the non-persistent
# warp-specialized kernel as landed (call 3's kernel, the choice rule of gemm_plan.h, the occupier
# test waiting for the occupier's release when the forward takes ws). GPU 0: test_gpu auto and ws,
# memcheck ws; GPU 1: the NVFP4 table (kernels chosen per forward) and BF16 at T = 8192.
set -u
OUT=${OUT:-device-out}
L=$OUT/logs
mkdir -p "$L"
tar xJf .devpack/devbin.tar.xz
. bench/device_env.sh
start=$(date +%s)
(
  export CUDA_VISIBLE_DEVICES=0
  for k in auto ws; do
    MEGAMOE_GEMM=$k timeout 85 .devbin/test_gpu > "$L/test_gpu_$k.log" 2>&1
    echo "test_gpu $k: exit $? $(grep -E '^\[  (PASSED|FAILED)' "$L/test_gpu_$k.log" | tr '\n' ' ') at $(( $(date +%s) - start )) s"
  done
  MEGAMOE_GEMM=ws timeout 45 compute-sanitizer --tool memcheck --report-api-errors no --error-exitcode 9 \
    .devbin/test_gpu --quick > "$L/sanitize_ws_memcheck.log" 2>&1
  echo "memcheck ws: exit $? $(tail -n 1 "$L/sanitize_ws_memcheck.log") at $(( $(date +%s) - start )) s"
) > "$L/gpu0.txt" 2>&1 &
(
  export CUDA_VISIBLE_DEVICES=1
  for shape in "256 8 7168 2048" "128 8 2048 768" "8 2 4096 14336"; do
    set -- $shape
    timeout 60 .devbin/megamoe bench --backend cuda --format nvfp4 --experts $1 --top-k $2 --hidden $3 --inter $4 \
      --tokens 1,8,32,128,512,2048,8192 --iters 10 2>&1 >> "$L/bench.log"
  done
  for shape in "256 8 7168 2048" "128 8 2048 768" "8 2 4096 14336"; do
    set -- $shape
    timeout 30 .devbin/megamoe bench --backend cuda --format bf16 --experts $1 --top-k $2 --hidden $3 --inter $4 \
      --tokens 8192 --iters 10 2>&1 >> "$L/bench.log"
  done
  echo "bench done at $(( $(date +%s) - start )) s"
  grep -E "median" "$L/bench.log" | sed -E 's/R=1 backend=cuda: //; s/ over 10//; s/ of touched expert weights//' | cut -c1-150
) > "$L/gpu1.txt" 2>&1 &
wait
tar czf "$OUT/logs.tar.gz" -C "$OUT" logs
cat "$L/gpu0.txt" "$L/gpu1.txt"
