#!/usr/bin/env bash
# Session 11, call 8 (nvidia-h200-x2): wip/epi-scalars -- the streaming producer loads the expert's
# epilogue scales (alpha, a2) beside its columns and hands them over with a chunk's last step, so
# the epilogues (call 7's trace: the gate/up finishers ~4 us after their sums, the down epilogue
# ~1.5 us after streaming) no longer start with two dependent loads.
# Builds (here, main 3fe33ad): TESTS=1 bash bench/build_variants.sh "es@wip/epi-scalars="; bash bench/pack_devbin.sh
# GPU 0: test_gpu es auto / stream, memcheck es stream.
# GPU 1: main / es alternating three times at T = 1, 8, 32, 128 on the three shapes.
. bench/call_lib.sh
bin() { [ "$1" = main ] && echo .devbin/megamoe || echo ".devbin/megamoe_$1"; }
(
  export CUDA_VISIBLE_DEVICES=0
  for g in auto stream; do tg test_gpu_es $g; done
  san memcheck test_gpu_es stream
  echo "gpu0 done at $(el) s"
) > "$L/gpu0.txt" 2>&1 &
(
  export CUDA_VISIBLE_DEVICES=1
  for n in main es main es main es; do
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
