"""Benchmark of the PyTorch binding (issue 22, Speed), on a GPU:

1. eager overhead: host time per forward of the op (torch.ops.megamoe.experts) and of the module
   (MegaMoEExperts.forward, with its int64 -> int32 id conversion) minus the bare C call
   (megamoe_layer_forward through ctypes on the same pointers), enqueued without a synchronization;
2. graph kernel time: the op captured in a torch.cuda.CUDAGraph and replayed, CUDA events around
   many replays, beside `megamoe bench` on the same shape when MEGAMOE_CLI names the CLI.

    python3 examples/bench_op.py [--experts 128 --top-k 8 --hidden 2048 --inter 768] [--tokens 1,8,128,512]
                                 [--format nvfp4|bf16]
Not a test: it prints numbers (docs/BENCHMARKS.md records them).
"""
import argparse
import os
import statistics
import subprocess
import time

import torch

import megamoe
from megamoe.torch import MegaMoEExperts


def random_module(E, K, H, I, t_max, fmt, seed=0):
    g = torch.Generator().manual_seed(seed)
    m = MegaMoEExperts(num_experts=E, num_local_experts=E, experts_start_idx=0, top_k=K, hidden_size=H,
                       intermediate_size=I, num_max_tokens_per_rank=t_max, is_nvfp4=fmt == "nvfp4",
                       prefix="bench", device="cuda")
    if fmt == "nvfp4":
        def sf(*shape):  # E4M3 block scales from subnormal to normal values
            return torch.randint(0x01, 0x58, shape, generator=g, dtype=torch.uint8).view(torch.float8_e4m3fn)
        w = [("w13_weight", torch.randint(0, 256, (E, 2 * I, H // 2), generator=g, dtype=torch.uint8)),
             ("w13_weight_scale", sf(E, 2 * I, H // 16)),
             ("w13_weight_scale_2", torch.full((E, 2), 0.25 / H ** 0.5)),
             ("w13_input_scale", torch.full((E, 2), 1 / 2688)),
             ("w2_weight", torch.randint(0, 256, (E, H, I // 2), generator=g, dtype=torch.uint8)),
             ("w2_weight_scale", sf(E, H, I // 16)),
             ("w2_weight_scale_2", torch.full((E,), 0.25 / I ** 0.5)),
             ("w2_input_scale", torch.full((E,), 0.01))]
    else:
        w = [("w13_weight", (torch.randn(E, 2 * I, H, generator=g) / H ** 0.5).bfloat16()),
             ("w2_weight", (torch.randn(E, H, I, generator=g) / I ** 0.5).bfloat16())]
    list(m.load_weights(w))
    m.finalize_weights()
    return m


def inputs(T, E, K, H, seed=1):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, H, generator=g).bfloat16().cuda()
    ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)]).cuda()
    w = torch.rand(T, K, generator=g).cuda()
    return x, w, ids


def host_us(fn, calls=40, rounds=15):
    """Median host microseconds per call of fn, `calls` enqueued back to back after a synchronization."""
    per = []
    for _ in range(rounds):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        per.append((time.perf_counter() - t0) / calls * 1e6)
    torch.cuda.synchronize()
    return statistics.median(per)


def graph_ms(m, x, w, ids, replays=100):
    """Median milliseconds of one graph replay, each after writing 256 MB (more than L2 holds), as
    `megamoe bench` times its forwards."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            m(x, w, ids)
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        m(x, w, ids)
    flush = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
    for _ in range(10):
        graph.replay()
    times = []
    for _ in range(replays):
        flush.zero_()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        graph.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--experts", type=int, default=128)
    ap.add_argument("--top-k", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--inter", type=int, default=768)
    ap.add_argument("--tokens", default="1,8,128,512")
    ap.add_argument("--format", default="nvfp4", choices=["nvfp4", "bf16"])
    a = ap.parse_args()
    E, K, H, I = a.experts, a.top_k, a.hidden, a.inter
    tokens = [int(t) for t in a.tokens.split(",")]
    print(f"megamoe {megamoe.__version__}, torch {torch.__version__}, {torch.cuda.get_device_name()}; "
          f"E={E} K={K} H={H} I={I} {a.format}")
    m = random_module(E, K, H, I, max(tokens), a.format)
    layer, key = m._layer, m._layer_id
    stream = torch.cuda.current_stream().cuda_stream
    print("T      C call us   op us  module us   op-C us   graph ms   megamoe bench")
    for T in tokens:
        x, w, ids = inputs(T, E, K, H)
        ids32 = ids.int()
        y = torch.empty_like(x)
        ptrs = [(T, x.data_ptr(), ids32.data_ptr(), w.data_ptr(), 0, y.data_ptr())]
        c_us = host_us(lambda: layer.forward_ptrs(ptrs, stream))
        op_us = host_us(lambda: torch.ops.megamoe.experts(key, x, w, ids32, None))
        mod_us = host_us(lambda: m(x, w, ids))
        g_ms = graph_ms(m, x, w, ids32)
        cli = ""
        if os.environ.get("MEGAMOE_CLI"):
            p = subprocess.run([os.environ["MEGAMOE_CLI"], "bench", "--experts", str(E), "--top-k", str(K),
                                "--hidden", str(H), "--inter", str(I), "--tokens", str(T), "--format", a.format,
                                "--backend", "cuda"], capture_output=True, text=True)
            cli = " | ".join(line.strip() for line in p.stdout.splitlines()[-2:]) if p.returncode == 0 else p.stderr[-200:]
        print(f"{T:<6} {c_us:9.1f} {op_us:7.1f} {mod_us:10.1f} {op_us - c_us:9.1f} {g_ms:10.4f}   {cli}")
    m.check()


if __name__ == "__main__":
    main()
