#!/usr/bin/env bash
# bench/device/variant.sh -- one device call for a kernel change against a base revision: is it
# correct, is y byte for byte what the base gives, is it faster, and what bounds it (written for the
# streaming kernel's two K steps per ring slot, DECISIONS 52; used for every kernel change since).
#   here:   bash bench/device/variant.sh stage [BASE [REV ...]]
#             bench/device/stage.sh (this tree's binaries, packed into .devbin), then BASE's `megamoe`
#             (default main: run it on a branch) built from `git archive` and packed as
#             .devbin/rev-a/megamoe.xz, and each further REV's as rev-c, rev-d, ... (compare runs them
#             too, each against A: variants measured apart while the tests run on this tree, which may
#             hold them all); carry .devbin (~13 MB, ~2 MB more per REV)
#   there:  bash bench/device/variant.sh [PART ...]
#             (default: gate bitwise compare ncu test_gpu_auto test_gpu_stream sanitize and the other
#             test_gpu modes last)
#     gate      MEGAMOE_GEMM=$GATE_GEMM (default stream: the kernel the change touches) test_gpu --quick;
#               when it fails nothing else runs
#     bitwise   y of `megamoe run --backend cuda` from A (BASE) and B (this tree) compared byte for
#               byte, both activation modes, on random NVFP4 layers made there (make_case.py):
#               E 16 K 4 H 2304 I 1024 at T = 1 (gate/up in 4 splits of 9 K steps: half-used last
#               slots on the rolled loop), 8 (per-slot layout, unrolled), 32 (grouped layout) and
#               1100 (the ws kernel: 275 per expert at K 1024), and E 8 K 5 H 7168 I 2048 at T = 1 (3
#               splits of 37 / 37 / 38 on the unrolled loop) and 600 (ws: 375 per expert)
#     compare   bench/device/compare_revs.sh bench: DSv3-, Mixtral- and Qwen3-like at T = 1, 8, 32
#               (COMPARE_TOKENS; COMPARE_SHAPES "E K H I;..." for others), bf16 and nvfp4 activations
#               (ACTIVATIONS; FORMATS, default nvfp4, as compare_revs.sh takes them), the staged
#               builds (A, B, C, ...) in turn per shape, ROUNDS (default 1) rounds
#     ncu       the kernels matching NCU_KERNELS (default expert_stream) of one DSv3-like T = 8 forward
#               of B (and of A with NCU_A=1; NCU_ARGS replaces the bench arguments, e.g. "--experts 128
#               --top-k 8 --hidden 2048 --inter 768 --tokens 1 --activations nvfp4"):
#               SourceCounters (stall reasons per SASS line), WarpStateStats, MemoryWorkloadAnalysis,
#               SpeedOfLight (SM frequency, DRAM throughput), ComputeWorkloadAnalysis (pipe use),
#               exported as text: --page details and --page source --print-source sass --csv
#     tests     test_gpu in every kernel mode (KERNEL_MODES), one at a time
#     sanitize  compute-sanitizer memcheck, racecheck (the streaming and ws kernels excluded, as in
#               bench/device/check.sh), synccheck, initcheck over test_gpu --quick, kernels chosen
#               per forward, one at a time
#     test_graph the CUDA-graph replays bitwise equal to eager (tests includes it)
#     (tests and sanitize stand for their steps, which can be named one by one: test_gpu_ws, memcheck)
# Each step runs under what is left of BUDGET_S (default 570 s, one 10-minute call): "NOT RUN (time)"
# when its usual length does not fit, "NOT FINISHED (time)" when stopped at the budget. The default
# parts take ~650 s, so expect the last steps left out; the last line names them for a second call.
# Logs under LOGS (default /tmp/variant), packed after every step into $OUT/variant.tgz (OUT default
# device-out; a device call brings back at most 8 files, and a call stopped at its limit keeps the
# steps before). Exit 0 only when every step ran and passed.
set -uo pipefail
self=$(realpath "$0")
cd "$(dirname "$self")/../.."

if [ "${1:-}" = stage ]; then
  set -e
  base=${2:-main}
  extra=("${@:3}")
  bash bench/device/stage.sh
  sides=(c d e f g h)
  [ ${#extra[@]} -le ${#sides[@]} ] || { echo "variant.sh stage: at most ${#sides[@]} further revisions" >&2; exit 2; }
  bash bench/device/compare_revs.sh stage-rev a "$base"
  for i in "${!extra[@]}"; do bash bench/device/compare_revs.sh stage-rev "${sides[$i]}" "${extra[$i]}"; done
  du -sh .devbin
  exit 0
fi

OUT=${OUT:-device-out}
L=${LOGS:-/tmp/variant}
mkdir -p "$L" "$OUT"
export LOGS=$L OUT # the internal parts below run as children of this script
. bench/device/env.sh # unpacks .devbin/bins.tar.xz, the loader path, KERNEL_MODES, RACECHECK_EXCLUDE
B=.devbin

# The two builds as compare_revs.sh expects them: A from the packed BASE, B from this staging.
prepare_revs() {
  mkdir -p $B/rev-b && cp $B/megamoe $B/rev-b/ && echo "this tree $(cat $B/COMMIT)" > $B/rev-b/REV
  bash bench/device/compare_revs.sh unpack
  [ -x $B/rev-a/megamoe ]
}

# Internal parts, run under `timeout` by the steps below.
case ${1:-} in
_bitwise)
  python3 -c 'import numpy' || { echo "bitwise: no numpy here"; exit 3; }
  fail=0
  for c in "16 4 2304 1024:1 8 32 1100" "8 5 7168 2048:1 600"; do
    shape=${c%%:*} Ts=${c#*:}
    dir=$L/case_${shape// /_}
    python3 bench/device/make_case.py "$dir" $shape $Ts || exit 3
    for T in $Ts; do
      for act in bf16 nvfp4; do
        for side in a b; do
          msg=$($B/rev-$side/megamoe run --backend cuda --activations $act --checkpoint "$dir/model.safetensors" \
            --input "$dir/in_$T.safetensors" --output "$dir/y_${T}_${act}_$side.safetensors" 2>&1) || { echo "$msg"; exit 3; }
        done
        if cmp -s "$dir/y_${T}_${act}_a.safetensors" "$dir/y_${T}_${act}_b.safetensors"; then r=identical; else r=DIFFERENT; fail=1; fi
        echo "E K H I = $shape, T = $T, $act activations: y $r"
      done
    done
    rm -f "$dir"/*.safetensors
  done
  exit $fail
  ;;
_ncu)
  for side in b ${NCU_A:+a}; do
    rep=$L/ncu_$side
    MEGAMOE_BENCH_FLUSH_MB=0 ncu --clock-control none -k "regex:${NCU_KERNELS:-expert_stream}" -c 2 \
      --section SourceCounters --section WarpStateStats --section MemoryWorkloadAnalysis \
      --section MemoryWorkloadAnalysis_Tables --section SpeedOfLight --section ComputeWorkloadAnalysis \
      --import-source no -f -o "$rep" $B/rev-$side/megamoe bench --backend cuda \
      ${NCU_ARGS:---experts 256 --top-k 8 --hidden 7168 --inter 2048 --tokens 8} --iters 1 > "$rep.log" 2>&1 || { tail -5 "$rep.log"; exit 1; }
    ncu -i "$rep.ncu-rep" --page details > "${rep}_details.txt" 2>&1
    ncu -i "$rep.ncu-rep" --page source --print-source sass --csv > "${rep}_sass.csv" 2>&1
    [ -n "${KEEP_REP:-}" ] || rm -f "$rep.ncu-rep"
    grep -E "SM Frequency|DRAM Throughput|Duration|Issue Slots Busy|No Eligible" "${rep}_details.txt" | head -12
  done
  exit 0
  ;;
esac

BUDGET_S=${BUDGET_S:-570}
start=$(date +%s)
fails=0 left_out=()
now() { echo $(($(date +%s) - start)); }
# step NAME USUAL_S COMMAND...: runs COMMAND (an executable, not a function) under the time left, or
# says it does not fit; prints one line with the step's verdict and the lines that tell how it went.
step() {
  local name=$1 need=$2 left rc
  shift 2
  left=$((BUDGET_S - $(now)))
  if [ "$left" -lt "$need" ]; then
    echo "[$(now) s] $name: NOT RUN (time: $left s left, usually ~$need s)"
    left_out+=("$name")
    return 2
  fi
  timeout "$left" "$@" > "$L/$name.log" 2>&1
  rc=$?
  tar -czf "$OUT/variant.tgz.tmp" -C "$L" . && mv "$OUT/variant.tgz.tmp" "$OUT/variant.tgz"
  if [ $rc -eq 124 ]; then
    echo "[$(now) s] $name: NOT FINISHED (time: stopped after $left s)"
    left_out+=("$name")
    return $rc
  fi
  [ $rc -eq 0 ] || fails=$((fails + 1))
  echo "[$(now) s] $name: $([ $rc -eq 0 ] && echo ok || echo "FAILED (rc $rc)") $(grep -E '^\[  (PASSED|FAILED)|(ERROR|RACECHECK) SUMMARY' "$L/$name.log" | grep -v 'not printed' | sed 's/^=* *//' | tr '\n' ' ')"
  return $rc
}

nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv,noheader | tee "$L/gpu.txt"
# tests and sanitize stand for their steps, which can also be named one by one (test_gpu_ws, memcheck).
parts=()
for part in ${*:-gate bitwise compare ncu test_gpu_auto test_gpu_stream sanitize test_gpu_mma test_gpu_wgmma test_gpu_ws test_gpu_ws64}; do
  case $part in
  tests) for m in $KERNEL_MODES; do parts+=("test_gpu_$m"); done; parts+=(test_graph) ;;
  sanitize) parts+=(memcheck initcheck synccheck racecheck) ;;
  *) parts+=("$part") ;;
  esac
done
revs_ok=1
prepare_revs || revs_ok=0
for part in "${parts[@]}"; do
  case $part in
  gate)
    step gate 40 env MEGAMOE_GEMM="${GATE_GEMM:-stream}" $B/test_gpu --quick || { echo "gate failed: stopping (log $L/gate.log)"; exit 1; }
    ;;
  bitwise)
    if [ $revs_ok = 1 ]; then
      step bitwise 90 bash "$self" _bitwise
      [ -f "$L/bitwise.log" ] && tail -12 "$L/bitwise.log"
    else
      echo "bitwise: NOT RUN (no .devbin/rev-a/megamoe: stage with this script)"
      left_out+=(bitwise)
    fi
    ;;
  compare)
    if [ $revs_ok = 1 ]; then
      step compare $((100 * ${ROUNDS:-1})) env OUT="$L" SHAPES_ONLY="${COMPARE_SHAPES:-256 8 7168 2048;8 2 4096 14336;128 8 2048 768}" \
        ACTIVATIONS="${ACTIVATIONS:-bf16 nvfp4}" bash bench/device/compare_revs.sh bench "${COMPARE_TOKENS:-1,8,32}" "${ROUNDS:-1}"
      [ -f "$L/compare.log" ] && sed -n '/^A = /,$p' "$L/compare.log"
    else
      echo "compare: NOT RUN (no .devbin/rev-a/megamoe: stage with this script)"
      left_out+=(compare)
    fi
    ;;
  ncu)
    step ncu $((60 * (${NCU_A:+1} + 1))) bash "$self" _ncu
    [ -f "$L/ncu.log" ] && cat "$L/ncu.log"
    ;;
  test_graph)
    step test_graph 15 $B/test_graph
    ;;
  test_gpu_*)
    step "$part" 50 env MEGAMOE_GEMM="${part#test_gpu_}" $B/test_gpu
    ;;
  memcheck | initcheck | synccheck | racecheck)
    excl=()
    [ $part = racecheck ] && excl=("${RACECHECK_EXCLUDE[@]}")
    step "$part" 60 env MEGAMOE_GEMM=auto compute-sanitizer --tool $part --report-api-errors no --error-exitcode 9 \
      ${excl[@]+"${excl[@]}"} $B/test_gpu --quick
    ;;
  *) echo "unknown part: $part" >&2; exit 2 ;;
  esac
done
echo "[$(now) s] done: $fails failed$([ ${#left_out[@]} -gt 0 ] && echo "; not run or not finished: ${left_out[*]} (bash bench/device/variant.sh ${left_out[*]})")"
[ $fails -eq 0 ] && [ ${#left_out[@]} -eq 0 ]
