#!/usr/bin/env bash
# The whole benchmark comparison of issue 3 on the GPU machine, in one command (after
# bench/device/stage.sh here): megamoe for the three shapes, both formats, T in 1..8192, then the
# PyTorch baseline. Logs go to $OUT (or ./device-out).
#   usage: bash bench/run_all.sh [TOKENS]      e.g. bash bench/run_all.sh 1,8,32,128,512,2048,8192
set -uo pipefail
OUT=${OUT:-device-out}
mkdir -p "$OUT"
. bench/device/env.sh
TOKENS=${1:-1,8,32,128,512,2048,8192}
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm --format=csv,noheader | tee "$OUT/gpu.txt"
for fmt in nvfp4 bf16; do
  for shape in "256 8 7168 2048" "128 8 2048 768" "8 2 4096 14336"; do
    set -- $shape
    timeout 300 .devbin/megamoe bench --backend cuda --format $fmt --experts $1 --top-k $2 --hidden $3 --inter $4 \
      --tokens "$TOKENS" --iters 10 2>&1 | tee -a "$OUT/megamoe.log"
  done
done
timeout 400 python3 bench/torch_baseline.py "$TOKENS" 2>&1 | tee "$OUT/torch.log"
