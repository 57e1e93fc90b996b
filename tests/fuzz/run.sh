#!/usr/bin/env bash
# Builds the fuzz targets with clang (libFuzzer + ASan + UBSan) and runs each for N seconds
# (default 60); `run.sh N TARGET...` runs only those targets. Targets:
#   safetensors  the safetensors header parser (fuzz_safetensors.c)
#   loader       checkpoint files and index, naming styles, weight loader, converter (fuzz_loader.c)
#   forward      an inputs file and the forward's arguments on the CPU backend (fuzz_forward.c)
# The seeds are tests/fuzz/corpus/TARGET (tracked, small; tests/fuzz/make_seeds.py writes loader's and
# forward's); inputs found during a run go to build-fuzz/corpus/TARGET (ignored), so a run leaves no
# untracked file. FUZZ_RUNS=N stops a target after N executions (before N seconds when it gets there).
# FUZZ_DIR=D builds and writes into D instead of build-fuzz (a second run beside a long campaign).
# FUZZ_TIMEOUT=S is the seconds one input may take (default 10; a long campaign run at low priority on a
# busy machine needs more). FUZZ_JOBS=J runs J worker processes per target (libFuzzer -fork). A crash is
# written to tests/fuzz/crash-* (ignored) and fails the script.
set -euo pipefail
cd "$(dirname "$0")/../.."
seconds=${1:-60}
shift || true
targets=("$@")
[ ${#targets[@]} -gt 0 ] || targets=(safetensors loader forward)
out=${FUZZ_DIR:-build-fuzz}
mkdir -p "$out"
flags=(-g -O1 -std=c11 -D_POSIX_C_SOURCE=200809L -D_DEFAULT_SOURCE -fsanitize=fuzzer,address,undefined
       -fno-sanitize-recover=all -Iinclude -Isrc)
jansson=$(pkg-config --cflags --libs jansson)
# Every C source of the library (the CUDA and NCCL backends as their stubs, no OpenMP: one thread).
mapfile -t lib < <(find src -name '*.c' | sort)
for t in "${targets[@]}"; do
  src=tests/fuzz/fuzz_$t.c
  [ -f "$src" ] || { echo "fuzz: no target '$t' ($src)"; exit 2; }
  if [ "$t" = safetensors ]; then
    sources=(src/checkpoint/safetensors.c src/errors.c src/tensor.c)
  else
    sources=("${lib[@]}")
  fi
  clang "${flags[@]}" "$src" "${sources[@]}" $jansson -lm -o "$out/fuzz_$t"
done
for t in "${targets[@]}"; do
  mkdir -p "$out/corpus/$t"
  log=$out/fuzz_$t.log
  opts=()
  [ "${FUZZ_JOBS:-1}" -gt 1 ] && opts=(-fork="$FUZZ_JOBS" -ignore_crashes=0)
  [ -n "${FUZZ_RUNS:-}" ] && opts+=(-runs="$FUZZ_RUNS")
  set +e
  "./$out/fuzz_$t" -max_total_time="$seconds" -max_len=$([ "$t" = loader ] && echo 65536 || echo 8192) \
    -timeout="${FUZZ_TIMEOUT:-10}" -rss_limit_mb=4096 -print_final_stats=1 "${opts[@]}" -artifact_prefix=tests/fuzz/ \
    "$out/corpus/$t" "tests/fuzz/corpus/$t" >"$log" 2>&1
  rc=$?
  set -e
  execs=$(grep -o 'stat::number_of_executed_units: *[0-9]*' "$log" | grep -o '[0-9]*$' | tail -1)
  [ -n "$execs" ] || execs=$(grep -oE '^#[0-9]+' "$log" | tail -1 | tr -d '#')
  if [ $rc -ne 0 ]; then
    tail -n 30 "$log"
    echo "fuzz: $t FAILED after ${execs:-?} executions (log $log)"
    exit 1
  fi
  secs=$(grep -o 'Done [0-9]* runs in [0-9]* second' "$log" | grep -o 'in [0-9]*' | tr -d 'in ' | tail -1)
  echo "fuzz: $t ${secs:-$seconds}s, ${execs:-?} executions, no crash; corpus $(ls "tests/fuzz/corpus/$t" | wc -l) seeds + $(ls "$out/corpus/$t" | wc -l) found (log $log)"
done
