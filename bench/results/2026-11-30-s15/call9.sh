#!/usr/bin/env bash
# Prepared in session 15 for the next session (nvidia-h200-x2, carry .devpack, timeout_s 600; ~7 min).
# bench/full_suite.sh on ec = wip/epi-col (gemm_epilogue's down projection decodes a token column's p
# row once for its four values instead of once per value: session 14 call 7 had the per-value
# decode, ~80 instructions with a peer-table load, at 17% of the streaming down kernel's warp samples
# at Qwen3 T = 128, the one NVFP4 cell still behind Marlin; every kernel's down epilogue changes, so
# the whole suite), staged in place of main for this call; plus m0 (= main) / ec twice at T = 1, 8,
# 32, 128 on GPU 1. Builds: bench/stage_device.sh on main, then
#   TESTS=1 bash bench/build_variants.sh "ec@wip/epi-col=" && bash bench/pack_devbin.sh
. bench/call_lib.sh
cp .devbin/megamoe .devbin/megamoe_m0
cp .devbin/megamoe_ec .devbin/megamoe
cp .devbin/test_gpu_ec .devbin/test_gpu
extra_gpu1() {
  cmp_bench bench_ec.log 1,8,32,128 m0 main m0 main
  echo "ec cmp done at $(el) s"
}
. bench/full_suite.sh
