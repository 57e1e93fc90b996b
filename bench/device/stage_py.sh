#!/usr/bin/env bash
# Stages the Python package's GPU run into .devpy/ (carried to the GPU machine; see bench/device/check_py.sh):
# the CUDA wheel as `pip install .` builds it (CUDA backend, static CUDA runtime, jansson and libgomp
# inside), and the megamoe CLI that the tests use as their second opinion, with the shared libraries the
# GPU machine lacks. NCCL does not travel: the GPU machine's torch brings it (nvidia-nccl).
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=${PYTHON:-.venv/bin/python}
rm -rf .devpy && mkdir -p .devpy/libs
"$PY" -m pip wheel -q --no-deps --disable-pip-version-check -w .devpy .
cmake -S . -B build-pydev -DCMAKE_BUILD_TYPE=Release -DMEGAMOE_CUDA=ON >/dev/null
cmake --build build-pydev -j "$(nproc)" --target megamoe_cli megamoe_testhooks >/dev/null
cp build-pydev/megamoe build-pydev/tests/libmegamoe_testhooks.so .devpy/
for lib in libjansson.so.4 libgomp.so.1; do cp -L "/lib/x86_64-linux-gnu/$lib" .devpy/libs/; done
cp -L "$(ldd build-pydev/megamoe | awk '/libcudart/ {print $3}')" .devpy/libs/
ls -la .devpy && du -sh .devpy
