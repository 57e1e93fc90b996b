"""SPEC §2-3 codecs and quantizers of src/formats.h (through tests/testhooks.c) against an
independent implementation: ml_dtypes' float4_e2m1fn / float8_e4m3fn / bfloat16 and numpy float32."""
import ctypes

import numpy as np
import pytest

import mmref as mr

P = ctypes.c_void_p


@pytest.fixture(scope="module")
def lib():
    return mr.hooks()


def call(lib, fn, inp, out_dtype):
    inp = np.ascontiguousarray(inp)
    out = np.empty(inp.shape, dtype=out_dtype)
    getattr(lib, fn)(P(inp.ctypes.data), P(out.ctypes.data), ctypes.c_size_t(inp.size))
    return out


def random_floats(n, seed):
    """Random float32 bit patterns (every exponent, subnormals, signed zeros, infinities), no NaN."""
    rng = np.random.default_rng(seed)
    bits = rng.integers(0, 2**32, n, dtype=np.uint64).astype(np.uint32)
    v = bits.view(np.float32)
    return v[~np.isnan(v)]


def near(values, n_ulps=2):
    """Each value and its float32 neighbours within n ulps (ties and both sides of them)."""
    v = np.asarray(values, dtype=np.float32)
    out = [v]
    up, dn = v.copy(), v.copy()
    for _ in range(n_ulps):
        up, dn = np.nextafter(up, np.float32(np.inf)), np.nextafter(dn, np.float32(-np.inf))
        out += [up, dn]
    r = np.concatenate(out)
    return np.concatenate([r, -r])


def expected_e2m1(v):
    return np.clip(v, -6, 6).astype(mr.E2M1).view(np.uint8) & 15


def expected_e4m3(v):
    return np.clip(v, -448, 448).astype(mr.E4M3).view(np.uint8)


def test_decode_every_code(lib):
    c16 = np.arange(16, dtype=np.uint8)
    got = call(lib, "th_e2m1_decode", c16, np.float32)
    want = c16.view(mr.E2M1).astype(np.float32)
    assert got.tobytes() == want.tobytes()  # signed zero included
    c256 = np.arange(256, dtype=np.uint8)
    got = call(lib, "th_e4m3_decode", c256, np.float32)
    want = c256.view(mr.E4M3).astype(np.float32)
    nan = np.isnan(want)
    assert (np.isnan(got) == nan).all() and nan.sum() == 2
    assert got[~nan].tobytes() == want[~nan].tobytes()


def test_e2m1_millions(lib):
    ties = np.array([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0, 0.5, 1, 1.5, 2, 3, 4], dtype=np.float32)
    v = np.concatenate([random_floats(4_000_000, 1), near(ties, 3), np.float32([0.0, -0.0, np.inf, -np.inf]),
                        np.random.default_rng(2).uniform(-8, 8, 2_000_000).astype(np.float32)])
    got = call(lib, "th_e2m1_rn", v, np.uint8)
    want = expected_e2m1(v)
    bad = np.flatnonzero(got != want)
    assert bad.size == 0, f"{bad.size} mismatches, first {v[bad[:5]]} -> {got[bad[:5]]} want {want[bad[:5]]}"
    # SPEC: the sign bit is v's sign also when the magnitude rounds to 0 (-0.1 -> code 8).
    assert call(lib, "th_e2m1_rn", np.float32([-0.1, -0.0, 0.1]), np.uint8).tolist() == [8, 8, 0]


def test_e4m3_millions(lib):
    vals = np.arange(256, dtype=np.uint8).view(mr.E4M3).astype(np.float32)
    vals = np.sort(vals[np.isfinite(vals) & (vals >= 0)])
    mids = ((vals[1:].astype(np.float64) + vals[:-1]) / 2).astype(np.float32)  # every tie, exact in f32
    v = np.concatenate([random_floats(4_000_000, 3), near(vals, 2), near(mids, 2),
                        np.float32([448, 449, 463.99, 464, 465, 480, 1e38, np.inf, -np.inf, 2.0**-10, 2.0**-11]),
                        np.random.default_rng(4).uniform(-500, 500, 2_000_000).astype(np.float32),
                        (np.random.default_rng(5).uniform(-1, 1, 1_000_000) * 2.0**-6).astype(np.float32)])
    got = call(lib, "th_e4m3_rn", v, np.uint8)
    want = expected_e4m3(v)
    bad = np.flatnonzero(got != want)
    assert bad.size == 0, f"{bad.size} mismatches, first {v[bad[:5]]} -> {got[bad[:5]]} want {want[bad[:5]]}"
    assert call(lib, "th_e4m3_rn", np.float32([np.nan]), np.uint8)[0] & 0x7F == 0x7F


def test_bf16_rounding(lib):
    v = np.concatenate([random_floats(2_000_000, 6), np.float32([np.inf, -np.inf, 0.0, -0.0])])
    got = call(lib, "th_f32_to_bf16", v, np.uint16)
    want = v.astype(mr.BF16).view(np.uint16)
    assert (got == want).all()


def bf16_tokens(T, H, seed):
    """Tokens over 60 decades of scale, with ties, subnormals and zeros sprinkled in."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((T, H)) * np.exp(rng.uniform(-60, 60, (T, 1)))
    x[rng.random((T, H)) < 0.05] = 0
    x[0] = 0                                      # all-zero token: s = 1
    x[1, :16] = [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5, 6] * 2   # ties inside a block
    x[2] = 1e-39 * rng.standard_normal(H)         # bf16 subnormals
    return x.astype(np.float32).astype(mr.BF16)


def test_activation_quantizer_bit_exact(lib):
    T, H = 2000, 512
    x = bf16_tokens(T, H, 7)
    codes = np.empty((T, H // 2), np.uint8)
    sf = np.empty((T, H // 16), np.uint8)
    s = np.empty(T, np.float32)
    lib.th_quantize_activations(P(x.ctypes.data), ctypes.c_size_t(T), ctypes.c_size_t(H),
                                P(codes.ctypes.data), P(sf.ctypes.data), P(s.ctypes.data))
    xf = x.astype(np.float32)
    ws = mr.activation_scale(xf)
    wc, wsf, _ = mr.quantize_blocks(xf, ws[:, None])
    assert s.tobytes() == ws.tobytes()
    assert (sf == wsf).all()
    assert (codes == wc).all()


def test_static_quantizer_bit_exact(lib):
    rng = np.random.default_rng(8)
    for a2 in [1e-3, 0.37, 5.0, 1e-30]:
        a = (rng.standard_normal(4096 * 16) * np.exp(rng.uniform(-8, 8, 4096 * 16))).astype(np.float32)
        codes = np.empty(a.size // 2, np.uint8)
        sf = np.empty(a.size // 16, np.uint8)
        lib.th_quantize_static(P(a.ctypes.data), ctypes.c_size_t(a.size), ctypes.c_float(a2),
                               P(codes.ctypes.data), P(sf.ctypes.data))
        wc, wsf, _ = mr.quantize_blocks(a, np.float32(a2))
        assert (sf == wsf).all() and (codes == wc).all()


def test_weight_quantizer_bit_exact(lib):
    rng = np.random.default_rng(9)
    for rows, cols, scale in [(64, 256, 0.02), (3, 4096, 300.0), (16, 32, 1e-20)]:
        w = (rng.standard_normal((rows, cols)) * scale).astype(mr.BF16)
        codes = np.empty((rows, cols // 2), np.uint8)
        sf = np.empty((rows, cols // 16), np.uint8)
        alpha = np.empty(1, np.float32)
        rc = lib.th_quantize_weight(P(w.ctypes.data), ctypes.c_int64(rows), ctypes.c_int64(cols),
                                    P(codes.ctypes.data), P(sf.ctypes.data), P(alpha.ctypes.data))
        assert rc == 0
        wc, wsf, wa = mr.quantize_weight(w)
        assert alpha[0] == wa and (sf == wsf).all() and (codes == wc).all()
