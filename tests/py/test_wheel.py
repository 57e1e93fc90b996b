"""`pip install .` (issue 22): builds the wheel from the repository (CPU-only, to keep the test short:
the same CMake build with MEGAMOE_CUDA=OFF), checks its tag (py3-none-<platform>: one wheel for every
Python 3 and torch), installs it into a folder of its own and runs it there with MEGAMOE_LIBRARY unset:
the C library and the shared libraries it carries load from inside the package."""
import glob
import os
import subprocess
import sys
import zipfile

import pytest

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))

pytest.importorskip("scikit_build_core", reason="scikit-build-core is not installed: wheel test not run")

SNIPPET = r"""
import megamoe, megamoe._capi as c, os
assert os.path.dirname(c.library_path()) == os.path.dirname(megamoe.__file__), c.library_path()
print("version", megamoe.__version__)
g = megamoe.Group("cpu")
layer = megamoe.Layer(g, num_experts=8, top_k=2, hidden_size=256, intermediate_size=256, max_tokens=4, format="bf16")
print("buffer", layer.memory()["buffer_bytes"])
try:
    import torch
except ImportError:
    torch = None
if torch is not None:
    from megamoe.torch import MegaMoEExperts
    m = MegaMoEExperts(num_experts=8, num_local_experts=8, experts_start_idx=0, top_k=2, hidden_size=256,
                       intermediate_size=256, num_max_tokens_per_rank=4, is_nvfp4=False, device="cpu")
    torch.manual_seed(0)
    list(m.load_weights([("w13_weight", torch.randn(8, 512, 256).bfloat16() / 16),
                         ("w2_weight", torch.randn(8, 256, 256).bfloat16() / 16)]))
    m.finalize_weights()
    y = m(torch.randn(4, 256).bfloat16(), torch.rand(4, 2), torch.randint(0, 8, (4, 2)))
    assert y.shape == (4, 256) and y.float().abs().sum() > 0
    print("torch ok")
"""


def test_pip_install_dot(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "MEGAMOE_LIBRARY"}
    wheels, target = tmp_path / "wheels", tmp_path / "site"
    p = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
                        "--disable-pip-version-check", "-w", str(wheels), ROOT,
                        "--config-settings=cmake.define.MEGAMOE_CUDA=OFF",
                        f"--config-settings=build-dir={tmp_path / 'build'}"],
                       capture_output=True, text=True, env=env, timeout=1200)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    (whl,) = glob.glob(str(wheels / "megamoe-*.whl"))
    assert "-py3-none-" in os.path.basename(whl), whl
    with zipfile.ZipFile(whl) as z:
        names = z.namelist()
    assert "megamoe/libmegamoe.so" in names and "megamoe/torch/_op.py" in names
    assert "megamoe/megamoe_build.json" in names  # the NCCL version the package checks at import
    p = subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "--disable-pip-version-check",
                        "--target", str(target), whl], capture_output=True, text=True, env=env)
    assert p.returncode == 0, p.stderr
    env["PYTHONPATH"] = str(target)
    p = subprocess.run([sys.executable, "-c", SNIPPET], capture_output=True, text=True, env=env, cwd=tmp_path)
    assert p.returncode == 0, p.stdout + p.stderr
    print(p.stdout)
    assert "version " in p.stdout and "buffer " in p.stdout
