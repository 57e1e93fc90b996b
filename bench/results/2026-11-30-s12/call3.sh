#!/usr/bin/env bash
# Session 12, call 3 (nvidia-h200-x2, carry .devpack): bench/full_suite.sh on main d2ae08f (session 11's
# main + wip/pdl-early2 + wip/stream-rolled), and two variants measured after each GPU's part. Builds:
#   bash bench/stage_device.sh
#   TESTS=1 bash bench/build_variants.sh "strig2@wip/stage-trigger2=" "wf1@wip/weights-first2="
#   bash bench/pack_devbin.sh
# strig2 = wip/stage-trigger2: the stage kernel lets gate/up in at once only where it routes more than
#   one token (call 2: at T = 1 the trigger lost 16% on Qwen3, at T = 8 it won 2-3% on Mixtral / DSv3);
# wf1 = wip/weights-first2: only the first step's weights of a chunk before its token side (call 2:
#   the ring's worth first queued the first step's rows behind them, 5-10% slower).
extra_gpu0() {
  tg test_gpu_strig2 auto
  tg test_gpu_wf1 stream
}
extra_gpu1() {
  cmp_bench bench1.log 1,2,8,32 main strig2 wf1 main strig2 wf1
}
. bench/full_suite.sh
