#!/usr/bin/env bash
# Session 13, call 7 (nvidia-h200-x2, carry .devpack, timeout_s 600): the full suite on main after
# merging wip/host-plan, wip/stage-early-x and wip/residency-guard (calls 5-6, session 12's prepared
# calls), and wip/route-warp2 beside it. Builds:
#   bash bench/stage_device.sh
#   TESTS=1 bash bench/build_variants.sh "rw2@wip/route-warp2=" "trace=-DMM_STREAM_TRACE=1"
#   bash bench/pack_devbin.sh
# rw2 = wip/route-warp2: session 12's wip/stage-route-warp (a one-token forward of one rank routes in
#   an extra warp of the stage block: -3.0 to -3.5% at T = 1 in call 6, but +3-10% at T = 2 and 28
#   racecheck hazards on its bar.arrive hand-off) with the stage kernel templated on the routing warp
#   (every other launch the plain block-barrier code) and a bar.sync hand-off on both sides.
# GPU 0 after the suite: rw2's test_gpu auto (the one-token edge cases run the routing warp),
#   memcheck and racecheck auto. GPU 1 after the tables: main / rw2 twice at T = 1, 2, 8, and the
#   trace build at T = 1 (main's timelines with host-plan and stage-early-x in).
extra_gpu0() {
  tg test_gpu_rw2 auto
  san memcheck test_gpu_rw2 auto
  san racecheck test_gpu_rw2 auto
}
extra_gpu1() {
  cmp_bench bench_rw.log 1,2,8 main rw2 main rw2
  trace_runs trace 1
}
. bench/full_suite.sh
grep -E "^==|trace, |  (entry|waited|setup|first copy|first full|streamed|done|staged|exit|amax|route [a-z]+) " "$L/trace.txt" | cut -c1-100
