#!/usr/bin/env bash
# Session 12, call 4 (nvidia-h200-x2, carry .devpack): main after merging wip/stage-trigger2 (the stage
# kernel's early trigger, which changes launch order only) -- the checks that run the stage kernel's
# routing path in every GEMM kernel mode, and the decode cells once more. Build: bash bench/stage_device.sh;
# bash bench/pack_devbin.sh.
. bench/call_lib.sh
(
  export CUDA_VISIBLE_DEVICES=0
  tg test_gpu auto
  san memcheck test_gpu auto
  san racecheck test_gpu auto
  echo "gpu0 done at $(el) s"
) > "$L/gpu0.txt" 2>&1 &
(
  export CUDA_VISIBLE_DEVICES=1
  tg test_gpu mma
  tg test_gpu wgmma
  cmp_bench bench1.log 1,2,8,32 main
  echo "gpu1 done at $(el) s"
) > "$L/gpu1.txt" 2>&1 &
wait
call_finish
