#!/usr/bin/env bash
# Compresses .devbin/ (after bench/stage_device.sh and bench/build_variants.sh) into
# .devpack/devbin.tar.xz, about a tenth of its size, so many builds fit the device tool's 64 MB carry
# (carry .devpack; on the GPU machine: tar xJf .devpack/devbin.tar.xz).
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p .devpack
tar cf - .devbin | xz -T0 -6 > .devpack/devbin.tar.xz
du -sh .devbin .devpack/devbin.tar.xz
