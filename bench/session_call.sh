#!/usr/bin/env bash
# One device call that compares builds of bench/build_variants.sh (packed by bench/pack_devbin.sh):
# on a 2-GPU machine the tests and sanitizers of the TESTS builds run on GPU 0 while the BENCH builds
# are benchmarked side by side on GPU 1 (one GPU: one after the other); then, with two GPUs, the
# multi-GPU pytest of the first TESTS build. Every step has a time limit inside LIMIT seconds, so the
# logs always come back: $OUT/logs.tar.gz (bench/variants.sh's tables are printed last).
#   usage (device tool, carry .devpack):
#     TESTS="c" KERNELS="auto wgmma stream" BENCH="main c" TOKENS=1,8,32,128 bash bench/session_call.sh
#   env: TESTS (build names, each optionally NAME:kernel,kernel), BENCH (build names; "main" =
#        .devbin/megamoe), KERNELS (test_gpu's kernel modes, default auto and all five forced), TOKENS, SHAPES, FORMATS,
#        SANITIZE (1: memcheck + racecheck of the first TESTS build, default 1), LIMIT (default 540),
#        PROBES (dev probes of .devbin run first on GPU 0, 90 s each at most, e.g. "sm90_bf16_gather_probe")
set -u
OUT=${OUT:-device-out}
mkdir -p "$OUT"
[ -f .devpack/devbin.tar.xz ] && tar xJf .devpack/devbin.tar.xz
L=$OUT/logs
mkdir -p "$L"
start=$(date +%s)
limit=${LIMIT:-540}
left() { echo $((limit - ($(date +%s) - start))); }
gpus=$(nvidia-smi -L 2>/dev/null | wc -l)
first=${TESTS%% *}
first=${first%%:*}
tests_part() {
  local probe
  for probe in ${PROBES:-}; do
    echo "== $probe"; timeout 90 ".devbin/$probe" 2>&1 | tail -n 8
  done
  [ -n "${TESTS:-}" ] || return 0
  local until=$(( $(date +%s) + $(left) * 6 / 10 )) entry
  for entry in $TESTS; do # NAME or NAME:kernel,kernel (default: $KERNELS)
    local ks=${KERNELS:-auto mma wgmma stream ws ws64}
    [[ $entry == *:* ]] && ks=${entry#*:} && ks=${ks//,/ }
    OUT=$L/t KERNELS="$ks" timeout $(( until - $(date +%s) )) bash bench/variants.sh tests "${entry%%:*}"
  done
  echo "tests done at $(( $(date +%s) - start )) s"
  if [ "${SANITIZE:-1}" = 1 ]; then
    OUT=$L/t timeout $(( $(left) / 2 )) bash bench/variants.sh sanitize "$first"
    echo "sanitize done at $(( $(date +%s) - start )) s"
  fi
}
bench_part() {
  [ -n "${BENCH:-}" ] || return 0
  OUT=$L/b timeout $(( $(left) - 40 )) bash bench/variants.sh bench $BENCH
  echo "bench done at $(( $(date +%s) - start )) s"
}
if [ "$gpus" -ge 2 ]; then
  (export CUDA_VISIBLE_DEVICES=0; tests_part) > "$L/gpu0.txt" 2>&1 &
  (export CUDA_VISIBLE_DEVICES=1; bench_part) > "$L/gpu1.txt" 2>&1 &
  wait
  if [ -n "$first" ] && [ "$(left)" -gt 60 ]; then
    . bench/device_env.sh
    MEGAMOE_CLI=$([ "$first" = main ] && echo .devbin/megamoe || echo ".devbin/megamoe_$first") \
      timeout $(( $(left) - 15 )) python3 -m pytest -q -p no:cacheprovider -rs tests/py/test_multi_gpu.py > "$L/multi_gpu.txt" 2>&1
    echo "multi-GPU: $(tail -n 1 "$L/multi_gpu.txt")" >> "$L/gpu0.txt"
  fi
else
  { tests_part; bench_part; } > "$L/gpu0.txt" 2>&1
fi
tar czf "$OUT/logs.tar.gz" -C "$OUT" logs && rm -rf "$L"
echo "total $(( $(date +%s) - start )) s"
tar xzOf "$OUT/logs.tar.gz" --wildcards 'logs/gpu*.txt'
