#!/usr/bin/env bash
# On the GPU machine, the builds of bench/build_variants.sh side by side (after bench/stage_device.sh
# and build_variants.sh here; "main" is the staged .devbin/megamoe and .devbin/test_gpu). Logs go to
# $OUT (or ./device-out); a short table is printed last.
#   usage: bash bench/variants.sh tests NAME...            test_gpu_<NAME> with each GEMM kernel forced and chosen
#          bash bench/variants.sh sanitize NAME...         memcheck and racecheck (--quick) of test_gpu_<NAME>, as device_check.sh
#          bash bench/variants.sh bench NAME...            megamoe_<NAME> bench, the builds in turn per shape
#   env:   TOKENS (1,8,32,128,512,2048,8192), FORMATS (nvfp4), SHAPES ("256 8 7168 2048|128 8 2048 768|8 2 4096 14336"),
#          KERNELS (auto mma wgmma stream ws ws64: tests), ITERS (10)
set -uo pipefail
OUT=${OUT:-device-out}
mkdir -p "$OUT"
. bench/device_env.sh
what=$1; shift
bin() { [ "$1" = main ] && echo ".devbin/$2" || echo ".devbin/$2_$1"; }
case $what in
tests)
  for name in "$@"; do
    for k in ${KERNELS:-auto mma wgmma stream ws ws64}; do
      log="$OUT/test_gpu_${name}_$k.log"
      MEGAMOE_GEMM=$k timeout 200 "$(bin "$name" test_gpu)" > "$log" 2>&1
      rc=$?
      echo "$name $k: exit $rc $(grep -E '^\[  (PASSED|FAILED)' "$log" | tr '\n' ' ')"
    done
  done ;;
sanitize)
  for name in "$@"; do
    for tool in memcheck racecheck; do
      excl=(); [ $tool = racecheck ] && excl=("${RACECHECK_EXCLUDE[@]}")
      log="$OUT/sanitize_${name}_$tool.log"
      compute-sanitizer --tool $tool --report-api-errors no --error-exitcode 9 "${excl[@]}" \
        "$(bin "$name" test_gpu)" --quick > "$log" 2>&1
      echo "$name $tool: exit $? $(tail -n 1 "$log")"
    done
  done ;;
bench)
  NAMES="$*"
  IFS='|' read -ra shapes <<< "${SHAPES:-256 8 7168 2048|128 8 2048 768|8 2 4096 14336}"
  for fmt in ${FORMATS:-nvfp4}; do
    for shape in "${shapes[@]}"; do
      set -- $shape
      for name in $NAMES; do
        timeout 300 "$(bin "$name" megamoe)" bench --backend cuda --format "$fmt" --experts $1 --top-k $2 --hidden $3 \
          --inter $4 --tokens "${TOKENS:-1,8,32,128,512,2048,8192}" --iters "${ITERS:-10}" 2>&1 |
          sed "s/^bench:/bench[$name]:/" >> "$OUT/variants_bench.log"
      done
    done
  done
  # One line per point: shape, format, T, then each build's median ms.
  python3 - "$OUT/variants_bench.log" $NAMES <<'PY'
import re, sys
rows, names = {}, sys.argv[2:]
for line in open(sys.argv[1]):
    m = re.match(r"bench\[(\S+)\]: E=(\d+) K=(\d+) H=(\d+) I=(\d+) T=(\d+) (\w+).*median ([\d.]+) ms", line)
    if m:
        name, *key, ms = m.groups()
        rows.setdefault(tuple(key), {})[name] = float(ms)
# Issue 3's reference: Marlin W4A16 on the H200 (NVFP4 only), ms per forward.
marlin = {("256", "8", "7168", "2048"): [0.104, 0.533, 1.451, 2.262, 3.300, 7.761, 24.01],
          ("128", "8", "2048", "768"): [0.038, 0.085, 0.148, 0.170, 0.301, 0.875, 2.909],
          ("8", "2", "4096", "14336"): [0.100, 0.269, 0.318, 0.530, 1.594, 5.501, 21.33]}
ts = ["1", "8", "32", "128", "512", "2048", "8192"]
print("E K H I T format | " + " | ".join(names) + " | Marlin")
for key, v in rows.items():
    ref = marlin.get(tuple(key[:4]))
    m = f"{ref[ts.index(key[4])]:.4f}" if ref and key[5] == "nvfp4" and key[4] in ts else "-"
    print(" ".join(key) + " | " + " | ".join(f"{v[n]:.4f}" if n in v else "-" for n in names) + " | " + m)
PY
  ;;
*) echo "usage: bash bench/variants.sh tests|bench NAME..." >&2; exit 2 ;;
esac
