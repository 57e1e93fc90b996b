#!/usr/bin/env bash
# On the GPU machine, from the repo root, after bench/device/stage.sh here (carry .devbin): the GPU
# verification in one command. Prints one line per step and a verdict; logs under $OUT/logs.
#   usage: bash bench/device/check.sh [tests] [sanitize] [multi] [demo] [bench] [soak] [fuzz]
#             (none: all but soak and fuzz)
#   tests     test_gpu in every kernel mode (KERNEL_MODES: chosen per forward, then each kernel forced),
#             and test_graph (10^4 CUDA graph replays per case on new inputs, bitwise equal to eager)
#   sanitize  compute-sanitizer memcheck, racecheck, synccheck and initcheck over test_gpu --quick in
#             every kernel mode (TOOLS to choose), and the racecheck probe (dev/sm90_racecheck_probe.cu)
#   multi     the 2-GPU pytest (tests/py/test_multi_gpu.py; reported as skipped with one GPU)
#   demo      megamoe demo
#   soak      megamoe_soak: SOAK_FORWARDS (10^5) random forwards on R = 1..8 ranks against the CPU
#             backend, stopping after SOAK_SECONDS (540); alone, only when named
#   fuzz      the loader and forward fuzz targets staged in .devbin/fuzz (tests/fuzz/run.sh, no compiler
#             needed) on the CPU cores, both at once for FUZZ_SECONDS (400): FUZZ_JOBS (nproc - 2)
#             workers in all, a fifth for loader (its inputs are ~3.7x quicker: 3 of 14) and the rest
#             for forward (FUZZ_JOBS_LOADER / FUZZ_JOBS_FORWARD to choose); per target executions,
#             exec/s and crashes (0 to pass); crash inputs and the corpora found come back under
#             $OUT/fuzz/; alone, only when named
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
  jobs+=("test_graph|test|timeout $STEP_TIMEOUT $B/test_graph")
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
if [[ $what == *" soak "* ]]; then
  timeout $((${SOAK_SECONDS:-540} + 50)) $B/megamoe_soak --forwards "${SOAK_FORWARDS:-100000}" \
    --seconds "${SOAK_SECONDS:-540}" --seed "${SOAK_SEED:-1}" > "$L/soak.log" 2>&1
  echo "soak: exit $?, $(grep -E '^soak: (passed|FAILED)' "$L/soak.log" | tail -n 1)" | tee "$L/result_soak.txt"
fi
if [[ $what == *" fuzz "* ]]; then
  # Both targets at once: one after the other at FUZZ_SECONDS each would not fit one 10-minute device
  # call, and the cores do the same executions either way (independent workers, one core each).
  fj=${FUZZ_JOBS:-$(($(nproc) - 2))}
  fjl=${FUZZ_JOBS_LOADER:-$(((fj + 2) / 5 > 0 ? (fj + 2) / 5 : 1))}
  fjf=${FUZZ_JOBS_FORWARD:-$((fj - fjl > 0 ? fj - fjl : 1))}
  mkdir -p "$OUT/fuzz"
  rm -f tests/fuzz/crash-* tests/fuzz/leak-* tests/fuzz/timeout-* tests/fuzz/oom-* tests/fuzz/slow-unit-*
  for t in loader forward; do
    jt=$fjl; [ $t = forward ] && jt=$fjf
    FUZZ_DIR=$B/fuzz FUZZ_NO_BUILD=1 FUZZ_JOBS=$jt timeout $((${FUZZ_SECONDS:-400} + 120)) \
      bash tests/fuzz/run.sh "${FUZZ_SECONDS:-400}" $t > "$L/fuzz_$t.log" 2>&1 &
  done
  wait
  crashes=$(ls tests/fuzz/ | grep -cE '^(crash|leak|timeout|oom)-')
  cp tests/fuzz/crash-* tests/fuzz/leak-* tests/fuzz/timeout-* tests/fuzz/oom-* "$OUT/fuzz/" 2>/dev/null
  for t in loader forward; do
    line=$(grep -E '^fuzz: ' "$L/fuzz_$t.log" | tail -n 1)
    rc=1; [[ $line == *"no crash"* ]] && [ "$crashes" = 0 ] && rc=0
    echo "fuzz_$t: exit $rc, ${line:-no summary (see $L/fuzz_$t.log)}; crash/leak/timeout/oom inputs (both targets): $crashes" |
      tee "$L/result_fuzz_$t.txt"
    tar czf "$OUT/fuzz/corpus_$t.tar.gz" -C "$B/fuzz/corpus" "$t" 2>/dev/null
    cp -r "$B/fuzz/jobs_$t" "$L/fuzz_jobs_$t" 2>/dev/null
  done
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
