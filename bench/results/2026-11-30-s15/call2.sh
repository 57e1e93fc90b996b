#!/usr/bin/env bash
# Session 15 call 2 (nvidia-h200-x2, carry .devpack, timeout_s 420). Builds: bench/stage_device.sh
# on main (a4d2197's device code), rv = wip/review-s15 (TESTS=1; the review leftovers: stage_max
# the one block max, route_src_slots), the ws probe with a given-shape mode (dev/).
# GPU 0: rv's test_gpu auto, memcheck and racecheck auto (the stage and routing kernels changed);
#   then where the warp-specialized kernel's warps wait at DSv3 T = 8192 (ncu per-instruction
#   sampling, CUDA_BACKEND Next 5: 352 TFLOP/s in the forward, the probe of its design 708-815).
# GPU 1: main / rv twice at T = 1, 8, 512; per-kernel times with the tensor pipe's activity at DSv3
#   and Mixtral T = 8192; the probe (one expert, weights in L2) and at the forward's tokens per
#   expert over many experts' rows (weights streamed from DRAM).
. bench/call_lib.sh
(
  export CUDA_VISIBLE_DEVICES=0
  tg test_gpu_rv auto
  san memcheck test_gpu_rv auto
  san racecheck test_gpu_rv auto
  OUT=$L timeout 150 bash bench/stalls_sass.sh sm90_expert_ws_kernel "256 8 7168 2048" 8192 > "$L/stalls_ws_dsv3.txt" 2>&1
  echo "stalls ws dsv3: exit $? at $(el) s"
  echo "gpu0 done at $(el) s"
) > "$L/gpu0.txt" 2>&1 &
(
  export CUDA_VISIBLE_DEVICES=1
  cmp_bench bench_rv.log 1,8,512 main rv main rv
  echo "bench rv done at $(el) s"
  OUT=$L timeout 90 bash bench/profile.sh nvfp4 "256 8 7168 2048" 8192 > "$L/profile_dsv3.txt" 2>&1
  OUT=$L timeout 90 bash bench/profile.sh nvfp4 "8 2 4096 14336" 8192 > "$L/profile_mixtral.txt" 2>&1
  echo "profiles done at $(el) s"
  {
    timeout 60 .devbin/sm90_fp4_ws_gemm_probe
    timeout 60 .devbin/sm90_fp4_ws_gemm_probe 131072 7168 256   # DSv3 gate/up rows of 32 experts, 256 tokens each
    timeout 60 .devbin/sm90_fp4_ws_gemm_probe 229376 2048 256   # DSv3 down rows of 32 experts
    timeout 60 .devbin/sm90_fp4_ws_gemm_probe 4096 7168 256     # one expert's gate/up at 256 tokens (32 blocks)
    timeout 60 .devbin/sm90_fp4_ws_gemm_probe 57344 4096 4096   # Mixtral gate/up rows of 2 experts, 4096 tokens
  } > "$L/probe.txt" 2>&1
  echo "probe done at $(el) s"
  echo "gpu1 done at $(el) s"
) > "$L/gpu1.txt" 2>&1 &
wait
call_finish
cat "$L/probe.txt" "$L/profile_dsv3.txt" "$L/profile_mixtral.txt"
head -45 "$L/stalls_ws_dsv3.txt"
