# Sourced by a device call's script (bench/results/<date>/callN.sh, run on the GPU machine from the
# repo root with carry .devpack): unpacks the carried builds, puts their libraries on the loader path
# and gives the script $L (its log folder under $OUT), el (seconds since the start) and
# call_finish (tars the logs for the trip back, prints the step lines and the benchmark figures).
set -u
OUT=${OUT:-device-out}
L=$OUT/logs
mkdir -p "$L"
# Unpacked once per call: a script may replace builds (e.g. stage a variant as .devbin/megamoe) and
# then source bench/full_suite.sh, which sources this file again.
if [ -z "${DEVBIN_UNPACKED:-}" ]; then
  tar xJf .devpack/devbin.tar.xz
  DEVBIN_UNPACKED=1
  start=$(date +%s)
fi
. bench/device_env.sh
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
# bin NAME: the CLI build NAME (main: .devbin/megamoe, else .devbin/megamoe_NAME).
bin() { [ "$1" = main ] && echo .devbin/megamoe || echo ".devbin/megamoe_$1"; }
# The three shapes of issue 3 (E K H I): Qwen3-30B-like, Mixtral-like, DeepSeek-V3-like.
SHAPES3=("128 8 2048 768" "8 2 4096 14336" "256 8 7168 2048")
# cmp_bench LOG TOKENS NAME...: the `bench` of each build NAME in the order given (repeat a name to
# alternate), on the three shapes at TOKENS (a comma list), appended to $L/LOG as "bench[NAME]:"
# lines; NVFP4, or the format FMT names (FMT=bf16 cmp_bench ...); each run limited to CMP_TIMEOUT s
# (40; BF16 DSv3 builds 22 GB of weights: give it 90).
cmp_bench() {
  local log=$1 tokens=$2 n s; shift 2
  local names=("$@")
  for n in "${names[@]}"; do
    for s in "${SHAPES3[@]}"; do
      set -- $s
      timeout "${CMP_TIMEOUT:-40}" "$(bin "$n")" bench --backend cuda --format "${FMT:-nvfp4}" --experts $1 --top-k $2 --hidden $3 \
        --inter $4 --tokens "$tokens" --iters 10 2>&1 | sed "s/^bench:/bench[$n]:/" >> "$L/$log"
    done
  done
}
# stream_checks BIN: test_gpu build BIN in the modes that run the streaming kernel (auto, stream)
# and memcheck with it forced -- what a change to the streaming kernel alone is checked with.
stream_checks() {
  tg "$1" auto
  tg "$1" stream
  san memcheck "$1" stream
}
# trace_runs NAME T: the trace build NAME's `bench` at T tokens on the three shapes, its timelines
# appended to $L/trace.txt under "== NAME E= K= H= I= T=" lines.
trace_runs() {
  local n=$1 t=$2 s
  for s in "${SHAPES3[@]}"; do
    set -- $s
    echo "== $n E=$1 K=$2 H=$3 I=$4 T=$t" >> "$L/trace.txt"
    timeout 30 "$(bin "$n")" bench --backend cuda --format nvfp4 --experts $1 --top-k $2 --hidden $3 --inter $4 \
      --tokens "$t" --iters 10 >> "$L/trace.txt" 2>&1
  done
}
# multi_gpu NAME: the 2-GPU pytest (tests/py/test_multi_gpu.py, NCCL across both GPUs) with the CLI
# build NAME; one result line.
multi_gpu() {
  local log="$L/multi_gpu_$1.txt"
  MEGAMOE_CLI="$(bin "$1")" timeout 120 python3 -m pytest -q -p no:cacheprovider -rs tests/py/test_multi_gpu.py \
    > "$log" 2>&1
  echo "multi-GPU $1: $(tail -n 1 "$log") at $(el) s"
}
