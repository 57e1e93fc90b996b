#!/usr/bin/env bash
# Prepared in session 9 as its call 8 (nvidia-h200-x2; not run, the device time ran out): what in wip/stream-xgroup costs the
# 1-2-token chunks that copy per step. Builds (here): bash bench/stage_device.sh (main, whose stream
# kernel is 33c47ff's); bash bench/build_variants.sh "xga@wip/stream-xgroup="
#   "xgnever@wip/stream-xgroup=-DST_XG_MIN_COLS=17" "xg2never@wip/stream-xgroup=-DST_XG=2 -DST_XG_MIN_COLS=17";
#   "trace=-DMM_STREAM_TRACE=1"; bash bench/pack_devbin.sh. xga = the branch (groups of 4 from 3
# tokens), xgnever = its shared-memory layout only (never grouping, regions of 4 slots), xg2never =
# regions of 2; trace = main with the streaming blocks' timeline (printed at exit, last forward),
# Qwen3 T = 1 and 8, DSv3 T = 1, Mixtral T = 32, one T per run.
. bench/call_lib.sh
for gpu in 0 1; do
  (
    export CUDA_VISIBLE_DEVICES=$gpu
    if [ $gpu = 0 ]; then set -- megamoe megamoe_xgnever; else set -- megamoe megamoe_xga megamoe_xg2never; fi  # main on both: the baseline per GPU
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
  export CUDA_VISIBLE_DEVICES=0
  for s in "128 8 2048 768 1" "128 8 2048 768 8" "256 8 7168 2048 1" "8 2 4096 14336 32"; do
    set -- $s
    echo "== trace E=$1 K=$2 H=$3 I=$4 T=$5"
    timeout 30 .devbin/megamoe_trace bench --backend cuda --format nvfp4 --experts $1 --top-k $2 --hidden $3       --inter $4 --tokens $5 --iters 10 2>&1 | grep -v "^bench:"
  done
) > "$L/trace.txt" 2>&1
cat "$L/trace.txt"
call_finish
