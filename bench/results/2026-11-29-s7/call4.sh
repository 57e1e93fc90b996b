#!/usr/bin/env bash
# Session 7 call 4 (nvidia-h200-x2, the last ~6 minutes): build s7c = s7b + the 64-token ws kernel in
# the automatic choice (gemm_plan.h). GPU 0: test_gpu s7c (auto), memcheck. GPU 1: the NVFP4 table
# and BF16 T = 128...8192 (s7c). Then both: the 2-GPU pytest, EP2 Mixtral with T_max 4096.
set -u
OUT=${OUT:-device-out}
L=$OUT/logs
mkdir -p "$L"
tar xJf .devpack/devbin.tar.xz
. bench/device_env.sh
start=$(date +%s)
el() { echo $(( $(date +%s) - start )); }
shapes=("256 8 7168 2048" "128 8 2048 768" "8 2 4096 14336")
(
  export CUDA_VISIBLE_DEVICES=0
  MEGAMOE_GEMM=auto timeout 90 .devbin/test_gpu_s7c > "$L/test_gpu_s7c_auto.log" 2>&1
  echo "test_gpu s7c auto: exit $? $(grep -E '^\[  (PASSED|FAILED)' "$L/test_gpu_s7c_auto.log" | tr '\n' ' ') at $(el) s"
  timeout 40 compute-sanitizer --tool memcheck --report-api-errors no --error-exitcode 9 .devbin/test_gpu_s7c --quick \
    > "$L/sanitize_s7c_memcheck.log" 2>&1
  echo "memcheck s7c auto: exit $? $(tail -n 1 "$L/sanitize_s7c_memcheck.log") at $(el) s"
) > "$L/gpu0.txt" 2>&1 &
(
  export CUDA_VISIBLE_DEVICES=1
  for fmt in nvfp4 bf16; do
    tok=1,8,32,128,512,2048,8192; [ $fmt = bf16 ] && tok=128,512,2048,8192
    for s in "${shapes[@]}"; do
      set -- $s
      timeout 60 .devbin/megamoe_s7c bench --backend cuda --format $fmt --experts $1 --top-k $2 --hidden $3 --inter $4 \
        --tokens $tok --iters 10 2>&1 | sed "s/^bench:/bench[s7c]:/" >> "$L/bench1.log"
      [ $(el) -lt 170 ] || break 2
    done
  done
  echo "bench1 done at $(el) s"
) > "$L/gpu1.txt" 2>&1 &
wait
(
  timeout 40 .devbin/megamoe_s7c bench --gpus 2 --format nvfp4 --experts 8 --top-k 2 --hidden 4096 --inter 14336 \
    --tokens 1,8,128,4096 --iters 10 2>&1 | sed "s/^bench:/bench[s7c nccl mixtral tmax 4096]:/" >> "$L/nccl.log"
  left=$(( 290 - $(el) ))
  if [ $left -gt 40 ]; then
    MEGAMOE_CLI=.devbin/megamoe_s7c timeout $left python3 -m pytest -q -p no:cacheprovider -rs \
      tests/py/test_multi_gpu.py > "$L/multi_gpu.txt" 2>&1
    echo "multi-GPU s7c: $(tail -n 1 "$L/multi_gpu.txt") at $(el) s"
  else echo "multi-GPU: not run (time)"; fi
) > "$L/both.txt" 2>&1
tar czf "$OUT/logs.tar.gz" -C "$OUT" logs
cat "$L/gpu0.txt" "$L/gpu1.txt" "$L/both.txt"
cat "$L/bench1.log" "$L/nccl.log" | grep -E "median|per layer" | sed -E 's/R=1 backend=cuda: //; s/ over 10//; s/ of touched expert weights//; s/, [0-9.]+ GB\/s.*experts\)//; s/\(slowest rank.s median\)//' | cut -c1-130
