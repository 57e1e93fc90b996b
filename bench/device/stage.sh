#!/usr/bin/env bash
# Here (the development machine, nvcc 13.0 like the GPU machine): builds the CUDA binaries and stages
# them, with the shared libraries the GPU machine lacks, into .devbin/ (git-ignored), which the device
# call carries. Then, there: bash bench/device/check.sh ... or bash bench/run_all.sh.
#   usage: bash bench/device/stage.sh
set -euo pipefail
cd "$(dirname "$0")/../.."
cmake -S . -B build-dev -DCMAKE_BUILD_TYPE=Release -DMEGAMOE_CUDA=ON >/dev/null
cmake --build build-dev -j "$(nproc)" >/dev/null
rm -rf .devbin && mkdir -p .devbin/libs
cp build-dev/megamoe build-dev/tests/test_gpu .devbin/
for lib in libjansson.so.4 libcmocka.so.0 libgomp.so.1; do cp -L "/lib/x86_64-linux-gnu/$lib" .devbin/libs/; done
cp -L "$(ldd build-dev/megamoe | awk '/libcudart/ {print $3}')" .devbin/libs/
# NCCL (218 MB) does not travel: the GPU machine's PyTorch wheel holds the same 2.28.9 the binaries
# were built against; bench/device/env.sh puts its folder first on the loader path.
# The racecheck probe (dev/sm90_racecheck_probe.cu): check.sh reruns it beside racecheck, as the
# evidence for the kernels racecheck leaves out (env.sh).
nvcc -gencode=arch=compute_90a,code=sm_90a -std=c++17 -O3 -Iinclude -Isrc -Isrc/cuda \
  dev/sm90_racecheck_probe.cu -o .devbin/sm90_racecheck_probe
# What was built, for the benchmark records (the GPU machine gets the tree without its git history).
echo "$(git rev-parse --short HEAD)$(git diff --quiet HEAD -- src include tools || echo -dirty)" > .devbin/COMMIT
du -sh .devbin
