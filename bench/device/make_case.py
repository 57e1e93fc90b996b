#!/usr/bin/env python3
"""A random NVFP4 experts layer and token inputs as safetensors files, with numpy alone (the GPU
machine's Python may lack safetensors and ml_dtypes), for `megamoe run`: variant.sh's `bitwise` part
runs two builds on them and compares y byte for byte.

    usage: make_case.py FOLDER E K H I T [T ...]
writes FOLDER/model.safetensors (the stacked naming of SPEC §6: w13_weight, w13_weight_scale, ...)
and FOLDER/in_T.safetensors per T (hidden_states BF16 over 2.5 decades of token scale, distinct
experts per token, negative routing weights too). Seeded: the same files every time.
"""
import json
import os
import sys

import numpy as np


def save(path, tensors):
    """{name: (safetensors dtype, numpy array whose bytes are the values)} -> a safetensors file."""
    header, blobs, off = {}, [], 0
    for name, (dtype, a) in tensors.items():
        b = np.ascontiguousarray(a).tobytes()
        header[name] = {"dtype": dtype, "shape": list(a.shape), "data_offsets": [off, off + len(b)]}
        blobs.append(b)
        off += len(b)
    h = json.dumps(header, separators=(",", ":")).encode()
    h += b" " * (-len(h) % 8)
    with open(path, "wb") as f:
        f.write(len(h).to_bytes(8, "little") + h)
        for b in blobs:
            f.write(b)


def bf16_bits(x):
    """float32 -> bfloat16 bits, round to nearest even (finite inputs)."""
    u = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32).astype(np.uint64)
    return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)


def main():
    folder, (E, K, H, I), Ts = sys.argv[1], map(int, sys.argv[2:6]), [int(t) for t in sys.argv[6:]]
    os.makedirs(folder, exist_ok=True)
    rng = np.random.default_rng(23)
    f32 = np.float32
    save(os.path.join(folder, "model.safetensors"), {
        "w13_weight": ("U8", rng.integers(0, 256, (E, 2 * I, H // 2), dtype=np.uint8)),
        "w2_weight": ("U8", rng.integers(0, 256, (E, H, I // 2), dtype=np.uint8)),
        # E4M3 block scales from subnormal to normal values (bytes 0x01..0x57)
        "w13_weight_scale": ("F8_E4M3", rng.integers(0x01, 0x58, (E, 2 * I, H // 16), dtype=np.uint8)),
        "w2_weight_scale": ("F8_E4M3", rng.integers(0x01, 0x58, (E, H, I // 16), dtype=np.uint8)),
        "w13_weight_scale_2": ("F32", (rng.uniform(0.5, 1.5, (E, 2)) / (4 * np.sqrt(H))).astype(f32)),
        "w13_input_scale": ("F32", np.full((E, 2), 1 / 2688, dtype=f32)),
        "w2_weight_scale_2": ("F32", (rng.uniform(0.5, 1.5, E) / (4 * np.sqrt(I))).astype(f32)),
        "w2_input_scale": ("F32", np.full(E, 0.05, dtype=f32)),
        "post_expert_norm.weight": ("F32", (1 + 0.2 * rng.standard_normal(H)).astype(f32)),
    })
    for T in Ts:
        x = rng.standard_normal((T, H)).astype(f32) * np.exp(rng.uniform(-3, 3, (T, 1))).astype(f32)
        ids = np.stack([rng.permutation(E)[:K] for _ in range(T)]).astype(np.int32)
        w = rng.standard_normal((T, K)).astype(f32)
        save(os.path.join(folder, f"in_{T}.safetensors"),
             {"hidden_states": ("BF16", bf16_bits(x)), "topk_ids": ("I32", ids), "topk_weights": ("F32", w)})


if __name__ == "__main__":
    main()
