"""The same MoE experts layer computed the way a PyTorch user would on the GPU machine, for the
benchmark comparison of issue 3 (not a test; it has no reference to meet):
  BF16:  permute tokens by expert, torch._grouped_mm for gate/up, SiLU * up, torch._grouped_mm for
         down, weighted scatter-add back to the tokens;
  NVFP4: decode the E2M1 codes and E4M3 block scales to bf16 weights on every forward, then the same.
Median time per forward over CUDA events after a warm-up; eager (no CUDA graph) and no L2 flush, which
favours it at small T. The NVFP4 form is 100-900x slower than megamoe's and off by default.
  python3 bench/torch_baseline.py [TOKENS] [--formats bf16,nvfp4] [--shapes NAME,...] [--json FILE]
"""
import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import records as R  # noqa: E402

SHAPES = R.SHAPES
E2M1 = torch.tensor([0, .5, 1, 1.5, 2, 3, 4, 6, -0., -.5, -1, -1.5, -2, -3, -4, -6], device="cuda")


def decode_nvfp4(codes, sf, alpha, out):
    """codes [E, N, K/2] u8, sf [E, N, K/16] e4m3 -> out bf16 [E, N, K], a few experts at a time."""
    for e0 in range(0, codes.shape[0], 8):
        c, s = codes[e0:e0 + 8], sf[e0:e0 + 8]
        q = torch.stack([E2M1[(c & 15).long()], E2M1[(c >> 4).long()]], dim=-1).flatten(-2)
        out[e0:e0 + 8] = (q * s.float().repeat_interleave(16, dim=-1) * alpha[e0:e0 + 8, None, None]).to(torch.bfloat16)
    return out


def moe(x, ids, w, w13, w2, I):
    T, K = ids.shape
    flat = ids.flatten()
    order = torch.argsort(flat, stable=True)
    tok = order // K
    counts = torch.bincount(flat, minlength=w13.shape[0])
    offs = torch.cumsum(counts, 0).to(torch.int32)
    gu = torch._grouped_mm(x[tok], w13.transpose(-2, -1), offs=offs)
    a = torch.nn.functional.silu(gu[:, :I]) * gu[:, I:]
    p = torch._grouped_mm(a, w2.transpose(-2, -1), offs=offs)
    y = torch.zeros(T, x.shape[1], device="cuda", dtype=torch.float32)
    y.index_add_(0, tok, p.float() * w.flatten()[order, None])
    return y.to(torch.bfloat16)


def median_ms(fn, iters=10):
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return sorted(times)[len(times) // 2]


def main():
    ap = argparse.ArgumentParser(description="the MoE experts layer in plain PyTorch ops, timed")
    ap.add_argument("tokens", nargs="?", default="1,8,32,128,512,2048,8192")
    ap.add_argument("--formats", default="bf16")
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--json", help="append records (bench/records.py) to this file")
    a = ap.parse_args()
    tokens = [int(t) for t in a.tokens.split(",")]
    gpu, date, out = torch.cuda.get_device_name(), time.strftime("%Y-%m-%d", time.gmtime()), []
    g = torch.Generator(device="cuda").manual_seed(0)
    print(f"torch {torch.__version__}, {gpu}")
    for name in a.shapes.split(","):
        E, K, H, I = SHAPES[name]
        for fmt in a.formats.split(","):
            if fmt == "bf16":
                w13 = (torch.randn(E, 2 * I, H, device="cuda", generator=g) * 0.02).to(torch.bfloat16)
                w2 = (torch.randn(E, H, I, device="cuda", generator=g) * 0.02).to(torch.bfloat16)
                weights = lambda: (w13, w2)
            else:
                c13 = torch.randint(0, 256, (E, 2 * I, H // 2), device="cuda", dtype=torch.uint8, generator=g)
                s13 = torch.rand(E, 2 * I, H // 16, device="cuda", generator=g).to(torch.float8_e4m3fn)
                c2 = torch.randint(0, 256, (E, H, I // 2), device="cuda", dtype=torch.uint8, generator=g)
                s2 = torch.rand(E, H, I // 16, device="cuda", generator=g).to(torch.float8_e4m3fn)
                al = torch.full((E,), 1 / 64, device="cuda")
                d13 = torch.empty(E, 2 * I, H, device="cuda", dtype=torch.bfloat16)
                d2 = torch.empty(E, H, I, device="cuda", dtype=torch.bfloat16)
                weights = lambda: (decode_nvfp4(c13, s13, al, d13), decode_nvfp4(c2, s2, al, d2))
            for T in tokens:
                x = torch.randn(T, H, device="cuda", generator=g).to(torch.bfloat16)
                ids = torch.rand(T, E, device="cuda", generator=g).topk(K, dim=1).indices.to(torch.int32)
                w = torch.softmax(torch.randn(T, K, device="cuda", generator=g), dim=1)
                try:
                    ms = median_ms(lambda: moe(x, ids, w, *weights(), I))
                    tf = 6 * H * I * T * K / (ms * 1e-3) / 1e12
                    print(f"torch {name} {fmt} T={T}: {ms:.4f} ms, {tf:.1f} TFLOP/s", flush=True)
                    out.append(R.record(R.shape_str(E, K, H, I), fmt, T, round(ms, 4), gpu=gpu, date=date,
                                        activations="bf16" if fmt == "nvfp4" else None,
                                        source=f"torch:{torch.__version__}, bench/torch_baseline.py (eager, no L2 flush)"))
                except Exception as e:  # noqa: BLE001 - report and go on to the next point
                    print(f"torch {name} {fmt} T={T}: failed: {type(e).__name__}: {e}", flush=True)
            del weights
            torch.cuda.empty_cache()
    if a.json:
        with open(a.json, "a") as f:
            R.write_jsonl(out, f)


if __name__ == "__main__":
    main()
