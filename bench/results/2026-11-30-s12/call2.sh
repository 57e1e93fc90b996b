#!/usr/bin/env bash
# Session 12, call 2 (nvidia-h200-x2, carry .devpack). main = 9aa91ca (session 11's main with
# wip/pdl-early2 merged after call 1). Builds:
#   bash bench/stage_device.sh
#   TESTS=1 bash bench/build_variants.sh "rolled@wip/stream-rolled=" "strig@wip/stage-trigger=" \
#     "wfirst@wip/weights-first=" "c12@wip/combo-s12="
#   bash bench/build_variants.sh "trace=-DMM_STREAM_TRACE=1" "tracec12@wip/combo-s12=-DMM_STREAM_TRACE=1"
#   bash bench/pack_devbin.sh
# rolled = wip/stream-rolled: a fourth streaming instantiation (per-slot, K loop not unrolled) for
#   phases whose splits stream < 16 K steps (call 1: u1, the whole build not unrolled, took Qwen3
#   T = 1 0.0423 -> 0.0401 ms; the run-time choice of wip/stream-roll was slower);
# strig = wip/stage-trigger: with few slots the stage kernel lets gate/up in at once;
# wfirst = wip/weights-first: the producer issues a chunk's first steps' weight copies before the
#   token side's loads (mbarrier.expect_tx, arrive after the header);
# c12 = wip/combo-s12: the three merged.
. bench/call_lib.sh
(
  export CUDA_VISIBLE_DEVICES=0
  stream_checks test_gpu_c12
  tg test_gpu_c12 mma
  san memcheck test_gpu_c12 auto
  san racecheck test_gpu_c12 auto
  tg test_gpu_rolled stream
  tg test_gpu_wfirst stream
  echo "gpu0 done at $(el) s"
) > "$L/gpu0.txt" 2>&1 &
(
  export CUDA_VISIBLE_DEVICES=1
  cmp_bench bench1.log 1,8,32,128 main rolled strig wfirst c12 main rolled strig wfirst c12
  for n in trace tracec12; do trace_runs $n 1; done
  echo "gpu1 done at $(el) s"
) > "$L/gpu1.txt" 2>&1 &
wait
(
  MEGAMOE_CLI=.devbin/megamoe_c12 timeout 120 python3 -m pytest -q -p no:cacheprovider -rs \
    tests/py/test_multi_gpu.py > "$L/multi_gpu_c12.txt" 2>&1
  echo "multi-GPU c12: $(tail -n 1 "$L/multi_gpu_c12.txt") at $(el) s"
) > "$L/both.txt" 2>&1
grep -E "^==|trace, |  (entry|waited|setup|first copy|streamed|first chunk|done|staged|exit) " "$L/trace.txt" | cut -c1-110
call_finish
