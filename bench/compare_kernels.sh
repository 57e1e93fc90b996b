#!/usr/bin/env bash
# Runs on the GPU machine (after bench/stage_device.sh here): the NVFP4 forward of the three shapes
# with each expert-GEMM kernel forced, side by side with the per-forward choice, to place the
# thresholds of gemm_choice (src/cuda/sm90_gemm_common.cuh). Logs go to $OUT (or ./device-out).
#   usage: bash bench/compare_kernels.sh [TOKENS] [KERNELS]   e.g. bash bench/compare_kernels.sh 32,128,512 "auto stream wgmma"
set -uo pipefail
OUT=${OUT:-device-out}
mkdir -p "$OUT"
. bench/device_env.sh
TOKENS=${1:-8,32,128,512}
KERNELS=${2:-auto stream wgmma}
for shape in "256 8 7168 2048" "128 8 2048 768" "8 2 4096 14336"; do
  set -- $shape
  for k in $KERNELS; do
    timeout 200 .devbin/megamoe bench --backend cuda --format nvfp4 --experts $1 --top-k $2 --hidden $3 --inter $4 \
      --tokens "$TOKENS" --iters 10 --gemm "$k" 2>&1 | tee -a "$OUT/compare_kernels.log" |
      grep "median" | sed "s/ R=1 backend=cuda/ $k/; s/ over 10//"
  done
done
