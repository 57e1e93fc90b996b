"""Independent references for the megamoe tests: numpy + ml_dtypes, float64 where SPEC.md allows.

Nothing here calls megamoe code except `run_cli` (the command under test) and `hooks()` (the C codecs
behind ctypes). The math follows SPEC.md §2-5 directly; it shares no code with the library.
"""
import ctypes
import json
import os
import subprocess

import ml_dtypes
import numpy as np
import safetensors

F32 = np.float32
BF16 = ml_dtypes.bfloat16
E4M3 = ml_dtypes.float8_e4m3fn
E2M1 = ml_dtypes.float4_e2m1fn

E2M1_VALUES = np.array([0, .5, 1, 1.5, 2, 3, 4, 6, -0., -.5, -1, -1.5, -2, -3, -4, -6], dtype=np.float64)

# ---- safetensors through the Python package ---------------------------------------------------

_ST_DTYPES = {
    np.dtype(np.float32): "float32", np.dtype(np.float64): "float64", np.dtype(np.int32): "int32",
    np.dtype(np.int64): "int64", np.dtype(np.uint8): "uint8", np.dtype(np.int8): "int8",
    np.dtype(np.bool_): "bool", np.dtype(np.float16): "float16", np.dtype(np.uint16): "uint16",
    np.dtype(BF16): "bfloat16", np.dtype(E4M3): "float8_e4m3fn",
}
_FROM_ST = {"F32": np.float32, "F64": np.float64, "I32": np.int32, "I64": np.int64, "U8": np.uint8,
            "I8": np.int8, "BOOL": np.bool_, "F16": np.float16, "U16": np.uint16, "BF16": BF16,
            "F8_E4M3": E4M3}


def st_save(path, tensors):
    """Writes {name: numpy array} with the safetensors package."""
    keep, specs = [], {}
    for name, a in tensors.items():
        a = np.ascontiguousarray(a)
        keep.append(a)
        specs[name] = safetensors.TensorSpec(dtype=_ST_DTYPES[a.dtype], shape=list(a.shape),
                                             data_ptr=a.ctypes.data, data_len=a.nbytes)
    safetensors.serialize_file(specs, str(path))


def st_load(path):
    """Reads a safetensors file with the safetensors package into {name: numpy array}."""
    with open(path, "rb") as f:
        items = safetensors.deserialize(f.read())
    return {name: np.frombuffer(bytes(d["data"]), dtype=_FROM_ST[d["dtype"]]).reshape(d["shape"])
            for name, d in items}


def st_save_sharded(folder, tensors, num_shards):
    """Splits {name: array} over num_shards files plus model.safetensors.index.json."""
    os.makedirs(folder, exist_ok=True)
    names = sorted(tensors)
    weight_map = {}
    for s in range(num_shards):
        fname = f"model-{s + 1:05d}-of-{num_shards:05d}.safetensors"
        part = {n: tensors[n] for i, n in enumerate(names) if i % num_shards == s}
        st_save(os.path.join(folder, fname), part)
        weight_map.update({n: fname for n in part})
    with open(os.path.join(folder, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {}, "weight_map": weight_map}, f)


# ---- number formats -----------------------------------------------------------------------------

def bf16_round(a):
    return np.asarray(a, dtype=F32).astype(BF16).astype(np.float64)


def e4m3_rn(v):
    """SPEC e4m3_rn on float32 values: nearest, ties to even, saturating at +-448."""
    v = np.asarray(v, dtype=F32)
    return np.clip(v, -448, 448).astype(E4M3)


def e2m1_rn_values(v):
    """SPEC e2m1_rn, returned as float64 values (sign of zero kept)."""
    v = np.asarray(v, dtype=F32)
    return np.clip(v, -6, 6).astype(E2M1).astype(np.float64)


def decode_nvfp4(codes, sf):
    """codes [..., n/2] u8, sf [..., n/16] E4M3 bytes -> float64 [..., n] = e2m1 * block scale."""
    codes = np.asarray(codes, dtype=np.uint8)
    q = np.empty(codes.shape[:-1] + (codes.shape[-1] * 2,), dtype=np.float64)
    q[..., 0::2] = E2M1_VALUES[codes & 15]
    q[..., 1::2] = E2M1_VALUES[codes >> 4]
    scale = np.asarray(sf).view(E4M3).astype(np.float64)
    return q * np.repeat(scale, 16, axis=-1)


def quantize_blocks(v, scale):
    """SPEC §3's block quantizer in float32: v [..., n] f32, scale broadcastable [..., 1] f32.
    Returns (codes u8 [..., n/2], sf bytes u8 [..., n/16], values f64 = e2m1 * sf without scale)."""
    v = np.asarray(v, dtype=F32)
    scale = np.asarray(scale, dtype=F32)
    blocks = v.reshape(v.shape[:-1] + (v.shape[-1] // 16, 16))
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        amax = np.abs(blocks).max(axis=-1)
        sf = e4m3_rn(amax / (scale * F32(6.0)))
        sf_f = sf.astype(F32)
        denom = (sf_f * scale)[..., None]
        q = np.where(sf_f[..., None] == 0, F32(0), blocks / denom)
    qc = np.clip(q, -6, 6).astype(E2M1).view(np.uint8) & 15
    qc = np.where(sf_f[..., None] == 0, 0, qc).astype(np.uint8).reshape(v.shape)
    codes = (qc[..., 0::2] | (qc[..., 1::2] << 4)).astype(np.uint8)
    vals = E2M1_VALUES[qc] * np.repeat(sf_f.astype(np.float64), 16, axis=-1)
    return codes, sf.view(np.uint8), vals


def activation_scale(x_f32):
    """s = A / 2688 (A = max |x| of the row), 1 where A == 0; x [..., H] f32."""
    a = np.abs(np.asarray(x_f32, dtype=F32)).max(axis=-1)
    return np.where(a == 0, F32(1), a / F32(2688.0)).astype(F32)


def quantize_weight(w_bf16):
    """ModelOpt NVFP4 of a [rows, cols] bf16 matrix: (codes, sf bytes, alpha)."""
    w = np.asarray(w_bf16).astype(F32)
    amax = np.abs(w).max() if w.size else F32(0)
    alpha = F32(1) if amax == 0 else F32(amax / F32(2688.0))
    codes, sf, _ = quantize_blocks(w, np.full(w.shape[:-1] + (1,), alpha, dtype=F32))
    return codes, sf, alpha


# ---- the layer, float64 ---------------------------------------------------------------------------

def reference_layer(model, x_bf16, ids, weights, padding=None, norm_eps=1e-6, clamp=0.0, gamma=None,
                    activations="bf16"):
    """SPEC §1-5 in float64 (quantizers in float32 as the SPEC demands). Returns y f64 [T, H]
    before the final bf16 rounding, with NaN rows for non-finite tokens. `activations` is an NVFP4
    layer's setting (SPEC §3b): "bf16" (the default, never quantized) or "nvfp4" (§3)."""
    assert activations in ("bf16", "nvfp4")
    T, H = x_bf16.shape
    K = ids.shape[1]
    E = model["E"]
    x = np.asarray(x_bf16).astype(F32)
    live = np.ones(T, dtype=bool) if padding is None else ~np.asarray(padding, dtype=bool)
    finite = np.isfinite(x).all(axis=1)
    y = np.zeros((T, H), dtype=np.float64)
    nvfp4 = model["format"] == "nvfp4"
    qact = nvfp4 and activations == "nvfp4"
    if qact:
        xs = np.where(finite, activation_scale(np.where(np.isfinite(x), x, 0)), F32(1))
        _, _, xq = quantize_blocks(np.where(np.isfinite(x), x, 0), xs[:, None])
        xhat = xq * xs[:, None].astype(np.float64)
    else:
        xhat = x.astype(np.float64)
    I = model["I"]
    for e in range(E):
        sel = np.argwhere((ids == e) & (live & finite)[:, None])
        if len(sel) == 0:
            continue
        t_idx, k_idx = sel[:, 0], sel[:, 1]
        xe = xhat[t_idx]                                   # [n, H]
        if nvfp4:
            w13 = decode_nvfp4(model["w13"][e], model["w13_sf"][e])   # [2I, H]
            w2 = decode_nvfp4(model["w2"][e], model["w2_sf"][e])      # [H, I]
            g = model["w13_s2"][e, 0] * (xe @ w13[:I].T)
            u = model["w13_s2"][e, 1] * (xe @ w13[I:].T)
        else:
            w13 = model["w13"][e].astype(np.float64)
            w2 = model["w2"][e].astype(np.float64)
            g, u = xe @ w13[:I].T, xe @ w13[I:].T
        if clamp > 0:
            g = np.minimum(g, clamp)
            u = np.clip(u, -clamp, clamp)
        a = g / (1 + np.exp(-g)) * u
        if qact:
            a2 = F32(model["w2_in"][e])
            _, _, aq = quantize_blocks(a.astype(F32), np.full((a.shape[0], 1), a2, dtype=F32))
            p = float(model["w2_s2"][e]) * (aq * float(a2)) @ w2.T
        elif nvfp4:
            p = float(model["w2_s2"][e]) * bf16_round(a) @ w2.T
        else:
            p = bf16_round(a) @ w2.T
        if gamma is not None:
            p = p / np.sqrt((p * p).mean(axis=1, keepdims=True) + norm_eps) * gamma[None, :]
        np.add.at(y, t_idx, weights[t_idx, k_idx][:, None].astype(np.float64) * p)
    y[live & ~finite] = np.nan
    return y


def rel_l2(a, ref):
    a, ref = np.asarray(a, dtype=np.float64), np.asarray(ref, dtype=np.float64)
    return float(np.linalg.norm(a - ref) / max(np.linalg.norm(ref), 1e-30))


# ---- random models --------------------------------------------------------------------------------

def random_model(fmt, E, H, I, seed, with_norm=True):
    """A random layer in the stacked layout of SPEC §3-4 (numpy arrays)."""
    rng = np.random.default_rng(seed)
    m = {"format": fmt, "E": E, "H": H, "I": I}
    if fmt == "nvfp4":
        m["w13"] = rng.integers(0, 256, (E, 2 * I, H // 2), dtype=np.uint8)
        m["w2"] = rng.integers(0, 256, (E, H, I // 2), dtype=np.uint8)
        # block scales from subnormal to normal E4M3 values
        m["w13_sf"] = rng.integers(0x01, 0x58, (E, 2 * I, H // 16), dtype=np.uint8)
        m["w2_sf"] = rng.integers(0x01, 0x58, (E, H, I // 16), dtype=np.uint8)
        m["w13_s2"] = (rng.uniform(0.5, 1.5, (E, 2)) / (4 * np.sqrt(H))).astype(F32)
        m["w13_in"] = np.full((E, 2), 1 / 2688, dtype=F32)
        m["w2_s2"] = (rng.uniform(0.5, 1.5, E) / (4 * np.sqrt(I))).astype(F32)
        m["w2_in"] = np.ones(E, dtype=F32)  # set by calibrate_a2
    else:
        m["w13"] = (rng.standard_normal((E, 2 * I, H)) / np.sqrt(H)).astype(BF16)
        m["w2"] = (rng.standard_normal((E, H, I)) / np.sqrt(I)).astype(BF16)
    m["norm"] = (1 + 0.2 * rng.standard_normal(H)).astype(F32) if with_norm else None
    return m


def calibrate_a2(model, x_bf16, ids, padding=None):
    """Sets each expert's static a2 from the activations these inputs produce (max |a| / 2688)."""
    if model["format"] != "nvfp4":
        return
    E, I = model["E"], model["I"]
    x = np.asarray(x_bf16).astype(F32)
    x = np.where(np.isfinite(x), x, 0)
    xs = activation_scale(x)
    _, _, xq = quantize_blocks(x, xs[:, None])
    xhat = xq * xs[:, None]
    for e in range(E):
        rows = np.unique(np.argwhere(ids == e)[:, 0])
        if len(rows) == 0:
            continue
        w13 = decode_nvfp4(model["w13"][e], model["w13_sf"][e])
        g = model["w13_s2"][e, 0] * (xhat[rows] @ w13[:I].T)
        u = model["w13_s2"][e, 1] * (xhat[rows] @ w13[I:].T)
        amax = np.abs(g / (1 + np.exp(-g)) * u).max()
        model["w2_in"][e] = F32(amax / 2688) if amax > 0 else F32(1)


def random_inputs(T, K, H, E, seed, edge_cases=True):
    """Hidden states, routing and padding; with edge cases in the first rows (see SPEC §1, §5)."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((T, H)).astype(F32)
    x *= np.exp(rng.uniform(-3, 3, (T, 1))).astype(F32)  # token scales over 2.5 decades
    x = x.astype(BF16)
    ids = np.stack([rng.permutation(E)[:K] if K <= E else rng.integers(0, E, K) for _ in range(T)]).astype(np.int32)
    w = rng.standard_normal((T, K)).astype(F32)  # negative weights too
    pad = np.zeros(T, dtype=bool)
    if edge_cases and T >= 8:
        ids[1, K - 1] = -1                   # an empty slot
        if K >= 2:
            ids[2, 1] = ids[2, 0]            # a duplicate id in a row
        ids[3, :] = -1                       # no valid slot: zero row
        pad[4] = True                        # padding: zero row, x ignored even when NaN
        x[4, 5] = np.nan
        x[5, 17] = np.inf                    # non-finite: NaN row
        x[6, 3] = np.nan
        x[7, :] = 0                          # all-zero token
    return x, ids, w, pad


# ---- checkpoint naming styles ------------------------------------------------------------------------

PROJ = {"gate_up_down": ("gate_proj", "up_proj", "down_proj"), "w13": ("w1", "w3", "w2")}


def checkpoint_tensors(model, prefix, style, scalar_shape=(), input_scales=True):
    """{name: array} of the model in a naming style of SPEC §6:
    'stacked', 'per_expert', 'per_expert_w', 'ct_per_expert', 'ct_stacked' (compressed-tensors).
    input_scales=False leaves out every input scale, as a weight-only NVFP4 export does
    (compressed-tensors NVFP4A16, ModelOpt W4A16)."""
    E, I = model["E"], model["I"]
    nv = model["format"] == "nvfp4"
    p = prefix + "." if prefix else ""
    out = {}
    if model["norm"] is not None:
        out[p + "post_expert_norm.weight"] = model["norm"]
    if style == "stacked":
        out[p + "w13_weight"] = model["w13"]
        out[p + "w2_weight"] = model["w2"]
        if nv:
            out[p + "w13_weight_scale"] = model["w13_sf"].view(E4M3)
            out[p + "w2_weight_scale"] = model["w2_sf"].view(E4M3)
            out[p + "w13_weight_scale_2"] = model["w13_s2"]
            out[p + "w2_weight_scale_2"] = model["w2_s2"]
            if input_scales:
                out[p + "w13_input_scale"] = model["w13_in"]
                out[p + "w2_input_scale"] = model["w2_in"]
        return out
    if style == "ct_stacked":
        out[p + "w13_weight_packed"] = model["w13"]
        out[p + "w2_weight_packed"] = model["w2"]
        out[p + "w13_weight_scale"] = model["w13_sf"].view(E4M3)
        out[p + "w2_weight_scale"] = model["w2_sf"].view(E4M3)
        out[p + "w13_weight_global_scale"] = (F32(1) / model["w13_s2"]).astype(F32)
        out[p + "w2_weight_global_scale"] = (F32(1) / model["w2_s2"]).astype(F32)
        if input_scales:
            out[p + "w13_input_global_scale"] = (F32(1) / model["w13_in"]).astype(F32)
            out[p + "w2_input_global_scale"] = (F32(1) / model["w2_in"]).astype(F32)
        return out
    ct = style.startswith("ct_")
    names = PROJ["w13" if style == "per_expert_w" else "gate_up_down"]
    f_w, f_s2, f_in = ("weight_packed", "weight_global_scale", "input_global_scale") if ct else \
                      ("weight", "weight_scale_2", "input_scale")
    inv = (lambda v: (F32(1) / F32(v)).astype(F32)) if ct else (lambda v: F32(v))
    for e in range(E):
        for j, proj in enumerate(names):
            base = f"{p}experts.{e}.{proj}."
            rows = slice(0, I) if j == 0 else slice(I, 2 * I)
            if j < 2:
                out[base + f_w] = model["w13"][e, rows]
                if nv:
                    out[base + "weight_scale"] = model["w13_sf"][e, rows].view(E4M3)
                    out[base + f_s2] = np.full(scalar_shape, inv(model["w13_s2"][e, j]), dtype=F32)
                    if input_scales:
                        out[base + f_in] = np.full(scalar_shape, inv(model["w13_in"][e, j]), dtype=F32)
            else:
                out[base + f_w] = model["w2"][e]
                if nv:
                    out[base + "weight_scale"] = model["w2_sf"][e].view(E4M3)
                    out[base + f_s2] = np.full(scalar_shape, inv(model["w2_s2"][e]), dtype=F32)
                    if input_scales:
                        out[base + f_in] = np.full(scalar_shape, inv(model["w2_in"][e]), dtype=F32)
            if ct:
                out[base + "weight_zero_point"] = np.zeros(1, dtype=np.int32)
    return out


# ---- the programs under test -------------------------------------------------------------------------

def cli_path():
    return os.environ["MEGAMOE_CLI"]


def run_cli(*args, check=True, timeout=600):
    """Runs `megamoe args...`; returns the CompletedProcess (text)."""
    proc = subprocess.run([cli_path(), *map(str, args)], capture_output=True, text=True, timeout=timeout)
    if check and proc.returncode != 0:
        raise AssertionError(f"megamoe {' '.join(map(str, args))} failed ({proc.returncode}):\n"
                             f"{proc.stdout}\n{proc.stderr}")
    return proc


def write_inputs(path, x, ids, w, pad=None):
    t = {"hidden_states": x, "topk_ids": ids, "topk_weights": w}
    if pad is not None:
        t["is_padding"] = pad
    st_save(path, t)


def hooks():
    lib = ctypes.CDLL(os.environ["MEGAMOE_TESTHOOKS"])
    return lib
