#!/usr/bin/env bash
# Prepared in session 11 as the next session's first call (nvidia-h200-x2; not run: the session's
# device time was spent; give it timeout_s 600). Builds (here, main after session 11's last commit,
# its megamoe and test_gpu rebuilt after the st_variants commit; packed in .devpack):
#   bash bench/stage_device.sh
#   TESTS=1 bash bench/build_variants.sh "pdl@wip/pdl-early=" "pdl2@wip/pdl-early2=" "roll@wip/stream-roll=" \
#     "stq@wip/stage-lanes="
#   bash bench/build_variants.sh "tracepdl@wip/pdl-early=-DMM_STREAM_TRACE=1" "trace=-DMM_STREAM_TRACE=1" \
#     "tracepdl2@wip/pdl-early2=-DMM_STREAM_TRACE=1" "u1=-DMM_STREAM_UNROLL=1" \
#     "traceroll@wip/stream-roll=-DMM_STREAM_TRACE=1" "tracestq@wip/stage-lanes=-DMM_STREAM_TRACE=1" \
#     "combo@wip/combo-s11="
#   bash bench/pack_devbin.sh
# pdl = wip/pdl-early: gate/up's streaming producers let the down kernel in once every copy is
#   issued, and the down kernel does its setup, its first item's load chain and its first weight
#   copies before it waits for gate/up. Call 7's timeline (Qwen3 T = 1): gate/up's last block ends
#   at 17.8 us, down's first copy is at 22.1 (entry 18.9, setup 20.2) -- ~3 us that could overlap the
#   gate/up finishers' tail; the same boundary at every decode cell.
# pdl2 = wip/pdl-early2: pdl, and the down kernel lets the combine in the same way; the combine reads
#   the token's state and its slots' ids and weights before its wait (every forward's combine, so
#   pdl2 is also tested with wgmma forced, where the down kernel before it does not trigger early).
# roll = wip/stream-roll: chunks of < 16 K steps take the streaming K loop not unrolled (one step's
#   code fetched cold per forward instead of four: Qwen3 T = 1 streams 8 / 12 steps per block);
# u1 = main with the loop never unrolled (MM_STREAM_UNROLL 1): what unrolling costs cold at T = 1
#   and buys warm at T >= 8 (2-7% at DSv3 T = 8-128 when last measured, 2026-11-29);
# stq = wip/stage-lanes: the stage kernel quantizes with a thread per pair of values (a 16-value
#   block's amax by shuffles over its 8 threads): 2 values' code per thread instead of 16 on the cold
#   critical path (call 7: the stage kernel takes 6.4 us at Qwen3 T = 1, 3.3 of them quantizing one
#   token). Its bytes must stay the CPU's: test_gpu's activation-bytes test, in every mode;
# combo = wip/combo-s11: main + pdl-early2 + stream-roll + stage-lanes merged (they merge cleanly):
#   the three together, measured only (test what lands with bench/full_suite.sh).
# GPU 0: test_gpu pdl and pdl2 auto / stream (the occupier test included: early launch must not
#   hang), memcheck stream, pdl2 with wgmma forced; stq auto, memcheck and racecheck auto.
# GPU 1: main / pdl / pdl2 / roll / u1 / stq / combo alternating twice at T = 1, 8, 32, 128 on the three
#   shapes; the timelines at T = 1; test_gpu roll auto / stream, memcheck stream.
# Both: the 2-GPU pytest with pdl2 and with stq (NCCL runs the same kernels). ~8 min.
# Land what holds (pdl-early2, stream-roll and stage-lanes touch different code: merge each that
#   holds), then bash bench/full_suite.sh on the merged main.
. bench/call_lib.sh
(
  export CUDA_VISIBLE_DEVICES=0
  stream_checks test_gpu_pdl
  stream_checks test_gpu_pdl2
  tg test_gpu_pdl2 wgmma
  tg test_gpu_stq auto
  san memcheck test_gpu_stq auto
  san racecheck test_gpu_stq auto
  echo "gpu0 done at $(el) s"
) > "$L/gpu0.txt" 2>&1 &
(
  export CUDA_VISIBLE_DEVICES=1
  cmp_bench bench1.log 1,8,32,128 main pdl pdl2 roll u1 stq combo main pdl pdl2 roll u1 stq combo
  for n in trace tracepdl tracepdl2 traceroll tracestq; do trace_runs $n 1; done
  stream_checks test_gpu_roll
  tg test_gpu auto # main's stream launch now reads one table of instantiations (host code; SASS unchanged)
  echo "gpu1 done at $(el) s"
) > "$L/gpu1.txt" 2>&1 &
wait
(
  MEGAMOE_CLI=.devbin/megamoe_pdl2 timeout 120 python3 -m pytest -q -p no:cacheprovider -rs \
    tests/py/test_multi_gpu.py > "$L/multi_gpu_pdl2.txt" 2>&1
  echo "multi-GPU pdl2: $(tail -n 1 "$L/multi_gpu_pdl2.txt") at $(el) s"
  MEGAMOE_CLI=.devbin/megamoe_stq timeout 120 python3 -m pytest -q -p no:cacheprovider -rs \
    tests/py/test_multi_gpu.py > "$L/multi_gpu_stq.txt" 2>&1
  echo "multi-GPU stq: $(tail -n 1 "$L/multi_gpu_stq.txt") at $(el) s"
) > "$L/both.txt" 2>&1
grep -E "^==|trace, |  (entry|waited|setup|first copy|streamed|first chunk|done|staged|exit) " "$L/trace.txt" | cut -c1-110
call_finish
