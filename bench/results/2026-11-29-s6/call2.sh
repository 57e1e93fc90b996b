#!/usr/bin/env bash
# Session 6 call 2 (nvidia-h200-x2): the warp-specialized kernel (sm90_expert_ws.cu) and the BF16
# step-major layout. GPU 0: test_gpu with each kernel forced and chosen, then memcheck and racecheck
# with ws forced; GPU 1: megamoe bench, ws (chosen above MM_WS_MIN_TOKENS) against wgmma forced.
set -u
OUT=${OUT:-device-out}
L=$OUT/logs
mkdir -p "$L"
tar xJf .devpack/devbin.tar.xz
. bench/device_env.sh
start=$(date +%s)
(
  export CUDA_VISIBLE_DEVICES=0
  for k in ws auto stream wgmma mma; do
    MEGAMOE_GEMM=$k timeout 150 .devbin/test_gpu > "$L/test_gpu_$k.log" 2>&1
    echo "test_gpu $k: exit $? $(grep -E '^\[  (PASSED|FAILED)' "$L/test_gpu_$k.log" | tr '\n' ' ') at $(( $(date +%s) - start )) s"
  done
  for tool in memcheck racecheck; do
    excl=(); [ $tool = racecheck ] && excl=(--kernel-name-exclude kns=sm90_expert_stream_kernel)
    MEGAMOE_GEMM=ws timeout 120 compute-sanitizer --tool $tool --report-api-errors no --error-exitcode 9 "${excl[@]}" \
      .devbin/test_gpu --quick > "$L/sanitize_ws_$tool.log" 2>&1
    echo "sanitize ws $tool: exit $? $(tail -n 1 "$L/sanitize_ws_$tool.log") at $(( $(date +%s) - start )) s"
  done
) > "$L/gpu0.txt" 2>&1 &
(
  export CUDA_VISIBLE_DEVICES=1
  for fmt in nvfp4 bf16; do
    for shape in "256 8 7168 2048" "128 8 2048 768" "8 2 4096 14336"; do
      set -- $shape
      for g in auto wgmma; do
        timeout 120 .devbin/megamoe bench --backend cuda --format $fmt --experts $1 --top-k $2 --hidden $3 --inter $4 \
          --tokens 128,512,2048,8192 --iters 10 --gemm $g 2>&1 | sed "s/^bench:/bench[$g]:/" >> "$L/bench.log"
      done
    done
  done
  echo "bench done at $(( $(date +%s) - start )) s"
  grep -E "^bench\[" "$L/bench.log" | sed -E 's/ +/ /g' | cut -c1-200
) > "$L/gpu1.txt" 2>&1 &
wait
tar czf "$OUT/logs.tar.gz" -C "$OUT" logs
cat "$L/gpu0.txt" "$L/gpu1.txt"
