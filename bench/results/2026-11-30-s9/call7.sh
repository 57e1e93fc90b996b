#!/usr/bin/env bash
# Session 9, call 7 (nvidia-h200-x2, the last ~6 minutes): main ac4a987 = the streaming kernel's
# grouped activation copies (4 K steps per copy for chunks of 3 tokens or more) merged. Builds (here):
# bash bench/stage_device.sh, with 33c47ff's CLI kept as .devbin/megamoe_old; bash bench/pack_devbin.sh.
# GPU 0: test_gpu stream / auto, memcheck stream. GPU 1: the streaming cells, main against old.
. bench/call_lib.sh
(
  export CUDA_VISIBLE_DEVICES=0
  for g in stream auto; do
    MEGAMOE_GEMM=$g timeout 70 .devbin/test_gpu > "$L/test_gpu_main_$g.log" 2>&1
    echo "test_gpu main $g: exit $? $(grep -E '^\[  (PASSED|FAILED)' "$L/test_gpu_main_$g.log" | tr '\n' ' ') at $(el) s"
  done
  MEGAMOE_GEMM=stream timeout 50 compute-sanitizer --tool memcheck --report-api-errors no --error-exitcode 9 \
    .devbin/test_gpu --quick > "$L/memcheck_stream.log" 2>&1
  echo "memcheck stream: exit $? $(tail -n 1 "$L/memcheck_stream.log") at $(el) s"
) > "$L/gpu0.txt" 2>&1 &
(
  export CUDA_VISIBLE_DEVICES=1
  for n in megamoe megamoe_old; do
    for s in "256 8 7168 2048 1,8,32,128,256" "8 2 4096 14336 1,8,32" "128 8 2048 768 1,8,32,128"; do
      set -- $s
      timeout 40 .devbin/$n bench --backend cuda --format nvfp4 --experts $1 --top-k $2 --hidden $3 --inter $4 \
        --tokens $5 --iters 10 2>&1 | sed "s/^bench:/bench[$n]:/" >> "$L/bench1.log"
    done
  done
  echo "gpu1 done at $(el) s"
) > "$L/gpu1.txt" 2>&1 &
wait
call_finish
