"""Humming's NVFP4 MoE forward (PyPI humming-kernels 0.1.20), called the way vLLM's default Humming MoE
path calls it, for the side-by-side benchmark and the accuracy comparison.

vLLM's path (HummingMoEMethod + HummingIndexedExperts): the checkpoint's ModelOpt NVFP4 tensors are
converted to Humming's layout per sublayer (w13 as two stacked shards gate / up, w2), then per forward:
moe_align_block_size (slot ids sorted by expert, each expert padded to the kernel's M tile), the
gate/up GEMM reading token rows through the sorted ids (top_k = K), SiLU·mul, the down GEMM (top_k = 1),
and the weighted sum over the K slots. Activations stay BF16 (W4A16). The glue here is torch ops (vLLM
has CUDA kernels for the align and the sum); the two GEMMs are Humming's. One difference from vLLM's
wrapper, which pads for both GEMMs to the gate/up kernel's M tile: each GEMM gets routing padded to its
own kernel's M tile (gemm_routing), as Humming's kernel reads it; where the two tiles differ (some T on
each shape) that is a second align in the whole forward.

  python3 bench/peers/humming_moe.py [--shapes NAME,...] [--tokens 1,8,...] [--iters N] [--json FILE]
                                     [--isolate] [--check-only]

prints per shape and T the median ms of (a) the whole forward and (b) the two GEMMs alone, each a
CUDA-graph replay after a 256 MB L2 flush (as `megamoe bench`), and appends records (bench/records.py).
Before timing it checks the whole forward against a torch reference on the dequantized weights, at
T = 4 and then at each T on up to 4 rows, and prints the relative L2 and both GEMMs' M tiles; a T whose
output is wrong is reported and not timed. --check-only: the checks alone, nothing timed.
Humming JIT-compiles its kernels on the first call of each configuration (HUMMING_CACHE_DIR keeps them).
Each point's records are appended as soon as it is measured. A fault inside Humming ends the process
and its CUDA context; --isolate runs each shape in a child process and, after a fault, goes on in a
fresh one with the T after the faulting one, which it names as not measured.
"""
import argparse
import json
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import records as R  # noqa: E402

REPO = os.path.abspath(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))


def ensure_humming():
    """Imports humming; where it is not installed, installs the wheel carried in .whl/ into
    /tmp/humming-site (the GPU machine has no network). Its JIT cache defaults to .whl/humming-cache."""
    os.environ.setdefault("HUMMING_CACHE_DIR", os.path.join(REPO, ".whl", "humming-cache"))
    try:
        import humming
        return humming
    except ImportError:
        pass
    import glob
    import subprocess

    wheels = sorted(glob.glob(os.path.join(REPO, ".whl", "humming_kernels-*.whl")))
    if not wheels:
        raise ImportError("humming is not installed and no .whl/humming_kernels-*.whl is here "
                          "(python3 -m pip download --no-deps humming-kernels==0.1.20 -d .whl)")
    site = "/tmp/humming-site"
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
                    "--target", site, wheels[-1]], check=True)
    sys.path.insert(0, site)
    import humming
    return humming


E2M1 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0]


def dequant_nvfp4(codes, scales, scale_2):
    """ModelOpt NVFP4 -> f32: codes [N, K/2] u8 (element 2j in the low nibble), scales [N, K/16] e4m3,
    scale_2 a scalar or [N] f32. Exact (E2M1 x E4M3 x f32 global)."""
    lut = torch.tensor(E2M1, device=codes.device)
    q = torch.stack([lut[(codes & 15).long()], lut[(codes >> 4).long()]], dim=-1).flatten(-2)
    s = scales.float().repeat_interleave(16, dim=-1)
    g = scale_2.float().reshape(-1, 1) if torch.is_tensor(scale_2) and scale_2.numel() > 1 else scale_2
    return q * s * g


def tuning_block_m(tuning, valid_m):
    """The M tile (block_shape[0]) of the kernel Humming's launcher runs for valid_m routed rows, from one
    GEMM's tuning list [[lo, hi, config], ...]: the entry with lo < valid_m <= hi, hi <= 0 meaning no
    upper bound (the launcher's lookup of its kernel by valid_shape_m)."""
    for lo, hi, cfg in tuning:
        if lo < valid_m <= (hi if hi > 0 else 1 << 30):
            return cfg["block_shape"][0]
    raise ValueError(f"no Humming tuning range holds M = {valid_m}")


def moe_align(ids, num_experts, bs):
    """Humming's indexed-GEMM routing for ids [T, K] in torch ops (graph-safe, any device):
    sorted_ids   the slot ids t*K+k grouped by expert (ascending within one), each expert's run padded
                 to a multiple of bs with the sentinel T*K; length a multiple of bs that holds any routing;
    expert_ids   the expert of each bs-row block (-1 past the last);
    ntp          [1] i32, the rows in use (the sum of the padded runs).
    The kernel reads block b's rows at sorted_ids[b*M:(b+1)*M] and its expert at expert_ids[b] with M its
    own M tile, so bs must be that M tile."""
    tk, E, dev = ids.numel(), num_experts, ids.device
    cap = tk + min(E, tk) * (bs - 1)
    cap = (cap + bs - 1) // bs * bs
    flat = ids.reshape(-1).long()
    counts = torch.zeros(E, dtype=torch.long, device=dev).scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + bs - 1) // bs * bs
    ends = torch.cumsum(padded, 0)
    first = torch.cumsum(counts, 0) - counts
    order = torch.sort(flat, stable=True).indices
    e_of = flat[order]
    dest = ends[e_of] - padded[e_of] + torch.arange(tk, device=dev) - first[e_of]
    sorted_ids = torch.full((cap,), tk, dtype=torch.int32, device=dev)
    sorted_ids[dest] = order.to(torch.int32)
    starts = torch.arange(0, cap, bs, device=dev)
    expert_ids = torch.searchsorted(ends, starts, right=True)
    expert_ids = torch.where(starts < ends[-1], expert_ids, -1).to(torch.int32)
    return sorted_ids, expert_ids, ends[-1:].to(torch.int32)


def gemm_routing(ids, num_experts, tunings, valid_m):
    """name -> (bs, sorted_ids, expert_ids, ntp) for each GEMM of tunings (name -> its tuning list): the
    routing padded to the M tile of the kernel that GEMM's own tuning picks at valid_m. Humming tunes
    the gate/up and the down GEMM apart (their N and K differ), and at some M their tiles differ (on the
    H200 e.g. Mixtral-like M = 128: 24 and 32 rows; Qwen3-like M = 4096: 48 and 40); routing padded to the
    other GEMM's tile gives a wrong y, or blocks of expert -1 and an illegal memory access. One align
    per distinct tile."""
    by_bs, out = {}, {}
    for name, tuning in tunings.items():
        bs = tuning_block_m(tuning, valid_m)
        if bs not in by_bs:
            by_bs[bs] = moe_align(ids, num_experts, bs)
        out[name] = (bs, *by_bs[bs])
    return out


class HummingMoE:
    """One NVFP4 MoE experts layer on Humming. Tensors in ModelOpt's stacked form, on the GPU:
    w13 [E, 2I, H/2] u8 (rows 0..I-1 gate, I..2I-1 up), w13_scale [E, 2I, H/16] e4m3,
    w13_scale_2 [E, 2] f32 (gate, up), w2 [E, H, I/2] u8, w2_scale [E, H, I/16] e4m3, w2_scale_2 [E] f32."""

    def __init__(self, w13, w13_scale, w13_scale_2, w2, w2_scale, w2_scale_2):
        from humming.layer import HummingMethod
        from humming.schema import BaseWeightSchema, HummingInputSchema

        self.M = HummingMethod
        self.E, two_i, half_h = w13.shape
        self.I, self.H = two_i // 2, half_h * 2
        layer = torch.nn.Module()
        layer.register_buffer("locks", torch.zeros(1024, dtype=torch.int32, device="cuda"))
        subs = {"w13": (w13, w13_scale, w13_scale_2, 2 * self.I, self.H, [self.I, self.I]),
                "w2": (w2, w2_scale, w2_scale_2, self.H, self.I, [self.H])}
        for name, (w, s, s2, n, k, n_stacks) in subs.items():
            schema = BaseWeightSchema.from_config({"quant_method": "modelopt", "quant_algo": "nvfp4"})
            hschema, tensors = schema.convert_humming(
                tensors={"weight": w, "weight_scale": s, "weight_scale_2": s2.reshape(self.E, -1).contiguous()},
                shape_n_stacks=n_stacks, shape_k_stacks=[k], param_dtype=torch.bfloat16, num_experts=self.E)
            for key, t in tensors.items():
                setattr(layer, f"{name}_{key}", torch.nn.Parameter(t, requires_grad=False))
            HummingMethod.prepare_layer_meta(
                layer=layer, shape_n=n, shape_k=k, pad_n_to_multiple=256, pad_k_to_multiple=128,
                input_schema=HummingInputSchema(), weight_schema=hschema, has_bias=False,
                num_experts=self.E, torch_dtype=torch.bfloat16, sublayer_name=name)
            HummingMethod.transform_humming_layer(layer, sublayer_name=name)
        self.layer = layer
        self.compute = json.dumps({"use_batch_invariant": False, "use_f16_accum": False, "gemm_type": "indexed"})
        self.tuning = {name: HummingMethod.get_default_tuning_configs(layer=layer, gemm_type="indexed",
                                                                     sublayer_name=name) for name in subs}
        self.tuning_str = {name: json.dumps(v) for name, v in self.tuning.items()}

    def routing(self, ids):
        """Each GEMM's routing tensors for ids [T, K] (gemm_routing with this layer's tuning lists)."""
        return gemm_routing(ids, self.E, self.tuning, ids.numel())

    def gemm(self, name, inputs, out, sorted_ids, expert_ids, ntp, top_k, valid_m):
        inputs, scale = self.M.may_quant_input(layer=self.layer, inputs=inputs, sublayer_name=name)
        self.M.forward_layer(layer=self.layer, inputs=inputs, input_scale=scale, outputs=out, sublayer_name=name,
                             sorted_ids=sorted_ids, expert_ids=expert_ids, num_tokens_padded=ntp, top_k=top_k,
                             valid_shape_m=valid_m, compute_config=self.compute, tuning_config=self.tuning_str[name])
        return out

    def buffers(self, T, K):
        return (torch.empty(T * K, 2 * self.I, dtype=torch.bfloat16, device="cuda"),
                torch.empty(T * K, self.I, dtype=torch.bfloat16, device="cuda"),
                torch.empty(T * K, self.H, dtype=torch.bfloat16, device="cuda"))

    def forward(self, x, ids, weights, bufs=None):
        """y [T, H] bf16 from x [T, H] bf16, ids [T, K] i32, weights [T, K] f32: align (once per distinct
        M tile of the two GEMMs' kernels), gate/up, SiLU·mul, down, weighted sum over the slots."""
        T, K = ids.shape
        gu, act, down = bufs or self.buffers(T, K)
        route = self.routing(ids)
        self.gemm("w13", x, gu, *route["w13"][1:], K, T * K)
        torch.mul(torch.nn.functional.silu(gu[:, :self.I]), gu[:, self.I:], out=act)
        self.gemm("w2", act, down, *route["w2"][1:], 1, T * K)
        return (down.view(T, K, self.H).float() * weights.unsqueeze(-1)).sum(1).to(torch.bfloat16)


def random_layer(E, H, I, gen):
    """Random NVFP4 weights like `megamoe bench`'s: any code byte, block scales 0x30-0x3F, globals 1/64."""
    def codes(*shape):
        return torch.randint(0, 256, shape, dtype=torch.uint8, device="cuda", generator=gen)

    def scales(*shape):
        return (0x30 + torch.randint(0, 16, shape, dtype=torch.uint8, device="cuda", generator=gen)).view(
            torch.float8_e4m3fn)

    g = torch.full((E, 2), 1 / 64, device="cuda")
    return (codes(E, 2 * I, H // 2), scales(E, 2 * I, H // 16), g,
            codes(E, H, I // 2), scales(E, H, I // 16), g[:, 0].contiguous())


TOLERANCE = 2e-2  # relative L2 of Humming's y against the reference, above which a point is not timed


def relative_error(moe, tensors, x, ids, w, bufs=None, rows=slice(None)):
    """Relative L2 of Humming's y (the forward over all of x, so at x's T) against the torch reference on
    the dequantized weights, on the given rows."""
    y = moe.forward(x, ids, w, bufs).float()[rows]
    ref = reference(tensors, x[rows], ids[rows], w[rows])
    return float((y - ref).norm() / ref.norm())


def reference(moe_tensors, x, ids, weights):
    """y in f32 from the dequantized weights, slot by slot (for a few tokens)."""
    w13, s13, g13, w2, s2, g2 = moe_tensors
    T, K = ids.shape
    I = w13.shape[1] // 2
    y = torch.zeros(T, x.shape[1], device="cuda")
    for t in range(T):
        for k in range(K):
            e = int(ids[t, k])
            a13 = torch.cat([g13[e, 0].expand(I), g13[e, 1].expand(I)])
            w = dequant_nvfp4(w13[e], s13[e], a13)
            gu = w @ x[t].float()
            a = (torch.nn.functional.silu(gu[:I]) * gu[I:]).to(torch.bfloat16).float()
            y[t] += weights[t, k] * (dequant_nvfp4(w2[e], s2[e], g2[e]) @ a)
    return y


def random_routing(T, E, K, gen):
    ids = torch.rand(T, E, device="cuda", generator=gen).topk(K, dim=1).indices.to(torch.int32)
    w = torch.softmax(torch.randn(T, K, device="cuda", generator=gen), dim=1)
    return ids, w


def time_graph(fn, iters, flush):
    """Median / min / max ms of a CUDA-graph replay of fn, after writing `flush` (> L2) before each."""
    fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    g.replay()
    torch.cuda.synchronize()
    times = []
    for i in range(iters):
        flush.fill_(i & 0xFF)
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    del g
    return statistics.median(times), min(times), max(times)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", default=",".join(R.SHAPES), help="comma list of " + ", ".join(R.SHAPES))
    ap.add_argument("--tokens", default="1,8,32,128,512,2048,8192")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--json", help="append records (bench/records.py) to this file")
    ap.add_argument("--date", default=time.strftime("%Y-%m-%d", time.gmtime()))
    ap.add_argument("--isolate", action="store_true", help="each shape in a child process; go on after a fault")
    ap.add_argument("--check-only", action="store_true", help="check the output at each T, time nothing")
    a = ap.parse_args()
    tokens = [int(t) for t in a.tokens.split(",")]
    if min(tokens) < 1:
        ap.error(f"--tokens {a.tokens}: each T must be at least 1")
    if a.isolate:
        return isolated(a)
    humming = ensure_humming()

    gpu = torch.cuda.get_device_name()
    ver = getattr(humming, "__version__", "?")
    print(f"humming {ver}, torch {torch.__version__}, {gpu}", flush=True)
    flush = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
    for name in a.shapes.split(","):
        E, K, H, I = R.SHAPES[name]
        gen = torch.Generator(device="cuda").manual_seed(1)
        t0 = time.time()
        tensors = random_layer(E, H, I, gen)
        moe = HummingMoE(*tensors)
        print(f"{name}: layer ready in {time.time() - t0:.1f} s", flush=True)
        x = torch.randn(4, H, device="cuda", generator=gen).to(torch.bfloat16)
        ids, w = random_routing(4, E, K, gen)
        t0 = time.time()
        err = relative_error(moe, tensors, x, ids, w)
        print(f"{name}: check T=4 relative L2 vs dequantized torch {err:.2e} ({time.time() - t0:.1f} s with JIT)",
              flush=True)
        if not err < TOLERANCE:
            raise SystemExit(f"{name}: Humming's forward disagrees with the reference ({err:.3e}): not timed")
        shape = R.shape_str(E, K, H, I)
        for T in tokens:
            x = torch.randn(T, H, device="cuda", generator=gen).to(torch.bfloat16)
            ids, w = random_routing(T, E, K, gen)
            bufs = moe.buffers(T, K)
            t0 = time.time()
            route = moe.routing(ids)
            tiles = f"M tiles gate/up {route['w13'][0]}, down {route['w2'][0]}"
            # Its output at this T, on up to 4 rows against the dequantized reference: a configuration
            # that computes a wrong y is not timed (the check at T = 4 above does not cover every
            # kernel its tuning picks by T).
            rows = torch.linspace(0, T - 1, min(T, 4), device="cuda").long().unique()
            err = relative_error(moe, tensors, x, ids, w, bufs, rows)
            check = f"relative L2 {err:.2e} on {len(rows)} rows against the dequantized reference, {tiles}"
            if not err < TOLERANCE:
                print(f"humming {name} T={T}: WRONG OUTPUT ({check}): not timed", flush=True)
                continue
            if a.check_only:
                print(f"humming {name} T={T}: output ok ({check})", flush=True)
                continue
            whole = time_graph(lambda: moe.forward(x, ids, w, bufs), a.iters, flush)
            gu, act, down = bufs

            def gemms():
                moe.gemm("w13", x, gu, *route["w13"][1:], K, T * K)
                moe.gemm("w2", act, down, *route["w2"][1:], 1, T * K)

            only = time_graph(gemms, a.iters, flush)
            recs = [R.record(shape, "nvfp4", T, round(med, 4), activations="bf16", min_ms=round(lo, 4),
                             max_ms=round(hi, 4), gpu=gpu, date=a.date,
                             source=f"{src}:humming-kernels {ver}, bench/peers/humming_moe.py")
                    for src, (med, lo, hi) in [("humming", whole), ("humming-gemms", only)]]
            if a.json:
                with open(a.json, "a") as f:
                    R.write_jsonl(recs, f)
            print(f"humming {name} T={T}: whole {whole[0]:.4f} ms ({R.tflops_of(shape, T, whole[0]):.1f} TFLOP/s), "
                  f"GEMMs only {only[0]:.4f} ms ({R.tflops_of(shape, T, only[0]):.1f} TFLOP/s); output ok ({check}) "
                  f"[{time.time() - t0:.1f} s]", flush=True)
        del moe, tensors
        torch.cuda.empty_cache()


def isolated(a):
    """main() per shape in a child process; after a fault, a fresh child from the T after the faulting one."""
    import subprocess

    failed = []
    for name in a.shapes.split(","):
        todo = [int(t) for t in a.tokens.split(",")]
        while todo:
            cmd = [sys.executable, os.path.abspath(__file__), "--shapes", name, "--tokens", ",".join(map(str, todo)),
                   "--iters", str(a.iters), "--date", a.date] + (["--json", a.json] if a.json else []) + \
                  (["--check-only"] if a.check_only else [])
            p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
            done = set()
            for line in p.stdout:
                print(line, end="", flush=True)
                if line.startswith(f"humming {name} T="):
                    done.add(int(line.split("T=")[1].split(":")[0]))
            if p.wait() == 0:
                break
            left = [T for T in todo if T not in done]
            bad = left[0]
            failed.append(f"{name} T={bad}")
            print(f"humming {name} T={bad}: NOT MEASURED (exit {p.returncode}; going on with a fresh process)", flush=True)
            todo = [T for T in todo if T > bad]
    if failed:
        print("humming: not measured: " + ", ".join(failed), flush=True)


if __name__ == "__main__":
    main()
