"""Writes the small checkpoints and inputs `make valgrind` runs the CLI on: an NVFP4 layer (per expert),
a BF16 layer (stacked) and an inputs file, from tests/py/mmref.py's seeded random models."""
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "py"))
import mmref as mr  # noqa: E402

out = sys.argv[1]
os.makedirs(out, exist_ok=True)
E, K, H, I, T = 4, 2, 256, 256, 8
nv = mr.random_model("nvfp4", E, H, I, seed=61)
x, ids, w, pad = mr.random_inputs(T, K, H, E, seed=62)
mr.calibrate_a2(nv, x, ids, pad)
mr.st_save(os.path.join(out, "nvfp4.safetensors"), mr.checkpoint_tensors(nv, "layer", "per_expert"))
bf = mr.random_model("bf16", E, H, I, seed=63)
mr.st_save(os.path.join(out, "bf16.safetensors"), mr.checkpoint_tensors(bf, "layer", "stacked"))
mr.write_inputs(os.path.join(out, "in.safetensors"), x, ids, w, pad)
