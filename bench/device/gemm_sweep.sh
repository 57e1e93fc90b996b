#!/usr/bin/env bash
# bench/device/gemm_sweep.sh -- every expert GEMM kernel forced in turn (`megamoe bench --gemm K`) over
# shapes, token counts and activation modes, with one build: the data behind the kernel-choice thresholds
# (src/cuda/gemm_plan.h, DECISIONS 33). A forced kernel is the same code the automatic choice runs,
# so a threshold can be read off one table instead of building a revision per candidate rule.
#   here:   bash bench/device/stage.sh (carry .devbin)
#   there:  bash bench/device/gemm_sweep.sh [TOKENS [KERNELS]]
#             TOKENS   comma-separated token counts (default 512,1024,2048,4096)
#             KERNELS  default "auto wgmma ws ws64" (also mma, stream)
#             SHAPES   "E K H I;..." (default the table's three), FORMATS (default nvfp4),
#             ACTIVATIONS (default "bf16 nvfp4"; a BF16 layer runs once), ITERS (default 10)
# Prints per (shape, format, activations, T) each kernel's median ms, the fastest forced one, and
# how far "auto" (what the rule takes now) is from it. Records (bench --json, one file per kernel) and the log under
# $OUT/gemm_sweep (OUT default device-out).
set -uo pipefail
cd "$(dirname "$(realpath "$0")")/../.."
. bench/device/env.sh
tokens=${1:-512,1024,2048,4096}
kernels=(${2:-auto wgmma ws ws64})
OUT=${OUT:-device-out}
dir=$OUT/gemm_sweep
mkdir -p "$dir"
[ -x .devbin/megamoe ] || { echo "gemm_sweep: no .devbin/megamoe (bench/device/stage.sh here, carry .devbin)" >&2; exit 2; }
IFS=";" read -ra shapes <<< "${SHAPES:-${SHAPES3[0]};${SHAPES3[1]};${SHAPES3[2]}}"
for fmt in ${FORMATS:-nvfp4}; do
  acts=(${ACTIVATIONS:-bf16 nvfp4})
  [ "$fmt" = bf16 ] && acts=(bf16)
  for s in "${shapes[@]}"; do
    set -- $s
    for a in "${acts[@]}"; do
      aa=(); [ "$fmt" = nvfp4 ] && aa=(--activations "$a")
      for k in "${kernels[@]}"; do
        echo "== $s $fmt act=$a gemm=$k" >> "$dir/log"
        timeout 300 .devbin/megamoe bench --backend cuda --format "$fmt" "${aa[@]}" --experts $1 --top-k $2 \
          --hidden $3 --inter $4 --tokens "$tokens" --iters "${ITERS:-10}" --gemm "$k" \
          --json "$dir/$k.jsonl" >> "$dir/log" 2>&1 || echo "gemm_sweep: $s $fmt $a $k failed (see $dir/log)" >&2
      done
    done
  done
done
python3 - "$dir" "${kernels[@]}" <<'PY'
import json, sys
d, kernels = sys.argv[1], sys.argv[2:]
cells = {}
for k in kernels:
    try:
        lines = open(f"{d}/{k}.jsonl")
    except OSError:
        continue
    for line in lines:
        r = json.loads(line)
        key = (r["shape"], r["format"], r.get("activations") or "-", r["T"])
        cells.setdefault(key, {})[k] = r["median_ms"]
print(f"{'shape':26} {'format':6} {'act':5} {'T':>6}  " + "  ".join(f"{k:>9}" for k in kernels) + "  fastest  auto vs it")
for key in sorted(cells, key=lambda c: (c[0], c[1], c[2], c[3])):
    row = cells[key]
    forced = {k: v for k, v in row.items() if k != "auto"}
    best = min(forced, key=forced.get) if forced else "-"
    vals = "  ".join(f"{row[k]:9.4f}" if k in row else f"{'-':>9}" for k in kernels)
    lag = f"{row['auto'] / forced[best] - 1:+.1%}" if "auto" in row and forced else "-"
    print(f"{key[0]:26} {key[1]:6} {key[2]:5} {key[3]:6}  {vals}  {best:7}  {lag}")
PY
