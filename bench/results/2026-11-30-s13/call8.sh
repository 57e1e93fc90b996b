#!/usr/bin/env bash
# Session 13, call 8 (nvidia-h200-x2, carry .devpack, timeout_s 300): main with wip/route-warp2
# merged (call 7 ran its test_gpu auto, memcheck and racecheck auto as a variant). Builds:
#   bash bench/stage_device.sh && bash bench/pack_devbin.sh
# GPU 0: test_gpu stream and mma; GPU 1: test_gpu ws and wgmma, then the decode row (T = 1, 2, 8) of
# each shape; both: the 2-GPU pytest (NCCL: R = 2 runs the stage kernel without the routing warp).
. bench/call_lib.sh
(
  export CUDA_VISIBLE_DEVICES=0
  for g in stream mma; do tg test_gpu $g; done
  echo "gpu0 done at $(el) s"
) > "$L/gpu0.txt" 2>&1 &
(
  export CUDA_VISIBLE_DEVICES=1
  for g in ws wgmma; do tg test_gpu $g; done
  cmp_bench bench_decode.log 1,2,8 main main
  echo "gpu1 done at $(el) s"
) > "$L/gpu1.txt" 2>&1 &
wait
multi_gpu main > "$L/both.txt" 2>&1
call_finish
