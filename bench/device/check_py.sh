#!/usr/bin/env bash
# The Python package on the GPU machine (issue 22), after bench/device/stage_py.sh here (carry .devpy):
#   bash bench/device/check_py.sh [tests|bench|all]      (default all; each part alone fits a 10-minute call)
# installs the staged wheel into a folder of its own (as `pip install .` would, with no build there),
# runs the package's tests against it (CPU and GPU: the op, opcheck, torch.compile, CUDA graphs, the
# module, R ranks on one GPU, the transformers swap, and the torchrun tests when there are two GPUs),
# then the binding's benchmark and the transformers example. Logs go to $OUT when it is set.
set -uo pipefail
cd "$(dirname "$0")/../.."
OUTDIR=${OUT:-/tmp/megamoe-gpu-check}
mkdir -p "$OUTDIR"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export PYTHONDONTWRITEBYTECODE=1
SITE=/tmp/megamoe-site
rm -rf "$SITE"
python3 -m pip install -q --no-deps --no-index --disable-pip-version-check --target "$SITE" .devpy/megamoe-*.whl || exit 1
NCCL_DIR=$(python3 -c 'import nvidia.nccl, os; print(os.path.join(list(nvidia.nccl.__path__)[0], "lib"))' 2>/dev/null)
export PYTHONPATH=$SITE LD_LIBRARY_PATH=$PWD/.devpy/libs:${NCCL_DIR}:${LD_LIBRARY_PATH:-}
export MEGAMOE_CLI=$PWD/.devpy/megamoe MEGAMOE_TESTHOOKS=$PWD/.devpy/libmegamoe_testhooks.so
unset MEGAMOE_LIBRARY
what=${1:-all}
nvidia-smi -L
python3 -c 'import megamoe, torch, transformers; print("megamoe", megamoe.__version__, megamoe.__file__, "cuda", megamoe.backend_available("cuda"), "nccl", megamoe.backend_available("nccl"), "torch", torch.__version__, "transformers", transformers.__version__)'
rc=0
if [ "$what" != bench ]; then
  python3 -m pytest -q -rs -s -p no:cacheprovider tests/py/test_binding.py tests/py/test_torch_gpu.py \
    tests/py/test_transformers.py tests/py/test_torch_multi_gpu.py tests/py/test_torch.py \
    -k "not test_compile_fullgraph_cpu" 2>&1 | tee "$OUTDIR/pytest.log"
  rc=${PIPESTATUS[0]}
fi
[ "$what" = tests ] && exit "$rc"
python3 examples/transformers_swap.py --device cuda 2>&1 | tee "$OUTDIR/transformers_swap.log"
python3 examples/transformers_swap.py --device cuda --model qwen3_moe --activations nvfp4 2>&1 | tee -a "$OUTDIR/transformers_swap.log"
python3 examples/bench_op.py 2>&1 | tee "$OUTDIR/bench_op.log"
python3 examples/bench_op.py --format bf16 --tokens 1,128 2>&1 | tee -a "$OUTDIR/bench_op.log"
# Each call timed alone on an idle GPU: the rows where the GPU's time per forward exceeds the host's
# (BF16 T = 1, NVFP4 T = 128) without the backlog of launches that builds within a back-to-back round.
python3 examples/bench_op.py --idle --tokens 1,8,128 2>&1 | tee -a "$OUTDIR/bench_op.log"
python3 examples/bench_op.py --idle --format bf16 --tokens 1,128 2>&1 | tee -a "$OUTDIR/bench_op.log"
# The same Python on this host's CPU backend (T = 0): beside the development machine's figure in
# docs/PYTHON.md, how much slower this host runs the binding's Python.
python3 examples/bench_op.py --device cpu 2>&1 | tee -a "$OUTDIR/bench_op.log"
exit "$rc"
