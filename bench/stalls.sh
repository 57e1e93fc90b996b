#!/usr/bin/env bash
# Why a kernel runs at the rate it does, on the GPU machine (after bench/stage_device.sh here): ncu's
# speed-of-light, scheduler and warp-state (stall reason) sections for the first launches of the
# kernels whose names match, one NVFP4 forward of `megamoe bench`. The text report goes to $OUT.
#   usage: bash bench/stalls.sh KERNEL_REGEX "E K H I" TOKENS
#   e.g.   bash bench/stalls.sh sm90_expert_stream_kernel "256 8 7168 2048" 1
set -uo pipefail
OUT=${OUT:-device-out}
mkdir -p "$OUT"
. bench/device_env.sh
BIN=${BIN:-.devbin/megamoe}
kern=$1; set -- $2 "$3"
log="$OUT/stalls_${kern}_$1_$4_T$5.txt"
ncu --clock-control none -k "regex:$kern" --launch-count 2 \
    --section SpeedOfLight --section SchedulerStats --section WarpStateStats --section Occupancy \
    "$BIN" bench --backend cuda --format nvfp4 --experts $1 --top-k $2 --hidden $3 --inter $4 \
    --tokens "$5" --iters 1 > "$log" 2>&1
grep -E "sm90_|Duration|Throughput|Issued Warp|No Eligible|Active Warps Per|Eligible Warps|Warp Cycles Per Issued|Stall|stall" "$log" | head -60
