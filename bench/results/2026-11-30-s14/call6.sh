#!/usr/bin/env bash
# Session 14, call 6 (nvidia-h200-x2, carry .devpack = call 5's builds, timeout_s 200): ncu stall
# reasons of the streaming kernel at Qwen3 T = 128 for main 5820b59 and ldsm (= main a4d2197), with
# the source-level sampling (SourceCounters: the SASS lines most stalled), for the next step of
# CUDA_BACKEND Next 1.
. bench/call_lib.sh
export CUDA_VISIBLE_DEVICES=0
. bench/device_env.sh
for n in main ldsm; do
  timeout 80 ncu --clock-control none -k "regex:sm90_expert_stream_kernel" --launch-count 2 \
    --section SpeedOfLight --section SchedulerStats --section WarpStateStats --section SourceCounters \
    "$(bin $n)" bench --backend cuda --format nvfp4 --experts 128 --top-k 8 --hidden 2048 --inter 768 \
    --tokens 128 --iters 1 > "$L/stalls_$n.txt" 2>&1
  echo "$n done at $(el) s"
done
call_finish
grep -E "sm90_|Duration|Issued Warp|No Eligible|Eligible Warps|Warp Cycles Per Issued|Stall|stall|Location" "$L"/stalls_*.txt | head -80
