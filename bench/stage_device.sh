#!/usr/bin/env bash
# Builds the CUDA binaries here (nvcc 13.0 here and on the GPU machine) and stages them with the
# shared libraries the GPU machine lacks into .devbin/, to be carried to it (device tool: carry .devbin).
set -euo pipefail
cd "$(dirname "$0")/.."
cmake -S . -B build-dev -DCMAKE_BUILD_TYPE=Release -DMEGAMOE_CUDA=ON >/dev/null
cmake --build build-dev -j "$(nproc)" >/dev/null
rm -rf .devbin && mkdir -p .devbin/libs
cp build-dev/megamoe build-dev/tests/test_gpu .devbin/
for lib in libjansson.so.4 libcmocka.so.0 libgomp.so.1; do cp -L "/lib/x86_64-linux-gnu/$lib" .devbin/libs/; done
cp -L "$(ldd build-dev/megamoe | awk '/libcudart/ {print $3}')" .devbin/libs/
# NCCL (218 MB) does not travel: the GPU machine's PyTorch wheel holds the same 2.28.9 the binaries
# were built against (DEVICE.md); the device scripts put its folder first on the loader path.
cp bench/device_check.sh .devbin/
# The experiments of dev/ that are waiting for a GPU run (device_check.sh dev runs them).
for probe in sm90_stream_probe sm90_decode_gemm sm90_racecheck_probe sm90_bf16_gemm_probe sm90_fp4_ws_gemm_probe sm90_bf16_gather_probe sm90_accum_probe; do
  nvcc -gencode=arch=compute_90a,code=sm_90a -std=c++17 -O3 -Iinclude -Isrc -Isrc/cuda "dev/$probe.cu" -o ".devbin/$probe"
done
du -sh .devbin
