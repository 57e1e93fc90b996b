"""Expert parallelism over NCCL on several GPUs of one machine (issue 4): `megamoe run --gpus N` against
the CUDA backend on one GPU, bitwise, and against the float64 reference of mmref.py, for N = 1, 2 and
4 and 8 where that many GPUs are visible. Skipped (shown as skipped by ctest) without two GPUs and a build with the NCCL backend; run on a machine with them:
    MEGAMOE_CLI=path/to/megamoe python3 -m pytest -q -rs tests/py/test_multi_gpu.py
"""
import shutil
import subprocess

import numpy as np
import pytest

import mmref as mr
from test_layer_reference import TOL, check_rows, tol_key

# The GPU's y against the float64 reference: the CPU backend's bounds (TOL), but BF16 at 1e-3 rather
# than 5e-4 -- tensor-core f32 accumulation differs from float64 a little more than the CPU's ordered
# f32 sums, and a = bf16_rn(...) turns a difference d into about sqrt(d * 2^-8) in y (measured 5.4e-4
# at H = I = 2048; docs/TESTING.md "Tolerances").
# W4A16 at 2e-3: BF16's arithmetic on the NVFP4 kernels' one tensor-core chain over K (test_gpu.c
# GPU_TOL_W4A16, from dev/accum_emulate.c: up to 9.9e-4 against the CPU at H = 7168).
TOL_GPU = {**TOL, "bf16": 1e-3, "w4a16": 2e-3}


def visible_gpus():
    if not shutil.which("nvidia-smi"):
        return 0
    p = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True)
    return sum(line.startswith("GPU ") for line in p.stdout.splitlines()) if p.returncode == 0 else 0


GPUS = visible_gpus()
pytestmark = pytest.mark.skipif(GPUS < 2, reason=f"no 2 GPUs here ({GPUS} visible): multi-GPU tests not run")


# Every expert-parallel width the machine allows (the shapes below have E divisible by 8).
GPU_COUNTS = tuple(n for n in (1, 2, 4, 8) if n <= max(GPUS, 2))


# The activation modes an NVFP4 model runs in on the device backends (SPEC §3b).
NVFP4_ACTIVATIONS = ("bf16", "nvfp4")


def run_all(tmp_path, model, x, ids, w, pad, gpu_counts=GPU_COUNTS):
    """y from the CUDA backend on one GPU and from --gpus N for each N; all must be bitwise equal (for an
    NVFP4 model in each activation mode)."""
    ckpt, inp = tmp_path / "model.safetensors", tmp_path / "inputs.safetensors"
    mr.st_save(ckpt, mr.checkpoint_tensors(model, "", "stacked"))
    mr.write_inputs(inp, x, ids, w, pad)
    for act in (NVFP4_ACTIVATIONS if model["format"] == "nvfp4" else ("bf16",)):
        out = tmp_path / "cuda.safetensors"
        mr.run_cli("run", "--checkpoint", ckpt, "--input", inp, "--output", out, "--backend", "cuda",
                   "--activations", act)
        y_ref = mr.st_load(out)["y"]
        for n in gpu_counts:
            out = tmp_path / f"gpus{n}.safetensors"
            mr.run_cli("run", "--checkpoint", ckpt, "--input", inp, "--output", out, "--gpus", n,
                       "--activations", act)
            y = mr.st_load(out)["y"]
            assert y.shape == x.shape
            assert y.view(np.uint16).tobytes() == y_ref.view(np.uint16).tobytes(), f"--gpus {n} differs from one GPU"
        check_rows(y_ref, x, ids, pad)
        ref = mr.reference_layer(model, x, ids, w, pad, gamma=model["norm"], activations=act)
        live = np.isfinite(ref).all(axis=1)
        err = mr.rel_l2(y_ref.astype(np.float64)[live], mr.bf16_round(ref[live]))
        tol = TOL_GPU[tol_key(model["format"], act)]
        assert err <= tol, f"relative L2 {err:.2e} over {tol} ({model['format']}, activations {act})"
    return y_ref


@pytest.mark.parametrize("fmt", ["nvfp4", "bf16"])
def test_uneven_tokens_edge_rows(tmp_path, fmt):
    # 37 tokens: 19 and 18 per GPU; NaN, padding, empty and duplicate slots in the first rows.
    E, K, H, I, T = 16, 4, 512, 256, 37
    model = mr.random_model(fmt, E, H, I, seed=21)
    x, ids, w, pad = mr.random_inputs(T, K, H, E, seed=22)
    mr.calibrate_a2(model, x, ids, pad)
    run_all(tmp_path, model, x, ids, w, pad)


@pytest.mark.parametrize("fmt", ["nvfp4", "bf16"])
def test_a_rank_with_no_tokens(tmp_path, fmt):
    # One token: the first GPU gets it, the second none (its experts still serve the first's slots).
    E, K, H, I, T = 16, 8, 256, 512, 1
    model = mr.random_model(fmt, E, H, I, seed=31)
    x, ids, w, pad = mr.random_inputs(T, K, H, E, seed=32, edge_cases=False)
    mr.calibrate_a2(model, x, ids, pad)
    run_all(tmp_path, model, x, ids, w, pad)


@pytest.mark.parametrize("fmt", ["nvfp4", "bf16"])
def test_all_tokens_on_one_ranks_experts(tmp_path, fmt):
    # Every slot goes to the experts of the second GPU: the first GPU's experts get nothing.
    E, K, H, I, T = 16, 4, 512, 256, 300
    model = mr.random_model(fmt, E, H, I, seed=41)
    x, ids, w, pad = mr.random_inputs(T, K, H, E, seed=42, edge_cases=False)
    rng = np.random.default_rng(43)
    ids = np.stack([E // 2 + rng.permutation(E // 2)[:K] for _ in range(T)]).astype(np.int32)
    mr.calibrate_a2(model, x, ids, pad)
    run_all(tmp_path, model, x, ids, w, pad)


def test_large_shape_split_k(tmp_path):
    # H and I of the DeepSeek-V3 shape with few tokens: the split-K plan must not depend on the GPUs.
    E, K, H, I, T = 8, 8, 7168, 2048, 6
    model = mr.random_model("nvfp4", E, H, I, seed=51, with_norm=True)
    x, ids, w, pad = mr.random_inputs(T, K, H, E, seed=52, edge_cases=False)
    mr.calibrate_a2(model, x, ids, pad)
    run_all(tmp_path, model, x, ids, w, pad)


@pytest.mark.parametrize("fmt", ["nvfp4", "bf16"])
def test_prefill_gathered(tmp_path, fmt):
    # ~1200 slots per GPU, 300 per expert: every rank gathers its gate/up input (more than
    # MM_GATHER_MIN_SLOTS), and H = I = 2048 puts both phases on the warp-specialized kernel with its
    # token tiles by TMA; y must still be bitwise the one GPU's.
    E, K, H, I, T = 8, 2, 2048, 2048, 1200
    model = mr.random_model(fmt, E, H, I, seed=61)
    x, ids, w, pad = mr.random_inputs(T, K, H, E, seed=62)
    mr.calibrate_a2(model, x, ids, pad)
    run_all(tmp_path, model, x, ids, w, pad, gpu_counts=(2,))
