#!/usr/bin/env bash
# Session 15 call 5 (nvidia-h200 (the x2 was not lent), carry .devpack, timeout_s 330; one GPU, in turn). Builds: main (the staged
# epilogues, the ws kernel's NVFP4 gate/up one as a loop) and wgc (wip/wg-compact: the wgmma kernel's
# staged NVFP4 gate/up epilogue as a loop too; TESTS=1).
# In turn: wgc's test_gpu wgmma and memcheck wgmma; main / wgc twice at T = 256, 512,
#   2048; then where the ws kernel's time goes now (per-kernel times, per-instruction stall sampling)
#   at DSv3 T = 8192, for the next step.
. bench/call_lib.sh
(
  export CUDA_VISIBLE_DEVICES=0
  tg test_gpu_wgc wgmma
  san memcheck test_gpu_wgc wgmma
  echo "gpu0 done at $(el) s"
) > "$L/gpu0.txt" 2>&1
(
  export CUDA_VISIBLE_DEVICES=0
  cmp_bench bench_wgc.log 256,512,2048 main wgc main wgc
  echo "bench done at $(el) s"
  OUT=$L timeout 90 bash bench/profile.sh nvfp4 "256 8 7168 2048" 8192 > "$L/profile_dsv3.txt" 2>&1
  OUT=$L timeout 120 bash bench/stalls_sass.sh sm90_expert_ws_kernel "256 8 7168 2048" 8192 > "$L/stalls_ws_dsv3.txt" 2>&1
  echo "gpu1 done at $(el) s"
) > "$L/gpu1.txt" 2>&1 &
wait
call_finish
head -9 "$L/profile_dsv3.txt"
head -12 "$L/stalls_ws_dsv3.txt"
