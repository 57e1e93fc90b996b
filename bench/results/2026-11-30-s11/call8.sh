#!/usr/bin/env bash
# Session 11, call 8 (nvidia-h200-x2): wip/epi-scalars -- the streaming producer loads the expert's
# epilogue scales (alpha, a2) beside its columns and hands them over with a chunk's last step, so
# the epilogues (call 7's trace: the gate/up finishers ~4 us after their sums, the down epilogue
# ~1.5 us after streaming) no longer start with two dependent loads.
# Builds (here, main 3fe33ad): TESTS=1 bash bench/build_variants.sh "es@wip/epi-scalars="; bash bench/pack_devbin.sh
# GPU 0: test_gpu es auto / stream, memcheck es stream.
# GPU 1: main / es alternating three times at T = 1, 8, 32, 128 on the three shapes.
. bench/call_lib.sh   # (the steps below written with call_lib's helpers after the call ran; the same steps)
(
  export CUDA_VISIBLE_DEVICES=0
  stream_checks test_gpu_es
  echo "gpu0 done at $(el) s"
) > "$L/gpu0.txt" 2>&1 &
(
  export CUDA_VISIBLE_DEVICES=1
  cmp_bench bench1.log 1,8,32,128 main es main es main es
  echo "gpu1 done at $(el) s"
) > "$L/gpu1.txt" 2>&1 &
wait
call_finish
