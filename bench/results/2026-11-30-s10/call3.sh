#!/usr/bin/env bash
# Session 10 call 3 (nvidia-h200-x2). Builds (here, on wip/stream-xg2): bash bench/stage_device.sh;
# bash bench/build_variants.sh "old@main=" "trace=-DMM_STREAM_TRACE=1"; bash bench/pack_devbin.sh.
# GPU 0: test_gpu stream / auto and memcheck (stream forced) of the two-layout streaming kernel; the
#        trace (now with each block's streaming end, SM and first item) at Qwen3 T = 1, 8, DSv3 T = 1,
#        Mixtral T = 1.
# GPU 1: the streaming cells, main (old) against the branch (new), twice, alternating.
. bench/call_lib.sh
bin() { [ "$1" = new ] && echo .devbin/megamoe || echo ".devbin/megamoe_$1"; }
(
  export CUDA_VISIBLE_DEVICES=0
  for g in stream auto; do
    MEGAMOE_GEMM=$g timeout 90 .devbin/test_gpu > "$L/test_gpu_$g.log" 2>&1
    echo "test_gpu $g: exit $? $(grep -E '^\[  (PASSED|FAILED)' "$L/test_gpu_$g.log" | tr '\n' ' ') at $(el) s"
  done
  MEGAMOE_GEMM=stream timeout 100 compute-sanitizer --tool memcheck --report-api-errors no --error-exitcode 9 \
    .devbin/test_gpu --quick > "$L/memcheck_stream.log" 2>&1
  echo "memcheck stream: exit $? $(tail -n 1 "$L/memcheck_stream.log") at $(el) s"
  for s in "128 8 2048 768 1" "128 8 2048 768 8" "256 8 7168 2048 1" "8 2 4096 14336 1"; do
    set -- $s
    echo "== trace E=$1 K=$2 H=$3 I=$4 T=$5" >> "$L/trace.txt"
    timeout 30 .devbin/megamoe_trace bench --backend cuda --format nvfp4 --experts $1 --top-k $2 --hidden $3 \
      --inter $4 --tokens $5 --iters 10 >> "$L/trace.txt" 2>&1
  done
  echo "gpu0 done at $(el) s"
) > "$L/gpu0.txt" 2>&1 &
(
  export CUDA_VISIBLE_DEVICES=1
  for n in old new old new; do
    for s in "256 8 7168 2048 1,8,32,128,256" "128 8 2048 768 1,8,32,128" "8 2 4096 14336 1,8,32"; do
      set -- $s
      timeout 40 "$(bin $n)" bench --backend cuda --format nvfp4 --experts $1 --top-k $2 --hidden $3 --inter $4 \
        --tokens $5 --iters 10 2>&1 | sed "s/^bench:/bench[$n]:/" >> "$L/bench1.log"
    done
  done
  echo "gpu1 done at $(el) s"
) > "$L/gpu1.txt" 2>&1 &
wait
grep -v "^bench" "$L/trace.txt"
call_finish
