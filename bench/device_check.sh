#!/usr/bin/env bash
# Runs on the GPU machine from the repo root, after bench/stage_device.sh: the GPU tests, the
# compute-sanitizer runs, the demo and the benchmark table. Logs go to $OUT (or ./device-out).
#   usage: bash .devbin/device_check.sh [tests|sanitize|multi|dev|demo|bench|all]...
set -uo pipefail
OUT=${OUT:-device-out}
mkdir -p "$OUT"
. bench/device_env.sh
B=.devbin
what=${*:-all}
has() { [[ " $what " == *" $1 "* || " $what " == *" all "* ]]; }
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,memory.used --format=csv | tee "$OUT/gpu.txt"
if has tests; then
  # Issue 3: HGMMA in the SASS of the large-batch path (the wgmma kernels).
  n=$(cuobjdump --dump-sass $B/megamoe 2>/dev/null | grep -c "HGMMA")
  echo "== HGMMA instructions in the wgmma kernels' SASS: $n"; [ "$n" -gt 0 ] || echo "FAILED: no HGMMA"
  # Once with the kernels chosen per forward, then with each GEMM kernel forced on every case.
  for gemm in auto mma wgmma stream ws ws64; do
    echo "== GPU tests (MEGAMOE_GEMM=$gemm)"
    MEGAMOE_GEMM=$gemm $B/test_gpu 2>&1 | tee "$OUT/test_gpu_$gemm.log" | grep -E "PASSED|FAILED|ERROR|rror"
  done
fi
if has sanitize; then
  # NCCL probes its kernel images at communicator creation and gets cudaErrorNoKernelImageForDevice
  # back by design; those API errors are not ours (every call of ours is checked), so only memory
  # and race reports count. racecheck leaves out the streaming and warp-specialized kernels: it reports the mbarrier
  # parity hand-offs of TMA pipelines even in a minimal correct kernel (dev/sm90_racecheck_probe.cu,
  # run below; docs/TESTING.md).
  for run in "memcheck auto" "memcheck wgmma" "memcheck stream" "memcheck ws" "racecheck auto" "racecheck wgmma" "racecheck mma"; do
    set -- $run
    excl=(); [ "$1" = racecheck ] && excl=("${RACECHECK_EXCLUDE[@]}")
    echo "== compute-sanitizer $1 (MEGAMOE_GEMM=$2)"
    MEGAMOE_GEMM=$2 compute-sanitizer --tool "$1" --report-api-errors no --error-exitcode 9 "${excl[@]}" \
        $B/test_gpu --quick > "$OUT/sanitize_$1_$2.log" 2>&1
    echo "exit $?"; tail -n 1 "$OUT/sanitize_$1_$2.log"
  done
  for m in 0 2 5; do compute-sanitizer --tool racecheck $B/sm90_racecheck_probe $m 2>&1 | grep -E "mode|SUMMARY"; done
fi
if has multi; then
  echo "== multi-GPU tests"; MEGAMOE_CLI=$B/megamoe python3 -m pytest -q -p no:cacheprovider -rs tests/py/test_multi_gpu.py 2>&1 | tee "$OUT/multi_gpu.log" | tail -5
fi
if has dev; then
  for probe in sm90_bf16_gather_probe sm90_bf16_gemm_probe sm90_fp4_ws_gemm_probe sm90_stream_probe sm90_decode_gemm; do
    echo "== dev/$probe"; timeout 240 $B/$probe 2>&1 | tee "$OUT/$probe.log"
  done
fi
if has demo; then
  echo "== demo"; $B/megamoe demo 2>&1 | tee "$OUT/demo.log"
fi
if has bench; then
  echo "== bench"
  for fmt in nvfp4 bf16; do
    for shape in "256 8 7168 2048" "128 8 2048 768" "8 2 4096 14336"; do
      set -- $shape
      timeout 300 $B/megamoe bench --backend cuda --format $fmt --experts $1 --top-k $2 --hidden $3 --inter $4 \
        --tokens ${BENCH_TOKENS:-1,8,32,128,512,2048,8192} --iters 10 2>&1 | tee -a "$OUT/bench.log"
    done
  done
fi
