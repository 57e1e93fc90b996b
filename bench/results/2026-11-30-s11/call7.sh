#!/usr/bin/env bash
# Session 11, call 7 (nvidia-h200-x2), measurement only: the whole decode forward's timeline.
# Builds (here): bash bench/build_variants.sh "ftrace@wip/forward-trace=-DMM_STREAM_TRACE=1"; bash bench/pack_devbin.sh
# ftrace = main's device code (the default build's SASS is identical) with the trace build's stamps in
# the stage kernel (entry, waited, staged, routing block's exit) and the combine (entry, waited, exit)
# beside the streaming timeline: where do Qwen3 T = 1's ~42 us go outside the two GEMM phases?
. bench/call_lib.sh
(
  export CUDA_VISIBLE_DEVICES=1
  for s in "128 8 2048 768 1" "128 8 2048 768 8" "8 2 4096 14336 1" "256 8 7168 2048 1"; do
    set -- $s
    echo "== ftrace E=$1 K=$2 H=$3 I=$4 T=$5" >> "$L/trace.txt"
    timeout 30 .devbin/megamoe_ftrace bench --backend cuda --format nvfp4 --experts $1 --top-k $2 --hidden $3 \
      --inter $4 --tokens $5 --iters 10 >> "$L/trace.txt" 2>&1
  done
  echo "gpu1 done at $(el) s"
) > "$L/gpu1.txt" 2>&1
grep -E "^==|median|trace,|  (entry|waited|staged|exit|setup|first copy|streamed|first chunk|done) " "$L/trace.txt" | cut -c1-120
call_finish
