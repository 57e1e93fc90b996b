#!/usr/bin/env bash
# bench/device/kernels.sh -- where one forward's time goes: each kernel of a forward under Nsight
# Compute (its duration, DRAM and SM throughput as % of peak, tensor-pipe activity), in launch
# order, beside the forward's time from `megamoe bench` (CUDA-graph replay after the L2 flush).
#   there (carry .devbin):  bash bench/device/kernels.sh [CASE ...]
#     CASE = "E K H I T ACT [GEMM]": ACT bf16 or nvfp4 (NVFP4 weights, the activation mode) or w16
#     (BF16 weights); GEMM forces the expert GEMM kernel (`megamoe bench --gemm`: mma, wgmma,
#     stream, ws, ws64; default auto, the kernel each phase chooses). The default cases are the
#     table's gaps (docs/BENCHMARKS.md): Qwen3-like T = 1 and 8192, DSv3-like T = 512 and 2048,
#     Mixtral-like BF16 T = 8192.
# ncu runs each kernel alone, with the caches flushed before it (its default), so the durations do
# not overlap as the forward's kernels do under programmatic dependent launch, and run at the clock
# of a GPU that is not kept busy (prefill kernels run slower in the benchmark's back-to-back
# replays); forward time minus the sum is what overlap, gaps and clocks are worth together.
# Output: one line per kernel on stdout; one JSON record per kernel appended to
# $OUT/kernels-<date>.jsonl (OUT default device-out); the logs and the raw metrics (CSV) under LOGS
# (default /tmp/megamoe-kernels), packed as $OUT/kernels.tgz (a device call brings back few files).
set -uo pipefail
cd "$(dirname "$0")/../.."
. bench/device/env.sh
OUT=${OUT:-device-out}
OUTDIR=${LOGS:-/tmp/megamoe-kernels}
mkdir -p "$OUTDIR" "$OUT"
B=.devbin
cases=("$@")
[ ${#cases[@]} -gt 0 ] || cases=("128 8 2048 768 1 bf16" "128 8 2048 768 1 nvfp4" "128 8 2048 768 8192 bf16"
  "128 8 2048 768 8192 nvfp4" "256 8 7168 2048 512 bf16" "256 8 7168 2048 2048 bf16"
  "256 8 7168 2048 2048 nvfp4" "8 2 4096 14336 8192 w16")
BASE_METRICS=gpu__time_duration.sum,dram__throughput.avg.pct_of_peak_sustained_elapsed,sm__throughput.avg.pct_of_peak_sustained_elapsed
TENSOR_METRICS='regex:^sm__pipe_tensor_op_.*_cycles_active\.avg\.pct_of_peak_sustained_active$'
rc=0
for c in "${cases[@]}"; do
  read -r E K H I T ACT GEMM <<< "$c"
  if [ "$ACT" = w16 ]; then fmt=(--format bf16); else fmt=(--format nvfp4 --activations "$ACT"); fi
  args=(bench --backend cuda --experts "$E" --top-k "$K" --hidden "$H" --inter "$I" --tokens "$T" "${fmt[@]}"
    --gemm "${GEMM:-auto}")
  name=${c// /_}
  ms=$($B/megamoe "${args[@]}" --iters 10 2>&1 | tee "$OUTDIR/$name.bench.log" | grep -o 'median [0-9.]* ms' | head -1)
  rep=$OUTDIR/$name
  # The first forward's kernels (every kernel of the library is named sm90_*); the flush kernel
  # of the benchmark is left out by the flush size 0. Without the tensor-pipe metrics when this
  # ncu does not know them.
  : > "$rep.ncu.log"
  profiled=0
  for metrics in "$BASE_METRICS,$TENSOR_METRICS" "$BASE_METRICS"; do
    if MEGAMOE_BENCH_FLUSH_MB=0 ncu --clock-control none -k regex:^sm90_ -c 12 --metrics "$metrics" -f -o "$rep" \
        $B/megamoe "${args[@]}" --iters 1 >> "$rep.ncu.log" 2>&1; then
      profiled=1
      break
    fi
  done
  [ $profiled = 1 ] || { echo "$c: ncu failed"; tail -5 "$rep.ncu.log"; rc=1; continue; }
  ncu -i "$rep.ncu-rep" --page raw --csv > "$rep.csv" 2>> "$rep.ncu.log"
  echo "== E K H I = $E $K $H $I, T = $T, $ACT, GEMM ${GEMM:-auto}; megamoe bench: ${ms:-(no line: $rep.bench.log)}"
  python3 - "$rep.csv" "$c" "$(cat $B/COMMIT)" "${ms:-}" "$OUT/kernels-$(date -u +%F).jsonl" <<'EOF' || rc=1
import csv, json, sys, time
rows = list(csv.reader(open(sys.argv[1])))
E, K, H, I, T, act, *gemm = sys.argv[2].split()
head, units, data = rows[0], rows[1], rows[2:]
col = {n: i for i, n in enumerate(head)}
# The tensor pipes by instruction family (hmma counts mma.sync and wgmma alike), not their breakdowns.
tensor = [n for n in head if n.startswith("sm__pipe_tensor_op_") and "_type_" not in n]
to_us = {"ns": 1e-3, "us": 1.0, "ms": 1e3, "s": 1e6}[units[col["gpu__time_duration.sum"]]]
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
# One JSON record per kernel (the keys of bench/records.py where they apply, and the kernel's).
fwd_ms = float(sys.argv[4].split()[1]) if sys.argv[4] else None
date = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
recs = [{
    "shape": f"E={E} K={K} H={H} I={I}", "format": "bf16" if act == "w16" else "nvfp4",
    "activations": None if act == "w16" else act, "T": int(T), "gemm": gemm[0] if gemm else "auto",
    "forward_median_ms": fwd_ms, "order": i, "kernel": r[col["Kernel Name"]].removeprefix("void ").split("(")[0],
    "us": num(r, "gpu__time_duration.sum") * to_us,
    "dram_pct": num(r, "dram__throughput.avg.pct_of_peak_sustained_elapsed"),
    "sm_pct": num(r, "sm__throughput.avg.pct_of_peak_sustained_elapsed"),
    "tensor_pct": {n.split("_cycles")[0].replace("sm__pipe_tensor_op_", ""): num(r, n) for n in tensor},
    "commit": sys.argv[3], "gpu": r[col["device__attribute_display_name"]], "date": date, "source": "ncu"}
    for i, r in enumerate(fwd)]
for k in recs:
    pipes = " ".join(f"{n} {v:.1f}%" for n, v in k["tensor_pct"].items())
    print(f"  {k['kernel']:58.58s} {k['us']:9.1f} us  DRAM {k['dram_pct']:5.1f}%  SM {k['sm_pct']:5.1f}%  {pipes}")
print(f"  {'sum of the kernels alone':58s} {sum(k['us'] for k in recs):9.1f} us")
with open(sys.argv[5], "a") as f:
    for k in recs:
        f.write(json.dumps(k) + "\n")
EOF
  [ -n "${KEEP_REP:-}" ] || rm -f "$rep.ncu-rep"
  tar -czf "$OUT/kernels.tgz" -C "$OUTDIR" .
done
exit $rc
