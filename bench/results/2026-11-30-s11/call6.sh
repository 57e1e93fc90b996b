#!/usr/bin/env bash
# Session 11, call 6 (nvidia-h200-x2): wip/producer-pipe, the streaming producer loading its next
# item's tile and first columns while the current item streams (a block's later items start without
# their two dependent latencies: Qwen3 T = 32 / 128, DSv3 T = 8-128, Mixtral T = 8 / 32 run 2-4 items
# per block). Builds (here, main after 7bb2f4d's docs): bash bench/stage_device.sh;
#   TESTS=1 bash bench/build_variants.sh "pipe@wip/producer-pipe="; bash bench/pack_devbin.sh
# GPU 0: test_gpu pipe auto / stream, memcheck pipe stream.
# GPU 1: main / pipe alternating three times at T = 1, 8, 32, 128 on the three shapes.
. bench/call_lib.sh
bin() { [ "$1" = main ] && echo .devbin/megamoe || echo ".devbin/megamoe_$1"; }
(
  export CUDA_VISIBLE_DEVICES=0
  for g in auto stream; do tg test_gpu_pipe $g; done
  san memcheck test_gpu_pipe stream
  echo "gpu0 done at $(el) s"
) > "$L/gpu0.txt" 2>&1 &
(
  export CUDA_VISIBLE_DEVICES=1
  for n in main pipe main pipe main pipe; do
    for s in "128 8 2048 768" "8 2 4096 14336" "256 8 7168 2048"; do
      set -- $s
      timeout 40 "$(bin $n)" bench --backend cuda --format nvfp4 --experts $1 --top-k $2 --hidden $3 --inter $4 \
        --tokens 1,8,32,128 --iters 10 2>&1 | sed "s/^bench:/bench[$n]:/" >> "$L/bench1.log"
    done
  done
  echo "gpu1 done at $(el) s"
) > "$L/gpu1.txt" 2>&1 &
wait
call_finish
