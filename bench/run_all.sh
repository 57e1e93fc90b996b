#!/usr/bin/env bash
# On the GPU machine, from the repo root: megamoe beside its peers on the three shapes of the benchmark
# table, T = 1..8192 — megamoe NVFP4 (each --activations mode the build has) and BF16, Humming's NVFP4
# MoE (whole forward, and its two GEMMs alone), Marlin W4A16 (the recorded table of issue 3) and
# PyTorch's grouped_mm (BF16) — printed side by side, and every point as a record (bench/records.py)
# in $OUT/history-<date>.jsonl: copy it to bench/history/<date>.jsonl here.
#   here:  bash bench/device/stage.sh
#          python3 -m pip download --no-deps humming-kernels==0.1.20 -d .whl
#   there: bash bench/run_all.sh [megamoe] [humming] [torch] [table]     (none: all four, in that order)
#          (device call: carry .devbin and .whl)
# env: TOKENS (1,8,32,128,512,2048,8192), SHAPES (comma list of names, default all three), ITERS (10),
#      RECORDS (earlier runs' record files to add to the table, space-separated).
# Time on one H200 (2026-12-01): megamoe 75-90 s, Humming ~2 min (its first call per configuration
# compiles for 25-40 s, ~90 s more for the three shapes cold; the compiled kernels are cached in
# .whl/humming-cache and come back as $OUT/humming-cache.tgz: carry that tarball as
# .whl/humming-cache.tgz, unpacked there when the folder is missing; the unpacked cache is ~73 MB,
# over a call's carry limit), PyTorch ~6 s. Humming runs with --isolate: a fault inside it (seen at
# Qwen3-like T=512) loses that point only.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-device-out}
mkdir -p "$OUT"
. bench/device/env.sh
TOKENS=${TOKENS:-1,8,32,128,512,2048,8192}
SHAPE_NAMES=${SHAPES:-DeepSeek-V3-like,Qwen3-30B-like,Mixtral-like}
DATE=$(date -u +%Y-%m-%d)
REC=$OUT/history-$DATE.jsonl
COMMIT=$(cat .devbin/COMMIT 2>/dev/null || echo unknown)
GPU=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -n 1)
what=" ${*:-megamoe humming torch table} "
has() { [[ $what == *" $1 "* ]]; }
start=$(date +%s)
echo "run_all: commit $COMMIT, $GPU, $DATE; parts:$what"

if has megamoe; then
  help=$(.devbin/megamoe bench --help)
  acts=(default)
  [[ $help == *--activations* ]] && acts=(bf16 nvfp4)
  for fmt in nvfp4 bf16; do
    for name in ${SHAPE_NAMES//,/ }; do
      dims=$(python3 -c "import sys; sys.path.insert(0, 'bench'); import records; print(*records.SHAPES['$name'])")
      set -- $dims
      for act in "${acts[@]}"; do
        [ "$fmt" = bf16 ] && [ "$act" = nvfp4 ] && continue
        aa=(); [ "$act" != default ] && [ "$fmt" = nvfp4 ] && aa=(--activations "$act")
        log=$OUT/megamoe.log
        if [[ $help == *--json* ]]; then
          timeout 300 .devbin/megamoe bench --backend cuda --format $fmt "${aa[@]}" --experts $1 --top-k $2 --hidden $3 \
            --inter $4 --tokens "$TOKENS" --iters "${ITERS:-10}" --json "$REC" 2>&1 | tee -a "$log"
        else # the text lines, turned into records (activations unknown to such a build: its only mode)
          timeout 300 .devbin/megamoe bench --backend cuda --format $fmt --experts $1 --top-k $2 --hidden $3 \
            --inter $4 --tokens "$TOKENS" --iters "${ITERS:-10}" 2>&1 | tee -a "$log" |
            python3 bench/records.py --commit "$COMMIT" --gpu "$GPU" --date "$DATE" /dev/stdin >> "$REC"
        fi
      done
    done
  done
  echo "run_all: megamoe done at $(($(date +%s) - start)) s"
fi

if has humming; then # humming_moe.py installs the carried wheel when humming is not installed
  # The JIT cache travels packed (unpacked it is over a call's carry limit).
  if [ ! -d .whl/humming-cache ] && [ -f .whl/humming-cache.tgz ]; then tar xzf .whl/humming-cache.tgz -C .whl; fi
  if ls .whl/humming_kernels-*.whl > /dev/null 2>&1 || python3 -c 'import humming' 2> /dev/null; then
    HUMMING_CACHE_DIR=$PWD/.whl/humming-cache timeout 540 python3 bench/peers/humming_moe.py --isolate --shapes "$SHAPE_NAMES" \
      --tokens "$TOKENS" --iters 20 --json "$REC" 2>&1 | tee "$OUT/humming.log"
    [ -d .whl/humming-cache ] && tar czf "$OUT/humming-cache.tgz" -C .whl humming-cache
  else
    echo "run_all: Humming not run: no .whl/humming_kernels-*.whl carried (see the usage above)"
  fi
  echo "run_all: humming done at $(($(date +%s) - start)) s"
fi

if has torch; then
  timeout 300 python3 bench/torch_baseline.py "$TOKENS" --formats bf16 --shapes "$SHAPE_NAMES" --json "$REC" \
    2>&1 | tee "$OUT/torch.log"
  echo "run_all: torch done at $(($(date +%s) - start)) s"
fi

if has table; then
  python3 bench/side_by_side.py "$REC" ${RECORDS:-} | tee "$OUT/table.md"
fi
