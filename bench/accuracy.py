"""How far each implementation's y is from the model: relative L2 against a float64 computation of the
unquantized BF16 layer, on the same random BF16 weights and inputs.

  python3 bench/accuracy.py [--cli .devbin/megamoe] [--backend cuda] [--shapes Qwen3-30B-like,Mixtral-like]
                            [--tokens 64] [--std 0.02] [--seed 0] [--work DIR] [--json FILE] [--no-humming]

Per shape: random BF16 expert weights N(0, std²) are written as a stacked checkpoint; `megamoe quantize`
turns them into NVFP4 (per-expert ModelOpt naming); `megamoe run` computes y from the BF16 checkpoint,
and from the NVFP4 one with each `--activations` mode the CLI offers (without the flag: the build's one
NVFP4 numerics); Humming (bench/peers/humming_moe.py, NVFP4 weights, BF16 activations) runs the same
NVFP4 checkpoint. No post-expert norm. The reference: y = Σ_k w_k · W2_e (silu(W1_e x) · W3_e x) in
float64 from the BF16 weights. Also printed: the NVFP4 checkpoint computed exactly with BF16 activations
(float64; the floor of any W4A16 implementation of it). The target (issue 23): NVFP4 with BF16 activations no further from the
model than Humming. Runs on the CPU backend too (`--backend cpu`, small shapes: `--shapes tiny`).
Needs numpy; Humming needs torch and humming-kernels, installed or as the wheel in .whl/ (skipped, and
said so, without them).
"""
import argparse
import json
import os
import struct
import subprocess
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import records as R  # noqa: E402

SHAPES = dict(R.SHAPES, tiny=(8, 2, 256, 256))

# ---- safetensors, just what this script needs (bf16 kept as raw uint16) ----------------------------
_DT = {"BF16": np.uint16, "F32": np.float32, "I32": np.int32, "U8": np.uint8, "F8_E4M3": np.uint8,
       "BOOL": np.bool_}


def st_write(path, tensors):
    """tensors: name -> (dtype name, numpy array)."""
    header, off, blobs = {}, 0, []
    for name, (dt, a) in tensors.items():
        b = np.ascontiguousarray(a).tobytes()
        header[name] = {"dtype": dt, "shape": list(a.shape), "data_offsets": [off, off + len(b)]}
        off += len(b)
        blobs.append(b)
    h = json.dumps(header).encode()
    h += b" " * (-len(h) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(h)) + h)
        for b in blobs:
            f.write(b)


def st_read(path):
    """name -> (dtype name, numpy array) for every tensor of a file or of a folder with an index."""
    if os.path.isdir(path):
        with open(os.path.join(path, "model.safetensors.index.json")) as f:
            files = sorted(set(json.load(f)["weight_map"].values()))
        out = {}
        for fn in files:
            out.update(st_read(os.path.join(path, fn)))
        return out
    with open(path, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        header = json.loads(f.read(n))
        data = f.read()
    out = {}
    for name, m in header.items():
        if name == "__metadata__":
            continue
        a, b = m["data_offsets"]
        out[name] = (m["dtype"], np.frombuffer(data[a:b], dtype=_DT[m["dtype"]]).reshape(m["shape"]))
    return out


def bf16_from_f32(a):
    """Round to nearest even, as uint16 bf16 bits."""
    u = np.ascontiguousarray(a, dtype=np.float32).view(np.uint32)
    return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)


def f64_from_bf16(u):
    return (u.astype(np.uint32) << 16).view(np.float32).astype(np.float64)


# ---- the layer ------------------------------------------------------------------------------------
def make_case(E, K, H, I, T, std, seed):
    rng = np.random.default_rng(seed)
    w13 = np.empty((E, 2 * I, H), np.uint16)
    w2 = np.empty((E, H, I), np.uint16)
    for e in range(E):  # one expert at a time: f32 randoms of the largest shape stay small
        w13[e] = bf16_from_f32(rng.standard_normal((2 * I, H), dtype=np.float32) * std)
        w2[e] = bf16_from_f32(rng.standard_normal((H, I), dtype=np.float32) * std)
    x = bf16_from_f32(rng.standard_normal((T, H), dtype=np.float32))
    ids = np.stack([rng.choice(E, K, replace=False) for _ in range(T)]).astype(np.int32)
    lg = rng.standard_normal((T, K))
    w = (np.exp(lg) / np.exp(lg).sum(1, keepdims=True)).astype(np.float32)
    return w13, w2, x, ids, w


def reference(w13, w2, x, ids, w):
    """float64 y [T, H] of the unquantized BF16 layer (no clamp, no norm)."""
    T, K = ids.shape
    I = w2.shape[2]
    xf = f64_from_bf16(x)
    y = np.zeros((T, w2.shape[1]))
    for e in np.unique(ids):
        rows, slots = np.nonzero(ids == e)
        gu = xf[rows] @ f64_from_bf16(w13[e]).T
        g, u = gu[:, :I], gu[:, I:]
        a = g / (1 + np.exp(-g)) * u
        y[rows] += w[rows, slots, None].astype(np.float64) * (a @ f64_from_bf16(w2[e]).T)
    return y


def rel_l2(y, ref):
    return float(np.linalg.norm(y - ref) / np.linalg.norm(ref))


def stacked_nvfp4(ck, prefix, E):
    """The quantized per-expert tensors as ModelOpt stacked arrays (w13 rows: gate then up)."""
    def get(e, proj, field):
        for p in ((proj,) + {"gate_proj": ("w1",), "up_proj": ("w3",), "down_proj": ("w2",)}[proj]):
            key = f"{prefix}.experts.{e}.{p}.{field}"
            if key in ck:
                return ck[key][1]
        raise KeyError(f"{prefix}.experts.{e}.{proj}.{field} not in the quantized checkpoint")

    w13 = np.stack([np.concatenate([get(e, "gate_proj", "weight"), get(e, "up_proj", "weight")]) for e in range(E)])
    s13 = np.stack([np.concatenate([get(e, "gate_proj", "weight_scale"), get(e, "up_proj", "weight_scale")])
                    for e in range(E)])
    g13 = np.array([[get(e, "gate_proj", "weight_scale_2").item(), get(e, "up_proj", "weight_scale_2").item()]
                    for e in range(E)], np.float32)
    w2 = np.stack([get(e, "down_proj", "weight") for e in range(E)])
    s2 = np.stack([get(e, "down_proj", "weight_scale") for e in range(E)])
    g2 = np.array([get(e, "down_proj", "weight_scale_2").item() for e in range(E)], np.float32)
    return w13, s13, g13, w2, s2, g2


E2M1 = np.array([0, .5, 1, 1.5, 2, 3, 4, 6, -0., -.5, -1, -1.5, -2, -3, -4, -6])


def e4m3_to_f64(b):
    """E4M3 (bias 7, no infinities) bytes -> float64."""
    b = b.astype(np.int64)
    s, ex, m = np.where(b & 0x80, -1.0, 1.0), (b >> 3) & 15, b & 7
    v = np.where(ex == 0, m / 8 * 2.0 ** -6, (1 + m / 8) * 2.0 ** (ex - 7))
    return s * np.where((ex == 15) & (m == 7), np.nan, v)


def dequant(codes, scales, scale_2):
    """ModelOpt NVFP4 [N, K/2] codes (element 2j in the low nibble), [N, K/16] scales -> float64 [N, K]."""
    q = np.stack([E2M1[codes & 15], E2M1[codes >> 4]], -1).reshape(codes.shape[0], -1)
    return q * np.repeat(e4m3_to_f64(scales), 16, axis=1) * np.asarray(scale_2, np.float64).reshape(-1, 1)


def w4a16_ideal(stacked, x, ids, w):
    """y in float64 from the dequantized NVFP4 weights and the BF16 activations, a rounded to bf16 as
    SPEC §3b: the closest any W4A16 implementation of this checkpoint can be."""
    w13, s13, g13, w2, s2, g2 = stacked
    T, K = ids.shape
    I = w2.shape[2] * 2
    xf = f64_from_bf16(x)
    y = np.zeros((T, w2.shape[1]))
    for e in np.unique(ids):
        rows, slots = np.nonzero(ids == e)
        gu = xf[rows] @ dequant(w13[e], s13[e], np.repeat(g13[e], I)).T
        g, u = gu[:, :I], gu[:, I:]
        a = f64_from_bf16(bf16_from_f32((g / (1 + np.exp(-g)) * u).astype(np.float32)))
        y[rows] += w[rows, slots, None].astype(np.float64) * (a @ dequant(w2[e], s2[e], g2[e]).T)
    return y


def humming_y(ck, prefix, E, x, ids, w):
    import torch
    from humming_moe import HummingMoE

    w13, s13, g13, w2, s2, g2 = stacked_nvfp4(ck, prefix, E)
    cuda = lambda a: torch.from_numpy(np.ascontiguousarray(a)).cuda()  # noqa: E731
    e4m3 = lambda a: cuda(a).view(torch.float8_e4m3fn)  # noqa: E731
    moe = HummingMoE(cuda(w13), e4m3(s13), cuda(g13), cuda(w2), e4m3(s2), cuda(g2))
    xt = cuda(x.view(np.int16)).view(torch.bfloat16)
    y = moe.forward(xt, cuda(ids), cuda(w)).float().cpu().numpy()
    return y.astype(np.float64)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cli", default=".devbin/megamoe")
    ap.add_argument("--backend", default="cuda")
    ap.add_argument("--shapes", default="Qwen3-30B-like,Mixtral-like")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--std", type=float, default=0.02, help="weights' standard deviation")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--work", help="folder for the checkpoints and run files (default: a temporary one)")
    ap.add_argument("--json", help="append one JSON line per result to this file")
    ap.add_argument("--no-humming", action="store_true")
    a = ap.parse_args()
    work = a.work or tempfile.mkdtemp(prefix="mm-accuracy-")
    os.makedirs(work, exist_ok=True)
    run_help = subprocess.run([a.cli, "run", "--help"], capture_output=True, text=True).stdout
    modes = ["bf16", "nvfp4"] if "--activations" in run_help else [None]
    if modes == [None]:
        print("accuracy: this build's `megamoe run` has no --activations: NVFP4 runs its one numerics "
              "(activations quantized, SPEC §3)", flush=True)
    results = []

    def report(shape, impl, err):
        print(f"accuracy {shape} T={a.tokens}: {impl:34s} relative L2 {err:.4e}", flush=True)
        results.append({"shape": shape, "T": a.tokens, "impl": impl, "rel_l2": err, "std": a.std, "seed": a.seed})

    for name in a.shapes.split(","):
        E, K, H, I = SHAPES[name]
        t0 = time.time()
        w13, w2, x, ids, w = make_case(E, K, H, I, a.tokens, a.std, a.seed)
        ref = reference(w13, w2, x, ids, w)
        prefix = "layer"
        bf16_ck, fp4_ck = os.path.join(work, f"{name}.bf16.safetensors"), os.path.join(work, f"{name}.nvfp4.safetensors")
        inp, outp = os.path.join(work, f"{name}.in.safetensors"), os.path.join(work, f"{name}.out.safetensors")
        st_write(bf16_ck, {f"{prefix}.w13_weight": ("BF16", w13), f"{prefix}.w2_weight": ("BF16", w2)})
        st_write(inp, {"hidden_states": ("BF16", x), "topk_ids": ("I32", ids), "topk_weights": ("F32", w)})
        subprocess.run([a.cli, "quantize", bf16_ck, fp4_ck], check=True, stdout=subprocess.DEVNULL)
        print(f"accuracy {name}: E={E} K={K} H={H} I={I}, weights N(0, {a.std}^2), data and reference ready in "
              f"{time.time() - t0:.1f} s", flush=True)

        def run(ck, *extra):
            if os.path.exists(outp):
                os.remove(outp)
            subprocess.run([a.cli, "run", "--checkpoint", ck, "--input", inp, "--output", outp,
                            "--backend", a.backend, *extra], check=True, stdout=subprocess.DEVNULL)
            return f64_from_bf16(st_read(outp)["y"][1])

        report(name, "megamoe BF16", rel_l2(run(bf16_ck), ref))
        for m in modes:
            label = f"megamoe NVFP4, activations {m}" if m else "megamoe NVFP4 (this build)"
            report(name, label, rel_l2(run(fp4_ck, *(["--activations", m] if m else [])), ref))
        fp4 = st_read(fp4_ck)
        report(name, "NVFP4 weights, W4A16 in float64", rel_l2(w4a16_ideal(stacked_nvfp4(fp4, prefix, E), x, ids, w), ref))
        if a.no_humming:
            continue
        try:
            import torch  # noqa: F401

            sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "peers"))
            from humming_moe import ensure_humming

            ensure_humming()
        except (ImportError, subprocess.CalledProcessError) as err:
            print(f"accuracy {name}: Humming not run ({err})", flush=True)
            continue
        report(name, "Humming (NVFP4 weights, BF16 act.)", rel_l2(humming_y(fp4, prefix, E, x, ids, w), ref))
    if a.json:
        with open(a.json, "a") as f:
            for r in results:
                f.write(json.dumps(r) + "\n")


if __name__ == "__main__":
    main()
