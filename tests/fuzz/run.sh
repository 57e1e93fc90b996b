#!/usr/bin/env bash
# Builds the safetensors fuzzer with clang (libFuzzer + ASan + UBSan) and runs it for N seconds
# (default 60) over tests/fuzz/corpus, which keeps the inputs that found new coverage.
set -euo pipefail
cd "$(dirname "$0")/../.."
seconds=${1:-60}
mkdir -p build-fuzz
clang -g -O1 -std=c11 -D_POSIX_C_SOURCE=200809L -D_DEFAULT_SOURCE -fsanitize=fuzzer,address,undefined \
  -fno-sanitize-recover=all -Iinclude -Isrc tests/fuzz/fuzz_safetensors.c src/checkpoint/safetensors.c src/errors.c src/tensor.c \
  $(pkg-config --cflags --libs jansson) -o build-fuzz/fuzz_safetensors
./build-fuzz/fuzz_safetensors -max_total_time="$seconds" -max_len=4096 -timeout=10 \
  -artifact_prefix=tests/fuzz/ tests/fuzz/corpus 2>&1 | tail -n 3
echo "fuzz: ${seconds}s, no crash; corpus holds $(ls tests/fuzz/corpus | wc -l) inputs"
