#!/usr/bin/env bash
# Where a kernel's warps wait, per instruction, on the GPU machine (after bench/stage_device.sh here):
# ncu's warp-stall sampling of the first launches of the kernels whose names match, in one NVFP4
# forward of `megamoe bench`, exported as ncu's source page (SASS, CSV) and cut to the samples and
# stall reasons per instruction (the full report is ~5 MB). Summarize here with bench/stalls_top.py.
#   usage: [BIN=.devbin/megamoe_x] bash bench/stalls_sass.sh KERNEL_REGEX "E K H I" TOKENS
#   e.g.   bash bench/stalls_sass.sh sm90_expert_stream_kernel "128 8 2048 768" 128
set -uo pipefail
OUT=${OUT:-device-out}
mkdir -p "$OUT"
. bench/device_env.sh
BIN=${BIN:-.devbin/megamoe}
kern=$1; set -- $2 "$3"
name="${kern}_$1_$4_T$5"
ncu --clock-control none -k "regex:$kern" --launch-count 2 --section WarpStateStats --section SourceCounters \
    -o "$OUT/rep_$name" -f "$BIN" bench --backend cuda --format nvfp4 --experts $1 --top-k $2 --hidden $3 --inter $4 \
    --tokens "$5" --iters 1 > "$OUT/ncu_$name.txt" 2>&1
ncu -i "$OUT/rep_$name.ncu-rep" --page source --csv --print-source sass > "$OUT/src_$name.csv" 2>&1 ||
  ncu -i "$OUT/rep_$name.ncu-rep" --page source --csv > "$OUT/src_$name.csv" 2>&1
python3 bench/stalls_top.py --cut "$OUT/src_$name.csv" > "$OUT/stalls_by_sass_$name.csv"
rm -f "$OUT/rep_$name.ncu-rep" "$OUT/src_$name.csv"
python3 bench/stalls_top.py "$OUT/stalls_by_sass_$name.csv" | head -40
