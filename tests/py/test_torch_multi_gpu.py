"""Expert parallelism from PyTorch (issue 22): torchrun, one process per GPU, MegaMoEExperts over the
world process group (the NCCL communicator built from it), y on every rank bitwise equal to one GPU
running all tokens, eager and in a CUDA graph. Skipped (shown as skipped by ctest) without two GPUs and
a build with the NCCL backend. On the GPU machine:
    MEGAMOE_LIBRARY=.../libmegamoe.so python3 -m pytest -rs tests/py/test_torch_multi_gpu.py
"""
import os
import subprocess
import sys

import pytest

torch = pytest.importorskip("torch")

import torchutil  # noqa: E402,F401  (puts python/ on the path when MEGAMOE_LIBRARY is set)
import megamoe  # noqa: E402

GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0
pytestmark = pytest.mark.skipif(
    GPUS < 2 or not megamoe.backend_available("nccl"),
    reason=f"no 2 GPUs with the NCCL backend here ({GPUS} visible): torch multi-GPU tests not run")


@pytest.mark.parametrize("fmt", ["nvfp4", "bf16"])
@pytest.mark.parametrize("n", [n for n in (2, 4, 8) if n <= max(GPUS, 2)])
def test_torchrun_expert_parallel(tmp_path, fmt, n):
    out = tmp_path / "result.txt"
    worker = os.path.join(os.path.dirname(__file__), "torch_ep_worker.py")
    env = dict(os.environ, NCCL_NVLS_ENABLE="0", TORCH_SYMM_MEM_DISABLE_MULTICAST="1")
    p = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={n}",
                        worker, str(out), fmt], capture_output=True, text=True, timeout=600, env=env)
    assert p.returncode == 0, f"torchrun failed ({p.returncode}):\n{p.stdout[-4000:]}\n{p.stderr[-4000:]}"
    result = out.read_text()
    print(result)
    assert "bitwise_equal_one_gpu=True" in result and "graph_equal_eager=True" in result, result
