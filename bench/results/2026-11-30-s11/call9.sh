#!/usr/bin/env bash
# Prepared in session 11 as the next session's first call (nvidia-h200-x2; not run: the session's
# device time was spent). Builds (here, main after session 11's last commit; packed in .devpack):
#   bash bench/stage_device.sh
#   TESTS=1 bash bench/build_variants.sh "pdl@wip/pdl-early="
#   bash bench/build_variants.sh "tracepdl@wip/pdl-early=-DMM_STREAM_TRACE=1" "trace=-DMM_STREAM_TRACE=1"
#   bash bench/pack_devbin.sh
# pdl = wip/pdl-early: gate/up's streaming producers let the down kernel in once every copy is
#   issued, and the down kernel does its setup, its first item's load chain and its first weight
#   copies before it waits for gate/up. Call 7's timeline (Qwen3 T = 1): gate/up's last block ends
#   at 17.8 us, down's first copy is at 22.1 (entry 18.9, setup 20.2) -- ~3 us that could overlap the
#   gate/up finishers' tail; the same boundary at every decode cell.
# GPU 0: test_gpu pdl auto / stream (the occupier test included: early launch must not hang) and
#   memcheck stream. GPU 1: main / pdl alternating three times at T = 1, 8, 32, 128 on the three
#   shapes; the timelines of main and pdl at T = 1. Both: the 2-GPU pytest with pdl (NCCL runs the
#   same kernels). Land it if it holds, then bash bench/full_suite.sh on the merged main.
. bench/call_lib.sh
(
  export CUDA_VISIBLE_DEVICES=0
  stream_checks test_gpu_pdl
  echo "gpu0 done at $(el) s"
) > "$L/gpu0.txt" 2>&1 &
(
  export CUDA_VISIBLE_DEVICES=1
  cmp_bench bench1.log 1,8,32,128 main pdl main pdl main pdl
  trace_runs trace 1
  trace_runs tracepdl 1
  echo "gpu1 done at $(el) s"
) > "$L/gpu1.txt" 2>&1 &
wait
(
  MEGAMOE_CLI=.devbin/megamoe_pdl timeout 120 python3 -m pytest -q -p no:cacheprovider -rs \
    tests/py/test_multi_gpu.py > "$L/multi_gpu_pdl.txt" 2>&1
  echo "multi-GPU pdl: $(tail -n 1 "$L/multi_gpu_pdl.txt") at $(el) s"
) > "$L/both.txt" 2>&1
grep -E "^==|trace, |  (entry|waited|setup|first copy|streamed|first chunk|done|staged|exit) " "$L/trace.txt" | cut -c1-110
call_finish
