#!/usr/bin/env bash
# Builds the CLI once per set of compile-time flags, as .devbin/megamoe_<name>, to compare variants of
# a kernel in one device call (after bench/stage_device.sh, which stages .devbin/). Each build has its
# own folder build-var-<name>/ (ignored by git).
#   usage: bash bench/build_variants.sh "name=FLAGS" ...
#   e.g.   bash bench/build_variants.sh "b5s6=-DMM_STREAM_BLOCKS_PER_SM=5 -DST_STAGES=6" "i8=-DMM_STREAM_ITEMS_PER_BLOCK=8"
# then on the GPU machine, for each name: .devbin/megamoe_<name> bench --backend cuda ...
# Knobs: MM_STREAM_BLOCKS_PER_SM, MM_STREAM_ITEMS_PER_BLOCK (src/cuda/gemm_plan.h), ST_STAGES
# (src/cuda/sm90_expert_stream.cu); any macro a source file leaves overridable.
set -euo pipefail
cd "$(dirname "$0")/.."
[ -d .devbin ] || { echo "run bench/stage_device.sh first" >&2; exit 2; }
for spec in "$@"; do
  name=${spec%%=*} flags=${spec#*=}
  cmake -S . -B "build-var-$name" -DCMAKE_BUILD_TYPE=Release -DMEGAMOE_CUDA=ON -DCMAKE_CUDA_FLAGS="$flags" >/dev/null
  cmake --build "build-var-$name" -j "$(nproc)" --target megamoe_cli >/dev/null
  cp "build-var-$name/megamoe" ".devbin/megamoe_$name"
  echo "built .devbin/megamoe_$name ($flags)"
done
du -sh .devbin
