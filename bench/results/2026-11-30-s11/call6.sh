#!/usr/bin/env bash
# Session 11, call 6 (nvidia-h200-x2): wip/producer-pipe, the streaming producer loading its next
# item's tile and first columns while the current item streams (a block's later items start without
# their two dependent latencies: Qwen3 T = 32 / 128, DSv3 T = 8-128, Mixtral T = 8 / 32 run 2-4 items
# per block). Builds (here, main after 7bb2f4d's docs): bash bench/stage_device.sh;
#   TESTS=1 bash bench/build_variants.sh "pipe@wip/producer-pipe="; bash bench/pack_devbin.sh
# GPU 0: test_gpu pipe auto / stream, memcheck pipe stream.
# GPU 1: main / pipe alternating three times at T = 1, 8, 32, 128 on the three shapes.
. bench/call_lib.sh   # (the steps below written with call_lib's helpers after the call ran; the same steps)
(
  export CUDA_VISIBLE_DEVICES=0
  stream_checks test_gpu_pipe
  echo "gpu0 done at $(el) s"
) > "$L/gpu0.txt" 2>&1 &
(
  export CUDA_VISIBLE_DEVICES=1
  cmp_bench bench1.log 1,8,32,128 main pipe main pipe main pipe
  echo "gpu1 done at $(el) s"
) > "$L/gpu1.txt" 2>&1 &
wait
call_finish
