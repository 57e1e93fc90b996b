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
