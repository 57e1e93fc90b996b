#!/usr/bin/env bash
# Session 9, call 8 (nvidia-h200-x2, the last ~3 minutes): what in wip/stream-xgroup costs the
# 1-2-token chunks that copy per step. .devbin/megamoe = ac4a987 (the branch merged: groups of 4 from
# 3 tokens), megamoe_old = 33c47ff, xgnever = the branch never grouping (its shared-memory layout
# only, ST_XG 4), xg2never = the same with regions of 2 slots. Builds: see call7.sh, then
# bash bench/build_variants.sh "xgnever@wip/stream-xgroup=-DST_XG_MIN_COLS=17"
#   "xg2never@wip/stream-xgroup=-DST_XG=2 -DST_XG_MIN_COLS=17"; bash bench/pack_devbin.sh.
. bench/call_lib.sh
for gpu in 0 1; do
  (
    export CUDA_VISIBLE_DEVICES=$gpu
    if [ $gpu = 0 ]; then set -- megamoe_old megamoe_xgnever; else set -- megamoe megamoe_xg2never; fi
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
call_finish
