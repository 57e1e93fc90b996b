#!/usr/bin/env bash
# Installs what megamoe builds and tests with, from Debian's packages and PyPI (see README):
#   jansson (JSON), cmocka (C tests), pkg-config, cmake; clang for the fuzzer;
#   a Python venv in .venv with numpy, ml_dtypes, safetensors and pytest for the reference tests,
#   and torch, transformers and scikit-build-core for the Python package's tests.
# Safe to run again: it only installs what is missing.
set -euo pipefail
cd "$(dirname "$0")/.."

debs=(cmake pkg-config make gcc libjansson-dev libcmocka-dev clang libclang-rt-dev python3-venv)
missing=()
for p in "${debs[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if ((${#missing[@]})); then
  echo "install-deps: apt-get install ${missing[*]}"
  SUDO=""; [ "$(id -u)" -eq 0 ] || SUDO="sudo"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${missing[@]}" >/dev/null
fi

PY=${PYTHON:-python3}
if ! .venv/bin/python -c "import numpy, ml_dtypes, safetensors, pytest" 2>/dev/null; then
  echo "install-deps: creating .venv (numpy, ml_dtypes, safetensors, pytest)"
  "$PY" -m venv .venv
  .venv/bin/python -m pip install -q --disable-pip-version-check -r tests/py/requirements.txt
fi
if ! .venv/bin/python -c "import torch, transformers, scikit_build_core" 2>/dev/null; then
  echo "install-deps: torch, transformers, scikit-build-core into .venv (the Python package's tests)"
  .venv/bin/python -m pip install -q --disable-pip-version-check -r tests/py/requirements-torch.txt
fi
echo "install-deps: ok"
