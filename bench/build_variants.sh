#!/usr/bin/env bash
# Builds the CLI (and with TESTS=1 the GPU test binary) once per variant, as .devbin/megamoe_<name>
# (.devbin/test_gpu_<name>), to compare variants in one device call (after bench/stage_device.sh,
# which stages .devbin/). A variant is compile-time flags on this checkout, or flags on another
# commit or branch (built from a temporary git worktree). Build folders build-var-<name>/ are ignored.
#   usage: [TESTS=1] bash bench/build_variants.sh "name[@REV]=FLAGS" ...
#   e.g.   bash bench/build_variants.sh "b5s6=-DMM_STREAM_BLOCKS_PER_SM=5 -DST_STAGES=6" "n128@wip/wgmma-n128="
# then on the GPU machine, per name: .devbin/megamoe_<name> bench --backend cuda ...
# The flags go to the C compiler too (MM_GATHER in src/internal.h). Knobs on main: MM_STREAM_BLOCKS_PER_SM, MM_STREAM_TARGET_ITEMS, MM_WS_GROUP, MM_WS_MIN_TOKENS (src/cuda/gemm_plan.h), WS_LAG (sm90_expert_ws.cu), ST_STAGES
# (src/cuda/sm90_expert_stream.cu).
set -euo pipefail
cd "$(dirname "$0")/.."
root=$PWD
[ -d .devbin ] || { echo "run bench/stage_device.sh first" >&2; exit 2; }
for spec in "$@"; do
  name=${spec%%=*} flags=${spec#*=} rev=
  if [[ $name == *@* ]]; then rev=${name#*@} name=${name%%@*}; fi
  src=$root
  if [ -n "$rev" ]; then
    src=$(mktemp -d)/src
    git worktree add -q --detach "$src" "$rev"
    trap 'git -C "$root" worktree remove --force "$src"' EXIT
  fi
  rm -rf "$root/build-var-$name" # its cache names the source folder, new for each worktree
  cmake -S "$src" -B "$root/build-var-$name" -DCMAKE_BUILD_TYPE=Release -DMEGAMOE_CUDA=ON -DCMAKE_CUDA_FLAGS="$flags" -DCMAKE_C_FLAGS="$flags" >/dev/null
  targets=(megamoe_cli); [ "${TESTS:-0}" = 1 ] && targets+=(test_gpu)
  cmake --build "$root/build-var-$name" -j "$(nproc)" --target "${targets[@]}" >/dev/null
  cp "$root/build-var-$name/megamoe" ".devbin/megamoe_$name"
  [ "${TESTS:-0}" = 1 ] && cp "$root/build-var-$name/tests/test_gpu" ".devbin/test_gpu_$name"
  if [ -n "$rev" ]; then git worktree remove --force "$src"; trap - EXIT; fi
  echo "built .devbin/megamoe_$name (${rev:-this checkout} $flags)"
done
du -sh .devbin
