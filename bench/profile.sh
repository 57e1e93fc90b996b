#!/usr/bin/env bash
# Per-kernel time of one forward on the GPU machine (after bench/stage_device.sh here): ncu over
# `megamoe bench` with one timed iteration, caches flushed before each kernel (ncu's default), clocks
# left alone. Prints one line per kernel launch: T, kernel, grid, registers, µs, DRAM % of peak.
#   usage: bash bench/profile.sh FORMAT "E K H I" TOKENS     e.g. bash bench/profile.sh nvfp4 "256 8 7168 2048" 1,8,8192
set -uo pipefail
OUT=${OUT:-device-out}
mkdir -p "$OUT"
. bench/device_env.sh
fmt=$1; set -- $2 "$3"
log="$OUT/ncu_${fmt}_$1_$4_$(basename "${BIN:-megamoe}").csv"
BIN=${BIN:-.devbin/megamoe}
ncu --clock-control none --csv --page raw \
    --metrics gpu__time_duration.sum,dram__throughput.avg.pct_of_peak_sustained_elapsed,launch__registers_per_thread,launch__grid_size,sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active \
    "$BIN" bench --backend cuda --format "$fmt" --experts $1 --top-k $2 --hidden $3 --inter $4 \
    --tokens "$5" --iters 1 > "$log" 2>"$OUT/ncu_stderr.log"
python3 - "$log" <<'PY'
import csv, sys
rows = [r for r in csv.reader(open(sys.argv[1])) if len(r) > 10]
head, units, rows = rows[0], rows[1], rows[2:]
col = {n: head.index(n) for n in head}
for r in rows:
    name = r[col["Kernel Name"]].split("(")[0].split("<")[0][:28]
    tmpl = r[col["Kernel Name"]][len(name):].split("(")[0][:22]
    print(f'{name:28s} {tmpl:22s} grid {r[col["launch__grid_size"]]:>7s} regs {r[col["launch__registers_per_thread"]]:>4s} '
          f'{r[col["gpu__time_duration.sum"]]:>10s} {units[col["gpu__time_duration.sum"]]} dram {r[col["dram__throughput.avg.pct_of_peak_sustained_elapsed"]]:>6s}% '
          f'hmma {r[col["sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active"]]:>6s}%')
PY
