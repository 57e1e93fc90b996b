#!/usr/bin/env bash
# Session 9, call 5 (nvidia-h200-x2): the streaming kernel against the choice above it at 16 tokens
# per expert (its threshold, 8, was measured on 2026-11-29, before the kernel's later changes), and
# its split-K aimed at more items (ti36: MM_STREAM_TARGET_ITEMS 3600 instead of 528 -- Mixtral T = 32
# gate/up 1792 items on 528 blocks, 3.4 each, becomes 2 splits). Main = 33c47ff (.devbin/megamoe).
# Builds (here): bash bench/stage_device.sh; bash bench/build_variants.sh "ti36=-DMM_STREAM_TARGET_ITEMS=3600L";
# bash bench/pack_devbin.sh.
. bench/call_lib.sh
bin() { [ "$1" = main ] && echo .devbin/megamoe || echo ".devbin/megamoe_$1"; }
run() { # log label binary gemm tokens E K H I
  local log=$1 lab=$2 b=$3 k=$4 tok=$5; shift 5
  timeout 60 "$(bin $b)" bench --backend cuda --format nvfp4 --experts $1 --top-k $2 --hidden $3 --inter $4 \
    --tokens $tok --iters 10 --gemm $k 2>&1 | sed "s/^bench:/bench[$lab $k]:/" >> "$L/$log"
}
(
  export CUDA_VISIBLE_DEVICES=0
  for k in stream auto; do
    run bench0.log main main $k 256,512,1024 256 8 7168 2048
    run bench0.log main main $k 128,256,512 128 8 2048 768
    run bench0.log main main $k 32,64,128 8 2 4096 14336
  done
  echo "gpu0 done at $(el) s"
) > "$L/gpu0.txt" 2>&1 &
(
  export CUDA_VISIBLE_DEVICES=1
  for n in ti36 main; do
    run bench1.log $n $n auto 8,32,128 8 2 4096 14336
    run bench1.log $n $n auto 8,32,128 128 8 2048 768
    run bench1.log $n $n auto 32,128 256 8 7168 2048
  done
  echo "gpu1 done at $(el) s"
) > "$L/gpu1.txt" 2>&1 &
wait
call_finish
