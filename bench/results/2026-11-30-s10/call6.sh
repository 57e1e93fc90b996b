#!/usr/bin/env bash
# Session 10 call 6 (nvidia-h200-x2): wip/stream-early-w (main 84b82b1 + the producer issuing its
# first steps' weights before the token lookups). Builds (here): bash bench/stage_device.sh;
# bash bench/build_variants.sh "old@main="; bash bench/pack_devbin.sh.
# GPU 0: test_gpu stream / auto, memcheck stream. GPU 1: old / new alternating twice at the
# streaming cells. Both: the 2-GPU pytest (bitwise one GPU = two GPUs).
. bench/call_lib.sh
bin() { [ "$1" = new ] && echo .devbin/megamoe || echo ".devbin/megamoe_$1"; }
(
  export CUDA_VISIBLE_DEVICES=0
  for g in stream auto; do
    MEGAMOE_GEMM=$g timeout 100 .devbin/test_gpu > "$L/test_gpu_$g.log" 2>&1
    echo "test_gpu $g: exit $? $(grep -E '^\[  (PASSED|FAILED)' "$L/test_gpu_$g.log" | tr '\n' ' ') at $(el) s"
  done
  MEGAMOE_GEMM=stream timeout 100 compute-sanitizer --tool memcheck --report-api-errors no --error-exitcode 9 \
    .devbin/test_gpu --quick > "$L/memcheck_stream.log" 2>&1
  echo "memcheck stream: exit $? $(tail -n 1 "$L/memcheck_stream.log") at $(el) s"
  echo "gpu0 done at $(el) s"
) > "$L/gpu0.txt" 2>&1 &
(
  export CUDA_VISIBLE_DEVICES=1
  for n in old new old new; do
    for s in "128 8 2048 768 1,8,32,128" "8 2 4096 14336 1,8,32" "256 8 7168 2048 1,8,32"; do
      set -- $s
      timeout 40 "$(bin $n)" bench --backend cuda --format nvfp4 --experts $1 --top-k $2 --hidden $3 --inter $4 \
        --tokens $5 --iters 10 2>&1 | sed "s/^bench:/bench[$n]:/" >> "$L/bench1.log"
    done
  done
  echo "gpu1 done at $(el) s"
) > "$L/gpu1.txt" 2>&1 &
wait
(
  MEGAMOE_CLI=.devbin/megamoe timeout 120 python3 -m pytest -q -p no:cacheprovider -rs \
    tests/py/test_multi_gpu.py > "$L/multi_gpu.txt" 2>&1
  echo "multi-GPU: $(tail -n 1 "$L/multi_gpu.txt") at $(el) s"
) > "$L/both.txt" 2>&1
call_finish
