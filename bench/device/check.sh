#!/usr/bin/env bash
# On the GPU machine, from the repo root, after bench/device/stage.sh here (carry .devbin): the GPU
# verification in one command. Prints one line per step and a verdict; logs under $OUT/logs.
#   usage: bash bench/device/check.sh [tests] [sanitize] [multi] [demo] [bench]    (none: all of them)
#   tests     test_gpu in every kernel mode (KERNEL_MODES: chosen per forward, then each kernel forced)
#   sanitize  compute-sanitizer memcheck, racecheck, synccheck and initcheck over test_gpu --quick in
#             every kernel mode (TOOLS to choose), and the racecheck probe (dev/sm90_racecheck_probe.cu)
#   multi     the 2-GPU pytest (tests/py/test_multi_gpu.py; reported as skipped with one GPU)
#   demo      megamoe demo
#   bench     the benchmark table: three shapes x NVFP4/BF16 (x both NVFP4 activation modes when the
#             build has --activations), T = 1..8192; --json records to $OUT/bench.jsonl when it has --json
# env: KERNEL_MODES, TOOLS, JOBS_PER_GPU (test and sanitizer runs at once per GPU, default 1; the
#      four tools in six modes take longer than one 10-minute device call at 1 on one GPU: use 3, or
#      split: TOOLS="memcheck racecheck" then TOOLS="synccheck initcheck"), STEP_TIMEOUT (s, 420),
#      BENCH_TOKENS (1,8,32,128,512,2048,8192).
# Tests and sanitizer runs spread over every visible GPU; multi, demo and bench run after them, alone,
# so that nothing else shares the GPU while timing. Exit 0 only when every step passed.
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-device-out}
L=$OUT/logs
mkdir -p "$L"
rm -f "$L"/result_*.txt
. bench/device/env.sh
B=.devbin
TOOLS=${TOOLS:-memcheck racecheck synccheck initcheck}
STEP_TIMEOUT=${STEP_TIMEOUT:-420}
what=" ${*:-all} "
has() { [[ $what == *" $1 "* || $what == *" all "* ]]; }
start=$(date +%s)
el() { echo $(($(date +%s) - start)); }
NGPU=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU')
[ "$NGPU" -ge 1 ] || { echo "check: no GPU visible"; exit 1; }
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,memory.used --format=csv,noheader | tee "$L/gpu.txt"

# The parallel part: jobs "NAME|KIND|COMMAND", run by NGPU * JOBS_PER_GPU workers.
jobs=()
if has tests; then
  n=$(cuobjdump --dump-sass $B/megamoe 2>/dev/null | grep -c HGMMA)
  echo "HGMMA instructions in the SASS: $n $([ "$n" -gt 0 ] && echo ok || echo FAILED)"
  [ "$n" -gt 0 ] || echo "hgmma: FAILED" > "$L/result_hgmma.txt"
  for m in $KERNEL_MODES; do
    jobs+=("test_gpu_$m|test|MEGAMOE_GEMM=$m timeout $STEP_TIMEOUT $B/test_gpu")
  done
fi
if has sanitize; then
  for tool in $TOOLS; do
    excl=""
    [ "$tool" = racecheck ] && excl="${RACECHECK_EXCLUDE[*]}"
    for m in $KERNEL_MODES; do
      jobs+=("${tool}_$m|san|MEGAMOE_GEMM=$m timeout $STEP_TIMEOUT compute-sanitizer --tool $tool --report-api-errors no --error-exitcode 9 $excl $B/test_gpu --quick")
    done
  done
  # Modes 0 and 3 are correct hand-offs racecheck reports anyway; 2 and 5 it follows (dev/README.md).
  for p in 0 2 5; do
    jobs+=("racecheck_probe_$p|probe|timeout 120 compute-sanitizer --tool racecheck $B/sm90_racecheck_probe $p")
  done
fi
# summary KIND LOG: the one line of a step's log that says how it went.
summary() {
  case $1 in
  test) grep -E '^\[  (PASSED|FAILED)' "$2" | tr '\n' ' ' ;;
  san) echo "$(grep -E '(ERROR|RACECHECK) SUMMARY' "$2" | grep -v 'not printed' | tail -n 1 | sed 's/^=* *//')" \
    "$(grep -E '^\[  (PASSED|FAILED)' "$2" | tr '\n' ' ')" ;;
  probe) grep -E '(ERROR|RACECHECK) SUMMARY' "$2" | grep -v 'not printed' | tail -n 1 | sed 's/^=* *//' ;;
  *) tail -n 1 "$2" ;;
  esac
}
worker() { # worker W SLOTS: the jobs i with i % SLOTS == W, on GPU W % NGPU
  local w=$1 slots=$2 i name kind cmd t0 rc
  for ((i = w; i < ${#jobs[@]}; i += slots)); do
    IFS='|' read -r name kind cmd <<< "${jobs[$i]}"
    t0=$(date +%s)
    CUDA_VISIBLE_DEVICES=$((w % NGPU)) bash -c "$cmd" > "$L/$name.log" 2>&1
    rc=$?
    echo "$name: exit $rc, $(summary "$kind" "$L/$name.log"), $(($(date +%s) - t0)) s" > "$L/result_$name.txt"
    cat "$L/result_$name.txt"
  done
}
slots=$((NGPU * ${JOBS_PER_GPU:-1}))
for ((w = 0; w < slots; w++)); do worker $w $slots & done
wait

# The serial part.
if has multi; then
  MEGAMOE_CLI=$B/megamoe timeout "$STEP_TIMEOUT" python3 -m pytest -q -p no:cacheprovider -rs tests/py/test_multi_gpu.py > "$L/multi_gpu.log" 2>&1
  rc=$?
  echo "multi_gpu: exit $rc, $(tail -n 1 "$L/multi_gpu.log")" | tee "$L/result_multi_gpu.txt"
fi
if has demo; then
  timeout "$STEP_TIMEOUT" $B/megamoe demo > "$L/demo.log" 2>&1
  echo "demo: exit $?, $(tail -n 1 "$L/demo.log")" | tee "$L/result_demo.txt"
fi
if has bench; then
  json=()
  $B/megamoe bench --help | grep -q -- '--json' && json=(--json "$OUT/bench.jsonl")
  acts=(default)
  $B/megamoe bench --help | grep -q -- '--activations' && acts=(bf16 nvfp4)
  for fmt in nvfp4 bf16; do
    for s in "${SHAPES3[@]}"; do
      set -- $s
      for a in "${acts[@]}"; do
        [ "$fmt" = bf16 ] && [ "$a" = nvfp4 ] && continue
        aa=(); [ "$a" != default ] && aa=(--activations "$a")
        timeout 300 $B/megamoe bench --backend cuda --format $fmt "${aa[@]}" --experts $1 --top-k $2 --hidden $3 --inter $4 \
          --tokens "${BENCH_TOKENS:-1,8,32,128,512,2048,8192}" --iters 10 "${json[@]}" >> "$L/bench.log" 2>&1 ||
          echo "bench $fmt $a E=$1: FAILED (exit $?)" >> "$L/result_bench.txt"
      done
    done
  done
  grep -E 'median' "$L/bench.log"
  [ -f "$L/result_bench.txt" ] && cat "$L/result_bench.txt"
fi

failed=$(cat "$L"/result_*.txt 2>/dev/null | grep -vcE ': exit 0,|: exit 0$|SKIP|skipped')
echo "== steps: $(cat "$L"/result_*.txt 2>/dev/null | wc -l), not passed: $failed, $(el) s"
cat "$L"/result_*.txt 2>/dev/null | grep -vE ': exit 0,' | sed 's/^/NOT PASSED: /'
tar czf "$OUT/logs.tar.gz" -C "$OUT" logs
[ "$failed" = 0 ]
