#!/usr/bin/env bash
# Prepared in session 12 as the next session's first call (nvidia-h200-x2, carry .devpack; not run:
# the session's device time was spent; give it timeout_s 600, ~8 min). Builds (here, on main after
# the trace build's stage stamps; the default build's device code is 2af4546's, SASS-identical):
#   bash bench/stage_device.sh
#   TESTS=1 bash bench/build_variants.sh "hplan@wip/host-plan=" "sx@wip/stage-early-x=" \
#     "sp@wip/stream-params=" "guard@wip/residency-guard="
#   bash bench/build_variants.sh "trace=-DMM_STREAM_TRACE=1" "wg4=-DWG_STAGES=4" "wg6=-DWG_STAGES=6"
#   bash bench/pack_devbin.sh
# (each branch with main merged after the one-token test landed, so every test_gpu_* runs it; main's
# test_gpu rebuilt with it, its CLI SASS-identical)
# wg4 / wg6: the NVFP4 wgmma kernel's ring at 4 / 6 stages (5 on main; never measured), at Qwen3
#   T = 512 / 2048 / 8192 where it is chosen and Marlin still leads.
# hplan = wip/host-plan: in one process the host passes the streaming kernel its slot count and split
#   plan, so its blocks skip the token-count read and the 64-bit divisions of gemm_choice /
#   plan_splitk / plan_stream_splits before their first copy (gate/up: waited -> setup 1.25 us at
#   Qwen3 T = 1, call 1's trace). NCCL keeps the device plan (the 2-GPU pytest runs that path).
# sp = wip/stream-params (on hplan): in one process of <= 8 ranks the streaming kernel reads the
#   ranks' buffer bases and weight tables from a __grid_constant__ kernel parameter instead of the
#   device tables (each a DRAM latency after the L2 flush, ahead of the tile counts and the first
#   weight copy);
# guard = wip/residency-guard: the finalize checks with the occupancy API that each streaming
#   instantiation keeps its planned blocks per SM (the 4-block ring fills 228 KB to the byte) --
#   test_gpu passing confirms the residency the plan assumes;
# sx = wip/stage-early-x: the stage kernel issues its x loads before the ids and the padding flag
#   (they followed the padding branch: two memory latencies in a row at T = 1), and the weight load
#   before the id's store. Its bytes must stay the CPU's: test_gpu's activation-bytes test.
# Diagnosis of the cells still behind Marlin (BENCHMARKS twelfth session):
#   the timelines at T = 1 (with the stage kernel's new stamps: amax, route read / counted /
#   tiles), 8, 32 and 128 on the three shapes (Mixtral T = 8 -> 32 costs 58 us with the same weights
#   streamed and one n-tile either way: where does it go? Qwen3 T = 128: 3-4 items per block); ncu
#   stall reasons of the streaming kernel at Mixtral T = 32 and Qwen3 T = 128 and of the wgmma
#   kernel at Qwen3 T = 8192 (194 TFLOP/s against DSv3's 347 on the ws kernel).
# GPU 0: sp's stream checks, sx auto and memcheck, guard auto, then main / hplan / sp / sx alternating
#   twice at T = 1, 8, 32, 128, main / wg4 / wg6 twice at Qwen3 T = 512-8192.
# GPU 1: the traces, main's test_gpu stream / ws (the stage kernel's trigger has run auto / mma /
#   wgmma only), then ncu (bench/stalls.sh; its reports under the logs) while time is left.
# Both: the 2-GPU pytest with sp (NCCL: its device-table path).
. bench/call_lib.sh
(
  export CUDA_VISIBLE_DEVICES=0
  stream_checks test_gpu_sp
  tg test_gpu_sx auto
  san memcheck test_gpu_sx auto
  tg test_gpu_guard auto
  cmp_bench bench0.log 1,8,32,128 main hplan sp sx main hplan sp sx
  # Qwen3 prefill (wgmma chosen; 4.7-9.6% behind Marlin): the wgmma ring at 4 and 6 stages (5 on main)
  for n in main wg4 wg6 main wg4 wg6; do
    timeout 60 "$(bin "$n")" bench --backend cuda --format nvfp4 --experts 128 --top-k 8 --hidden 2048 --inter 768 \
      --tokens 512,2048,8192 --iters 10 2>&1 | sed "s/^bench:/bench[$n]:/" >> "$L/bench_wg.log"
  done
  echo "gpu0 done at $(el) s"
) > "$L/gpu0.txt" 2>&1 &
(
  export CUDA_VISIBLE_DEVICES=1
  for t in 1 8 32 128; do trace_runs trace $t; done
  # main's stage trigger (2af4546) ran auto / mma / wgmma (call 4); the other kernel modes here
  for g in stream ws; do tg test_gpu $g; done
  # ncu last, each only while the call has time left (the call's logs are tarred at its end)
  for run in "sm90_expert_stream_kernel|8 2 4096 14336|32" "sm90_expert_stream_kernel|128 8 2048 768|128" \
             "sm90_expert_wgmma_kernel|128 8 2048 768|8192"; do
    IFS='|' read -r kern shape tok <<< "$run"
    if [ "$(el)" -lt 380 ]; then OUT=$L timeout 100 bash bench/stalls.sh "$kern" "$shape" "$tok"; else echo "ncu $kern $tok: skipped (time)"; fi
  done
  echo "gpu1 done at $(el) s"
) > "$L/gpu1.txt" 2>&1 &
wait
multi_gpu sp > "$L/both.txt" 2>&1
grep -E "^==|trace, |  (entry|waited|setup|first copy|first full|streamed|first chunk|done|staged|exit|items per|amax|route [a-z]+) " "$L/trace.txt" | cut -c1-110
call_finish
