#!/usr/bin/env bash
# Prepared in session 9 as its call 8 (nvidia-h200-x2; not run, the device time ran out).
# Builds (here): bash bench/stage_device.sh (main); then
#   bash bench/build_variants.sh "xga@wip/stream-xgroup=" "xgnever@wip/stream-xgroup=-DST_XG_MIN_COLS=17" \
#     "xg2never@wip/stream-xgroup=-DST_XG=2 -DST_XG_MIN_COLS=17" \
#     "xgnxf@wip/stream-xgroup=-DST_XG_MIN_COLS=17 -DST_X_FIRST=1" \
#     "ms4=-DMM_STREAM_MIN_SPLIT_STEPS=4" "trace=-DMM_STREAM_TRACE=1"
#   bash bench/pack_devbin.sh
# 1. What in wip/stream-xgroup costs the 1-2-token chunks that copy per step (DECISIONS 59): xga = the
#    branch (groups of 4 from 3 tokens), xgnever = its shared-memory layout only (never grouping,
#    regions of 4 slots), xg2never = regions of 2, xgnxf = xgnever with the token rows before the
#    weight slots; main on both GPUs as the baseline. DSv3 T = 8, 32, Mixtral T = 32.
# 2. ms4 = main splitting K down to 4 steps per split (Qwen3's 12-step down projection splits at
#    T = 1) against main at T = 1, 8, 32 on the three shapes (GPU 1).
# 3. trace = main with the streaming blocks' timeline (printed at exit, for the last forward): Qwen3
#    T = 1 and 8, DSv3 T = 1, Mixtral T = 32, one T per run (GPU 0).
. bench/call_lib.sh
for gpu in 0 1; do
  (
    export CUDA_VISIBLE_DEVICES=$gpu
    if [ $gpu = 0 ]; then set -- megamoe megamoe_xgnever megamoe_xgnxf; else set -- megamoe megamoe_xga megamoe_xg2never; fi  # main on both: the baseline per GPU
    for n in "$@"; do
      timeout 30 .devbin/$n bench --backend cuda --format nvfp4 --experts 256 --top-k 8 --hidden 7168 --inter 2048 \
        --tokens 8,32 --iters 10 2>&1 | sed "s/^bench:/bench[$n]:/" >> "$L/bench$gpu.log"
      timeout 20 .devbin/$n bench --backend cuda --format nvfp4 --experts 8 --top-k 2 --hidden 4096 --inter 14336 \
        --tokens 32 --iters 10 2>&1 | sed "s/^bench:/bench[$n]:/" >> "$L/bench$gpu.log"
    done
    echo "gpu$gpu done at $(el) s"
  ) > "$L/gpu$gpu.txt" 2>&1 &
done
wait
(
  export CUDA_VISIBLE_DEVICES=1
  for n in megamoe megamoe_ms4; do
    for s in "128 8 2048 768" "256 8 7168 2048" "8 2 4096 14336"; do
      set -- $s
      timeout 30 .devbin/$n bench --backend cuda --format nvfp4 --experts $1 --top-k $2 --hidden $3 --inter $4 \
        --tokens 1,8,32 --iters 10 2>&1 | sed "s/^bench:/bench[$n]:/" >> "$L/bench_ms4.log"
    done
  done
) &
(
  export CUDA_VISIBLE_DEVICES=0
  for s in "128 8 2048 768 1" "128 8 2048 768 8" "256 8 7168 2048 1" "8 2 4096 14336 32"; do
    set -- $s
    echo "== trace E=$1 K=$2 H=$3 I=$4 T=$5"
    timeout 30 .devbin/megamoe_trace bench --backend cuda --format nvfp4 --experts $1 --top-k $2 --hidden $3 \
      --inter $4 --tokens $5 --iters 10 2>&1 | grep -v "^bench:"
  done
) > "$L/trace.txt" 2>&1
wait
cat "$L/trace.txt"
call_finish
