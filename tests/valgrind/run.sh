#!/usr/bin/env bash
# `make valgrind`: the CLI's inspect, run (NVFP4 and BF16, 1 and 2 ranks) and quantize on the CPU
# under valgrind's memcheck, with tests/valgrind/libgomp.supp for the OpenMP runtime's thread cache.
# Any error or leak (definite, indirect, possible) fails it. $1: the CLI (a CPU build).
set -euo pipefail
cd "$(dirname "$0")/../.."
cli=${1:?usage: run.sh PATH/TO/megamoe}
py=${PYTHON:-.venv/bin/python}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
"$py" tests/valgrind/make_inputs.py "$work"
vg=(valgrind --quiet --error-exitcode=99 --leak-check=full --show-leak-kinds=all
    --errors-for-leak-kinds=definite,indirect,possible --track-origins=yes
    --suppressions=tests/valgrind/libgomp.supp)
runs=(
  "inspect $work/nvfp4.safetensors --tensors"
  "run --checkpoint $work/nvfp4.safetensors --input $work/in.safetensors --output $work/y1.safetensors --threads 2"
  "run --checkpoint $work/nvfp4.safetensors --input $work/in.safetensors --output $work/y2.safetensors --ranks 2 --threads 2"
  "run --checkpoint $work/bf16.safetensors --input $work/in.safetensors --output $work/y3.safetensors --threads 2"
  "quantize $work/bf16.safetensors $work/q.safetensors --calib-tokens 4"
  "run --checkpoint $work/q.safetensors --input $work/in.safetensors --output $work/y4.safetensors --threads 2"
  "run --checkpoint $work/nvfp4.safetensors --input $work/nvfp4.safetensors --output $work/y5.safetensors"
)
n=0
for r in "${runs[@]}"; do
  set +e
  # shellcheck disable=SC2086
  "${vg[@]}" "$cli" $r >"$work/out.txt" 2>&1
  rc=$?
  set -e
  # the last run is an error path on purpose (an inputs file without hidden_states): exit 1, no errors
  want=0
  [[ $r == *"--input $work/nvfp4.safetensors"* ]] && want=1
  if [ $rc -ne $want ]; then
    cat "$work/out.txt"
    echo "valgrind: megamoe $r: exit $rc (expected $want; 99 = valgrind errors)"
    exit 1
  fi
  n=$((n + 1))
done
echo "valgrind: $n CLI runs (inspect, run, quantize; an error path), 0 errors, 0 leaks"
