#!/usr/bin/env bash
# Builds the fuzz targets with clang (libFuzzer + ASan + UBSan) and runs each for N seconds
# (default 60); `run.sh N TARGET...` runs only those targets. Targets:
#   safetensors  the safetensors header parser (fuzz_safetensors.c)
#   loader       checkpoint files and index, naming styles, weight loader, converter (fuzz_loader.c)
#   forward      an inputs file and the forward's arguments on the CPU backend (fuzz_forward.c)
# The seeds are tests/fuzz/corpus/TARGET (tracked, small; tests/fuzz/make_seeds.py writes loader's and
# forward's); inputs found during a run go to FUZZ_DIR/corpus/TARGET (ignored), so a run leaves no
# untracked file. A crash is written to tests/fuzz/crash-* (ignored) and fails the script.
# Environment:
#   FUZZ_DIR=D       build into and run from D instead of build-fuzz (a second run beside a long campaign)
#   FUZZ_BUILD_ONLY=1  build the targets and stop (bench/device/stage.sh stages them for the GPU machine)
#   FUZZ_NO_BUILD=1  run the binaries already in FUZZ_DIR, no compiler needed (the GPU machine)
#   FUZZ_JOBS=J      J worker processes per target (libFuzzer -jobs=J -workers=J, one corpus folder); the
#                    summary's count is the sum of the workers' counts
#   FUZZ_RUNS=N      stop a target after N executions (before N seconds when it gets there; per worker)
#   FUZZ_TIMEOUT=S   seconds one input may take (default 10; a campaign at low priority on a busy machine
#                    needs more)
set -euo pipefail
cd "$(dirname "$0")/../.."
seconds=${1:-60}
shift || true
targets=("$@")
[ ${#targets[@]} -gt 0 ] || targets=(safetensors loader forward)
out=${FUZZ_DIR:-build-fuzz}
mkdir -p "$out"
if [ -z "${FUZZ_NO_BUILD:-}" ]; then
  flags=(-g -std=c11 -D_POSIX_C_SOURCE=200809L -D_DEFAULT_SOURCE -fsanitize=fuzzer,address,undefined
         -fno-sanitize-recover=all -Iinclude -Isrc)
  jansson=$(pkg-config --cflags --libs jansson)
  # Every C source of the library (the CUDA and NCCL backends as their stubs, no OpenMP: one thread).
  mapfile -t lib < <(find src -name '*.c' | sort)
  for t in "${targets[@]}"; do
    src=tests/fuzz/fuzz_$t.c
    [ -f "$src" ] || { echo "fuzz: no target '$t' ($src)"; exit 2; }
    case $t in
    safetensors) sources=(src/checkpoint/safetensors.c src/errors.c src/tensor.c) extra=(-O1) ;;
    # The forward's time is the experts' multiply-adds: -O2 vectorizes them, and the arithmetic leaves
    # carry neither coverage nor UBSan instrumentation (the two lists say which and why; ASan stays).
    forward) sources=("${lib[@]}") extra=(-O2 -fsanitize-coverage-ignorelist=tests/fuzz/coverage_ignore.txt
                                          -fsanitize-ignorelist=tests/fuzz/ubsan_ignore.txt) ;;
    *) sources=("${lib[@]}") extra=(-O1) ;;
    esac
    clang "${flags[@]}" "${extra[@]}" "$src" "${sources[@]}" $jansson -lm -o "$out/fuzz_$t"
  done
  [ -z "${FUZZ_BUILD_ONLY:-}" ] || { echo "fuzz: built ${targets[*]} into $out"; exit 0; }
fi
root=$PWD
outabs=$(cd "$out" && pwd) # FUZZ_DIR relative to the repo root or absolute
for t in "${targets[@]}"; do
  [ -x "$out/fuzz_$t" ] || { echo "fuzz: no binary $out/fuzz_$t (build it first: FUZZ_BUILD_ONLY=1)"; exit 2; }
  mkdir -p "$out/corpus/$t"
  log=$out/fuzz_$t.log
  jobs=${FUZZ_JOBS:-1}
  opts=()
  # J > 1: J independent workers (-jobs=J -workers=J) sharing the corpus folder, each for the whole
  # time, each writing fuzz-N.log in $out/jobs_$t. Against -fork=J (short child runs merged by a parent)
  # this gave ~1.7x the executions on two cores, and the total is exact: the sum of the workers' final
  # counts (a -fork parent leaves out the runs of the jobs it stops at the end).
  [ "$jobs" -gt 1 ] && opts=(-jobs="$jobs" -workers="$jobs")
  [ -n "${FUZZ_RUNS:-}" ] && opts+=(-runs="$FUZZ_RUNS")
  work=$out/jobs_$t
  rm -rf "$work" && mkdir -p "$work"
  set +e
  (cd "$work" && "$outabs/fuzz_$t" -max_total_time="$seconds" -max_len=$([ "$t" = loader ] && echo 65536 || echo 8192) \
    -timeout="${FUZZ_TIMEOUT:-10}" -rss_limit_mb=4096 -print_final_stats=1 "${opts[@]}" \
    -artifact_prefix="$root/tests/fuzz/" "$outabs/corpus/$t" "$root/tests/fuzz/corpus/$t") >"$log" 2>&1
  rc=$?
  set -e
  logs=("$log")
  [ "$jobs" -gt 1 ] && logs=("$work"/fuzz-*.log)
  # Executions: the sum over the workers of libFuzzer's final count (or its last status line when a
  # worker stopped before printing one).
  execs=0
  for f in "${logs[@]}"; do
    n=$(grep -o 'stat::number_of_executed_units: *[0-9]*' "$f" | grep -o '[0-9]*$' | tail -1)
    [ -n "$n" ] || n=$(grep -oE '^#[0-9]+' "$f" | tail -1 | tr -d '#')
    execs=$((execs + ${n:-0}))
  done
  # A worker's report fails the run even when its parent exits 0.
  if grep -qE '^==[0-9]+== ?ERROR|runtime error:|^SUMMARY: |Test unit written to' "${logs[@]}"; then
    [ $rc -ne 0 ] || rc=1
  fi
  if [ $rc -ne 0 ]; then
    for f in "${logs[@]}"; do grep -qE 'ERROR|runtime error|SUMMARY' "$f" && tail -n 30 "$f"; done
    echo "fuzz: $t FAILED after $execs executions (logs $log${work:+, $work/})"
    exit 1
  fi
  secs=$(grep -ho 'Done [0-9]* runs in [0-9]* second' "${logs[@]}" | grep -o 'in [0-9]*' | tr -d 'in ' | sort -n | tail -1)
  secs=${secs:-$seconds}
  echo "fuzz: $t ${secs}s, $execs executions ($jobs worker(s), $((execs / (secs > 0 ? secs : 1))) per second), no crash; corpus $(ls "tests/fuzz/corpus/$t" | wc -l) seeds + $(ls "$out/corpus/$t" | wc -l) found (log $log)"
done
