#!/usr/bin/env bash
# Session 16, call 3 (nvidia-h200-x2, carry .devpack, timeout_s 600). main (staged) = wip/bf16-promote:
# BF16 gate/up adds each 64-wide K step's tensor-core sums into f32 accumulators (MM_BF16_PROMOTE 1,
# DECISIONS 85); m0 = the same with -DMM_BF16_PROMOTE=0 (main before it). Builds:
#   bash bench/stage_device.sh && bash bench/build_variants.sh "m0=-DMM_BF16_PROMOTE=0" && bash bench/pack_devbin.sh
# GPU 0: test_gpu auto on the recorded data and on MEGAMOE_TEST_SEED 2 (where BF16 E16 K1 H512 read
#   1.08e-3 with one chain, session 15's call 8), 1 and 3 (9.99e-4 / 9.96e-4 at H = 7168); ws forced;
#   memcheck ws.
# GPU 1: BF16 m0 / main at T = 8, 128 (mma.sync, ws64) and 2048, 8192 (ws) on the three shapes, then
#   test_gpu mma / wgmma / ws64 forced.
. bench/call_lib.sh
seeded() { # seeded SEED: test_gpu auto on the data of MEGAMOE_TEST_SEED=SEED; one line with the largest BF16 rel L2
  local log="$L/test_gpu_seed$1.log"
  MEGAMOE_TEST_SEED=$1 timeout 100 .devbin/test_gpu > "$log" 2>&1
  echo "test_gpu seed $1: exit $? $(grep -E '^\[  (PASSED|FAILED)' "$log" | tr '\n' ' ') max BF16 rel L2 $(grep -E '^  bf16' "$log" | grep -oE 'rel L2 vs CPU [0-9.e+-]+' | awk '{print $5}' | sort -g | tail -1) max NVFP4 $(grep -E '^  nvfp4' "$log" | grep -oE 'rel L2 vs CPU [0-9.e+-]+' | awk '{print $5}' | sort -g | tail -1) at $(el) s"
}
(
  export CUDA_VISIBLE_DEVICES=0
  seeded 0
  seeded 2
  tg test_gpu ws
  san memcheck test_gpu ws
  seeded 1
  seeded 3
  echo "gpu0 done at $(el) s"
) > "$L/gpu0.txt" 2>&1 &
(
  export CUDA_VISIBLE_DEVICES=1
  FMT=bf16 CMP_TIMEOUT=90 cmp_bench bench_promote_bf16.log 8,128,2048,8192 m0 main
  echo "bench done at $(el) s"
  for g in mma wgmma ws64; do tg test_gpu $g; done
  echo "gpu1 done at $(el) s"
) > "$L/gpu1.txt" 2>&1 &
wait
call_finish
