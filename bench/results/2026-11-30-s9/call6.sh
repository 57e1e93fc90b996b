#!/usr/bin/env bash
# Session 9, call 6 (nvidia-h200-x2): wip/stream-xgroup -- the streaming kernel's activation rows
# copied for 2 (xg2) or 4 (xg4) K steps per bulk copy -- against main 33c47ff. Builds (here):
# TESTS=1 bash bench/build_variants.sh "xg2@wip/stream-xgroup=" "xg4@wip/stream-xgroup=-DST_XG=4";
# bash bench/pack_devbin.sh (main's .devbin/megamoe from stage_device.sh at 33c47ff).
# GPU 0: test_gpu xg2 stream / auto, xg4 stream, memcheck xg2 stream. GPU 1: the streaming cells.
. bench/call_lib.sh
bin() { [ "$1" = main ] && echo .devbin/megamoe || echo ".devbin/megamoe_$1"; }
(
  export CUDA_VISIBLE_DEVICES=0
  for run in "xg2 stream" "xg4 stream" "xg2 auto"; do
    set -- $run
    MEGAMOE_GEMM=$2 timeout 80 .devbin/test_gpu_$1 > "$L/test_gpu_$1_$2.log" 2>&1
    echo "test_gpu $1 $2: exit $? $(grep -E '^\[  (PASSED|FAILED)' "$L/test_gpu_$1_$2.log" | tr '\n' ' ') at $(el) s"
  done
  MEGAMOE_GEMM=stream timeout 60 compute-sanitizer --tool memcheck --report-api-errors no --error-exitcode 9 \
    .devbin/test_gpu_xg2 --quick > "$L/memcheck_xg2.log" 2>&1
  echo "memcheck xg2 stream: exit $? $(tail -n 1 "$L/memcheck_xg2.log") at $(el) s"
) > "$L/gpu0.txt" 2>&1 &
(
  export CUDA_VISIBLE_DEVICES=1
  for n in xg2 xg4 main; do
    for s in "256 8 7168 2048 1,8,32,128,256" "8 2 4096 14336 1,8,32" "128 8 2048 768 1,8,32,128"; do
      set -- $s
      timeout 40 "$(bin $n)" bench --backend cuda --format nvfp4 --experts $1 --top-k $2 --hidden $3 --inter $4 \
        --tokens $5 --iters 10 2>&1 | sed "s/^bench:/bench[$n]:/" >> "$L/bench1.log"
    done
  done
  echo "gpu1 done at $(el) s"
) > "$L/gpu1.txt" 2>&1 &
wait
call_finish
