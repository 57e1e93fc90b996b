#!/usr/bin/env bash
# Session 14, call 5 (nvidia-h200-x2, carry .devpack, timeout_s 330). Builds: main 5820b59
# (bench/stage_device.sh) and TESTS=1 bash bench/build_variants.sh "ldsm@wip/stream-ldsm=".
# ldsm: the streaming kernel's consumers read the token rows by ldmatrix.x4 (two per n-tile and K
# step instead of eight 32-bit loads: the same bytes into the same registers; SASS of the 4-block
# instantiations: 120 LDS -> 30 LDSM). Session 13's ncu had a third of the kernel's stalls on
# shared-memory scoreboards at Qwen3 T = 128.
. bench/call_lib.sh
(
  export CUDA_VISIBLE_DEVICES=0
  stream_checks test_gpu_ldsm
  echo "gpu0 done at $(el) s"
) > "$L/gpu0.txt" 2>&1 &
(
  export CUDA_VISIBLE_DEVICES=1
  cmp_bench bench_ldsm.log 1,8,32,128 main ldsm main ldsm main ldsm
  echo "gpu1 done at $(el) s"
) > "$L/gpu1.txt" 2>&1 &
wait
call_finish
