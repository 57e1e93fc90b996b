#!/usr/bin/env bash
# Here (the development machine, nvcc 13.0 like the GPU machine): builds the CUDA binaries and the CPU
# fuzz targets and stages them, with the shared libraries the GPU machine lacks, into .devbin/
# (git-ignored), which the device call carries. Then, there: bash bench/device/check.sh ... or
# bash bench/run_all.sh.
#   usage: bash bench/device/stage.sh
set -euo pipefail
cd "$(dirname "$0")/../.."
cmake -S . -B build-dev -DCMAKE_BUILD_TYPE=Release -DMEGAMOE_CUDA=ON >/dev/null
cmake --build build-dev -j "$(nproc)" >/dev/null
rm -rf .devbin && mkdir -p .devbin/libs
cp build-dev/megamoe build-dev/tests/test_gpu build-dev/tests/test_graph build-dev/tests/megamoe_soak .devbin/
for lib in libjansson.so.4 libcmocka.so.0 libgomp.so.1; do cp -L "/lib/x86_64-linux-gnu/$lib" .devbin/libs/; done
cp -L "$(ldd build-dev/megamoe | awk '/libcudart/ {print $3}')" .devbin/libs/
# NCCL (218 MB) does not travel: the GPU machine's PyTorch wheel holds the same 2.28.9 the binaries
# were built against; bench/device/env.sh puts its folder first on the loader path.
# The racecheck probe (dev/sm90_racecheck_probe.cu): check.sh reruns it beside racecheck, as the
# evidence for the kernels racecheck leaves out (env.sh).
nvcc -gencode=arch=compute_90a,code=sm_90a -std=c++17 -O3 -Iinclude -Isrc -Isrc/cuda \
  dev/sm90_racecheck_probe.cu -o .devbin/sm90_racecheck_probe
# The loader and forward fuzz targets (clang, libFuzzer + ASan + UBSan; the sanitizer runtimes are
# linked in, libjansson comes from .devbin/libs): check.sh's `fuzz` part runs them there on the CPU cores.
FUZZ_DIR=.devbin/fuzz FUZZ_BUILD_ONLY=1 bash tests/fuzz/run.sh 0 loader forward >/dev/null
# What was built, for the benchmark records (the GPU machine gets the tree without its git history).
echo "$(git rev-parse --short HEAD)$(git diff --quiet HEAD -- src include tools || echo -dirty)" > .devbin/COMMIT
# The binaries travel as one xz tarball (~11 MB instead of ~70; the carried folders must stay under
# 64 MiB): bench/device/env.sh, which every GPU-machine script sources, unpacks it in place once.
bins=(megamoe test_gpu test_graph megamoe_soak sm90_racecheck_probe fuzz)
tar -cf - -C .devbin "${bins[@]}" | xz -T2 -1 > .devbin/bins.tar.xz
(cd .devbin && rm -rf "${bins[@]}")
du -sh .devbin
