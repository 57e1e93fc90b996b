"""Helpers of the Python-package tests (test_binding.py, test_torch*.py, test_transformers.py).

The package is imported from python/ in the source tree and its C library from MEGAMOE_LIBRARY (the
CMake build's libmegamoe.so, set by ctest), so the tests need no `pip install`; with the variable unset
the installed package is used.
"""
import os
import sys

import numpy as np

import mmref as mr

if os.environ.get("MEGAMOE_LIBRARY"):
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "python"))


def spec3_activations(fmt):
    """Keyword arguments that give a layer SPEC §3's numerics (NVFP4 activations for NVFP4 weights), the
    ones tests/py/mmref.py computes."""
    return {"activations": "nvfp4"} if fmt == "nvfp4" else {}


def cli_activations(fmt):
    return ["--activations", "nvfp4"] if fmt == "nvfp4" else []


def cuda_gpu():
    """Whether torch sees a GPU and the library's CUDA backend can use it."""
    try:
        import torch
        import megamoe
    except ImportError:
        return False
    return torch.cuda.is_available() and megamoe.backend_available("cuda")


def torch_of(a):
    """numpy (ml_dtypes bf16 / e4m3 too) -> CPU torch tensor, same bytes."""
    import torch

    a = np.ascontiguousarray(a)
    if a.dtype == mr.BF16:
        return torch.from_numpy(a.view(np.uint16).copy()).view(torch.bfloat16)
    if a.dtype == mr.E4M3:
        return torch.from_numpy(a.view(np.uint8).copy()).view(torch.float8_e4m3fn)
    return torch.from_numpy(a.copy())


def numpy_of(t):
    """torch tensor -> numpy (bf16 as ml_dtypes bfloat16)."""
    import torch

    t = t.detach().cpu().contiguous()
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(mr.BF16)
    return t.numpy()


def module_weights(model):
    """(name, all-expert tensor) pairs of an mmref model, as a checkpoint offers them to load_weights."""
    m = model
    if m["format"] == "bf16":
        return [("w13_weight", torch_of(m["w13"])), ("w2_weight", torch_of(m["w2"]))]
    return [("w13_weight", torch_of(m["w13"])), ("w13_weight_scale", torch_of(m["w13_sf"].view(mr.E4M3))),
            ("w13_weight_scale_2", torch_of(m["w13_s2"])), ("w13_input_scale", torch_of(m["w13_in"])),
            ("w2_weight", torch_of(m["w2"])), ("w2_weight_scale", torch_of(m["w2_sf"].view(mr.E4M3))),
            ("w2_weight_scale_2", torch_of(m["w2_s2"])), ("w2_input_scale", torch_of(m["w2_in"]))]


class Norm:
    """A post-expert norm as the engine module passes it (weight, variance_epsilon, zero-centered gain)."""

    def __init__(self, weight, eps=1e-6, zero_centered=False, center=1.0):
        import torch

        self.weight = torch.nn.Parameter(torch_of(np.asarray(weight, dtype=np.float32)), requires_grad=False)
        self.variance_epsilon = eps
        self.zero_centered_gamma = zero_centered
        self.gain_center = center


def make_module(model, K, t_max, device="cpu", prefix="model.layers.0.mlp.experts", norm=True, **kw):
    """A finalized MegaMoEExperts of an mmref model; NVFP4 with SPEC §3's activations unless kw says."""
    from megamoe.torch import MegaMoEExperts

    E = model["E"]
    m = MegaMoEExperts(num_experts=E, num_local_experts=E, experts_start_idx=0, top_k=K, hidden_size=model["H"],
                       intermediate_size=model["I"],
                       post_expert_norm=Norm(model["norm"]) if norm and model["norm"] is not None else None,
                       num_max_tokens_per_rank=t_max, is_nvfp4=model["format"] == "nvfp4", prefix=prefix,
                       device=device, **{**spec3_activations(model["format"]), **kw})
    list(m.load_weights(module_weights(model)))
    m.finalize_weights()
    return m


def torch_inputs(x, ids, w, pad, device="cpu"):
    return (torch_of(x).to(device), torch_of(w).to(device), torch_of(ids).to(device),
            None if pad is None else torch_of(pad).to(device))


def cli_y(tmp_path, model, x, ids, w, pad, extra=(), activations=None):
    """y of `megamoe run` (the CPU backend) on the same layer and inputs."""
    if activations is not None:
        extra = ("--activations", activations, *extra)
    ckpt, inp, out = tmp_path / "cli_model.safetensors", tmp_path / "cli_in.safetensors", tmp_path / "cli_y.safetensors"
    mr.st_save(ckpt, mr.checkpoint_tensors(model, "", "stacked"))
    mr.write_inputs(inp, x, ids, w, pad)
    mr.run_cli("run", "--checkpoint", ckpt, "--input", inp, "--output", out,
               *(cli_activations(model["format"]) if activations is None else ()), *extra)
    return mr.st_load(out)["y"]


def same_bits(a, b):
    a, b = numpy_of(a) if not isinstance(a, np.ndarray) else a, numpy_of(b) if not isinstance(b, np.ndarray) else b
    return a.shape == b.shape and a.view(np.uint16).tobytes() == b.view(np.uint16).tobytes()
