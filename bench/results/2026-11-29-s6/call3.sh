#!/usr/bin/env bash
# Session 6 call 3 (nvidia-h200-x2): the warp-specialized kernel with grouped block order (WS_GROUP 16),
# 168/232 registers (no wgmma serialization) and the smaller occupier. GPU 0: test_gpu ws and auto,
# memcheck ws, racecheck auto (stream and ws excluded by two options: a hazard of the streaming kernel
# would show the second option replacing the first). GPU 1: megamoe bench with ws forced, main
# (WS_GROUP 16) against g1 / g64 / lag1, then ncu of the ws kernels at Mixtral T=8192.
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
  MEGAMOE_GEMM=ws timeout 120 compute-sanitizer --tool memcheck --report-api-errors no --error-exitcode 9 \
    .devbin/test_gpu --quick > "$L/sanitize_ws_memcheck.log" 2>&1
  echo "memcheck ws: exit $? $(tail -n 1 "$L/sanitize_ws_memcheck.log") at $(( $(date +%s) - start )) s"
  timeout 150 compute-sanitizer --tool racecheck --report-api-errors no --error-exitcode 9 \
    --kernel-name-exclude kns=sm90_expert_stream_kernel --kernel-name-exclude kns=sm90_expert_ws_kernel \
    .devbin/test_gpu --quick > "$L/sanitize_auto_racecheck.log" 2>&1
  echo "racecheck auto: exit $? $(tail -n 1 "$L/sanitize_auto_racecheck.log") at $(( $(date +%s) - start )) s"
) > "$L/gpu0.txt" 2>&1 &
(
  export CUDA_VISIBLE_DEVICES=1
  bin() { [ "$1" = main ] && echo .devbin/megamoe || echo ".devbin/megamoe_$1"; }
  for shape in "256 8 7168 2048" "128 8 2048 768" "8 2 4096 14336"; do
    set -- $shape
    for b in main g1 g64 lag1; do
      timeout 100 "$(bin $b)" bench --backend cuda --format nvfp4 --experts $1 --top-k $2 --hidden $3 --inter $4 \
        --tokens 512,2048,8192 --iters 10 --gemm ws 2>&1 | sed "s/^bench:/bench[$b]:/" >> "$L/bench.log"
    done
    timeout 100 .devbin/megamoe bench --backend cuda --format bf16 --experts $1 --top-k $2 --hidden $3 --inter $4 \
      --tokens 2048,8192 --iters 10 --gemm ws 2>&1 | sed "s/^bench:/bench[main]:/" >> "$L/bench.log"
  done
  echo "bench done at $(( $(date +%s) - start )) s"
  grep -E "^bench\[.*median" "$L/bench.log" | sed -E 's/R=1 backend=cuda: //; s/ over 10//; s/ of touched expert weights//' | cut -c1-150
  timeout $(( 540 - ($(date +%s) - start) )) ncu --kernel-name regex:sm90_expert_ws --launch-skip 2 --launch-count 2 \
    --section SpeedOfLight --section WarpStateStats --section SchedulerStats --section MemoryWorkloadAnalysis \
    --section LaunchStats .devbin/megamoe bench --backend cuda --format nvfp4 --experts 8 --top-k 2 --hidden 4096 \
    --inter 14336 --tokens 8192 --iters 1 --gemm ws > "$L/ncu_mixtral_ws.txt" 2>&1
  echo "ncu exit $? at $(( $(date +%s) - start )) s"
) > "$L/gpu1.txt" 2>&1 &
wait
tar czf "$OUT/logs.tar.gz" -C "$OUT" logs
cat "$L/gpu0.txt" "$L/gpu1.txt"
grep -E "Duration|Throughput|Pipe|Issued|Eligible|Active Warps|No Eligible|Registers|Stall|L2 Hit|Mem Busy|Max Bandwidth|sm90_expert_ws" "$L/ncu_mixtral_ws.txt" | head -60
