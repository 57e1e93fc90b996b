# Sourced by a device call's script (bench/results/<date>/callN.sh, run on the GPU machine from the
# repo root with carry .devpack): unpacks the carried builds, puts their libraries on the loader path
# and gives the script $L (its log folder under $OUT), el (seconds since the start) and
# call_finish (tars the logs for the trip back, prints the step lines and the benchmark figures).
set -u
OUT=${OUT:-device-out}
L=$OUT/logs
mkdir -p "$L"
tar xJf .devpack/devbin.tar.xz
. bench/device_env.sh
start=$(date +%s)
el() { echo $(( $(date +%s) - start )); }
call_finish() {
  tar czf "$OUT/logs.tar.gz" -C "$OUT" logs
  cat "$L"/gpu0.txt "$L"/gpu1.txt "$L"/both.txt 2>/dev/null
  cat "$L"/bench*.log "$L"/nccl*.log 2>/dev/null | grep -E "median|per layer" |
    sed -E 's/R=1 backend=cuda: //; s/ over 10//; s/ of touched expert weights//; s/, [0-9.]+ GB\/s.*experts\)//;
            s/\(slowest rank.s median\)//; s/ TFLOP.s.*//; s/backend=nccl: //' | cut -c1-110
}
# tg BIN MODE: test_gpu build BIN (.devbin/BIN) with the GEMM kernel MODE forced; one result line.
tg() {
  MEGAMOE_GEMM=$2 timeout 100 ".devbin/$1" > "$L/$1_$2.log" 2>&1
  echo "$1 $2: exit $? $(grep -E '^\[  (PASSED|FAILED)' "$L/$1_$2.log" | tr '\n' ' ') at $(el) s"
}
# san TOOL BIN MODE: compute-sanitizer TOOL (memcheck, racecheck: without the kernels
# RACECHECK_EXCLUDE names) over BIN's quick subset with MODE forced; one result line.
san() {
  local excl=(); [ "$1" = racecheck ] && excl=("${RACECHECK_EXCLUDE[@]}")
  MEGAMOE_GEMM=$3 timeout 120 compute-sanitizer --tool "$1" --report-api-errors no --error-exitcode 9 "${excl[@]}" \
    ".devbin/$2" --quick > "$L/$1_$2_$3.log" 2>&1
  echo "$1 $2 $3: exit $? $(tail -n 1 "$L/$1_$2_$3.log") at $(el) s"
}
