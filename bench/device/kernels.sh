#!/usr/bin/env bash
# bench/device/kernels.sh -- where one forward's time goes: each kernel of a forward under Nsight
# Compute (its duration, DRAM and SM throughput as % of peak, tensor-pipe activity), in launch
# order, beside the forward's time from `megamoe bench` (CUDA-graph replay after the L2 flush).
#   there (carry .devbin):  bash bench/device/kernels.sh [CASE ...]
#     CASE = "E K H I T ACT": ACT bf16 or nvfp4 (NVFP4 weights, the activation mode) or w16 (BF16
#     weights); the default cases are the table's gaps (docs/BENCHMARKS.md): Qwen3-like T = 1 and
#     8192, DSv3-like T = 512 and 2048, Mixtral-like BF16 T = 8192.
# ncu runs each kernel alone, with the caches flushed before it (its default), so the durations do
# not overlap as the forward's kernels do under programmatic dependent launch: forward time minus
# the sum is what the overlap and the launch gaps are worth (negative: overlap). Reports and logs go
# to $OUT/kernels (OUT default device-out); one line per kernel on stdout.
set -uo pipefail
cd "$(dirname "$0")/../.."
. bench/device/env.sh
OUTDIR=${OUT:-device-out}/kernels
mkdir -p "$OUTDIR"
B=.devbin
cases=("$@")
[ ${#cases[@]} -gt 0 ] || cases=("128 8 2048 768 1 bf16" "128 8 2048 768 1 nvfp4" "128 8 2048 768 8192 bf16"
  "128 8 2048 768 8192 nvfp4" "256 8 7168 2048 512 bf16" "256 8 7168 2048 2048 bf16"
  "256 8 7168 2048 2048 nvfp4" "8 2 4096 14336 8192 w16")
BASE_METRICS=gpu__time_duration.sum,dram__throughput.avg.pct_of_peak_sustained_elapsed,sm__throughput.avg.pct_of_peak_sustained_elapsed
TENSOR_METRICS='regex:^sm__pipe_tensor_op_.*_cycles_active\.avg\.pct_of_peak_sustained_active$'
rc=0
for c in "${cases[@]}"; do
  read -r E K H I T ACT <<< "$c"
  if [ "$ACT" = w16 ]; then fmt=(--format bf16); else fmt=(--format nvfp4 --activations "$ACT"); fi
  args=(bench --backend cuda --experts "$E" --top-k "$K" --hidden "$H" --inter "$I" --tokens "$T" "${fmt[@]}")
  name=${c// /_}
  ms=$($B/megamoe "${args[@]}" --iters 10 2>&1 | tee "$OUTDIR/$name.bench.log" | grep -o 'median [0-9.]* ms' | head -1)
  rep=$OUTDIR/$name
  # The first forward's kernels (every kernel of the library is named sm90_*); the flush kernel
  # of the benchmark is left out by the flush size 0. Without the tensor-pipe metrics when this
  # ncu does not know them.
  if ! MEGAMOE_BENCH_FLUSH_MB=0 ncu --clock-control none -k regex:^sm90_ -c 12 --metrics "$BASE_METRICS,$TENSOR_METRICS" \
      -f -o "$rep" $B/megamoe "${args[@]}" --iters 1 > "$rep.ncu.log" 2>&1; then
    MEGAMOE_BENCH_FLUSH_MB=0 ncu --clock-control none -k regex:^sm90_ -c 12 --metrics "$BASE_METRICS" \
      -f -o "$rep" $B/megamoe "${args[@]}" --iters 1 >> "$rep.ncu.log" 2>&1 || { echo "$c: ncu failed"; tail -5 "$rep.ncu.log"; rc=1; continue; }
  fi
  ncu -i "$rep.ncu-rep" --page raw --csv > "$rep.csv" 2>> "$rep.ncu.log"
  echo "== E K H I = $E $K $H $I, T = $T, $ACT; megamoe bench: ${ms:-(no line: $rep.bench.log)}"
  python3 - "$rep.csv" <<'EOF' || rc=1
import csv, sys
rows = list(csv.reader(open(sys.argv[1])))
head, data = rows[0], rows[2:] # the second row holds the units
col = {n: i for i, n in enumerate(head)}
tensor = [n for n in head if n.startswith("sm__pipe_tensor_op_")]
def num(r, n):
    try:
        return float(r[col[n]].replace(",", ""))
    except (KeyError, ValueError):
        return float("nan")
# One forward: from the first kernel to the first combine (the bench's later forwards repeat it).
fwd = []
for r in data:
    fwd.append(r)
    if "combine" in r[col["Kernel Name"]]:
        break
tensor = [n for n in tensor if any(num(r, n) > 0 for r in fwd)]
total = 0.0
for r in fwd:
    ns = num(r, "gpu__time_duration.sum")
    total += ns
    full = r[col["Kernel Name"]].removeprefix("void ")
    name = full.split("(")[0].split("<")[0]
    kind = full[len(name):].split("(")[0]
    pipes = " ".join(f"{n.split('_cycles')[0].replace('sm__pipe_tensor_op_', '')} {num(r, n):.1f}%" for n in tensor)
    print(f"  {name + kind:58.58s} {ns / 1e3:9.1f} us  DRAM {num(r, 'dram__throughput.avg.pct_of_peak_sustained_elapsed'):5.1f}%"
          f"  SM {num(r, 'sm__throughput.avg.pct_of_peak_sustained_elapsed'):5.1f}%  {pipes}")
print(f"  {'sum of the kernels alone':58s} {total / 1e3:9.1f} us")
EOF
  [ -n "${KEEP_REP:-}" ] || rm -f "$rep.ncu-rep"
done
exit $rc
