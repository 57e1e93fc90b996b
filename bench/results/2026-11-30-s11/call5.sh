#!/usr/bin/env bash
# Session 11, call 5 (nvidia-h200-x2), measurement only (the session's last device minutes).
# Builds (here, main 7bb2f4d): bash bench/stage_device.sh; bash bench/build_variants.sh
#   "t1056=-DMM_STREAM_TARGET_ITEMS=1056L" "xg2=-DST_XG_MIN_AVG=2"; bash bench/pack_devbin.sh
# t1056 = the streaming split plan aiming at 1056 items instead of the 528 resident blocks: Mixtral
#   T = 1 gate/up in 2 splits (896 items: 7 or 6 per SM of 32 steps, where 448 unsplit items leave
#   52 SMs a fourth 64-step item) and down in 16, DSv3 T = 1 gate/up in 4 and down in 2 -- does
#   splitting pay now that the finisher's epilogue is compact?
# xg2 = the grouped streaming layout from 2 slots per expert (4 on main): Qwen3 T = 32, Mixtral T = 8.
# GPU 0: main / t1056 alternating three times at T = 1 on the three shapes.
# GPU 1: main / xg2 alternating three times at Qwen3 T = 16, 32 and Mixtral T = 8, 16.
. bench/call_lib.sh
(
  export CUDA_VISIBLE_DEVICES=0
  for n in main t1056 main t1056 main t1056; do
    for s in "128 8 2048 768" "8 2 4096 14336" "256 8 7168 2048"; do
      set -- $s
      timeout 30 "$(bin $n)" bench --backend cuda --format nvfp4 --experts $1 --top-k $2 --hidden $3 --inter $4 \
        --tokens 1 --iters 10 2>&1 | sed "s/^bench:/bench[$n]:/" >> "$L/bench1.log"
    done
  done
  echo "gpu0 done at $(el) s"
) > "$L/gpu0.txt" 2>&1 &
(
  export CUDA_VISIBLE_DEVICES=1
  for n in main xg2 main xg2 main xg2; do
    timeout 30 "$(bin $n)" bench --backend cuda --format nvfp4 --experts 128 --top-k 8 --hidden 2048 --inter 768 \
      --tokens 16,32 --iters 10 2>&1 | sed "s/^bench:/bench[$n]:/" >> "$L/bench2.log"
    timeout 30 "$(bin $n)" bench --backend cuda --format nvfp4 --experts 8 --top-k 2 --hidden 4096 --inter 14336 \
      --tokens 8,16 --iters 10 2>&1 | sed "s/^bench:/bench[$n]:/" >> "$L/bench2.log"
  done
  echo "gpu1 done at $(el) s"
) > "$L/gpu1.txt" 2>&1 &
wait
call_finish
