"""Benchmark of the PyTorch binding (issue 22, Speed), on a GPU or, for the host-side part, on the CPU:

1. eager overhead: host time per forward of the op (torch.ops.megamoe.experts) and of the module
   (MegaMoEExperts.forward with int64 ids, as torch.topk gives them, which it converts to int32; and
   with int32 ids, "mod(i32)") minus the bare C call (megamoe_layer_forward through ctypes on a
   ForwardArgs filled once), enqueued without a synchronization. The four are timed in turn within
   each round; on CUDA the columns are the rounds' medians and the differences the medians of the
   per-round differences (a load that drifts between rounds cancels), on the CPU the fastest round of
   each and their differences (the rounds least disturbed by other processes on a shared machine);
2. graph kernel time (CUDA only): the op captured in a torch.cuda.CUDAGraph and replayed, CUDA events
   around many replays, beside `megamoe bench` on the same shape when MEGAMOE_CLI names the CLI.

    python3 examples/bench_op.py [--experts 128 --top-k 8 --hidden 2048 --inter 768] [--tokens 1,8,128,512]
                                 [--format nvfp4|bf16] [--device cuda|cpu]
With --device cpu the layer runs the CPU backend and the sizes default to a tiny layer (E=8 K=2
H=256 I=256) at T=0, where the C call does little more than check its arguments and the binding's host
time shows (the op and the module run the same Python at T=0 as at any T; at T=1 the CPU forward
already takes ~0.1 ms, whose noise on a shared machine hides a few µs), timed with this thread's CPU
time (--clock, --stat).
Not a test: it prints numbers (docs/BENCHMARKS.md and docs/PYTHON.md record them).
"""
import argparse
import ctypes
import os
import statistics
import subprocess
import time

import torch

import megamoe
from megamoe import _capi
from megamoe.torch import MegaMoEExperts

DEFAULTS = {"cuda": dict(experts=128, top_k=8, hidden=2048, inter=768, tokens="1,8,128,512"),
            "cpu": dict(experts=8, top_k=2, hidden=256, inter=256, tokens="0")}


def random_module(E, K, H, I, t_max, fmt, device, seed=0):
    g = torch.Generator().manual_seed(seed)
    m = MegaMoEExperts(num_experts=E, num_local_experts=E, experts_start_idx=0, top_k=K, hidden_size=H,
                       intermediate_size=I, num_max_tokens_per_rank=t_max, is_nvfp4=fmt == "nvfp4",
                       prefix="bench", device=device)
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


def inputs(T, E, K, H, device, seed=1):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, H, generator=g).bfloat16()
    ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)]) if T else torch.zeros(0, K).long()
    w = torch.rand(T, K, generator=g)
    return x.to(device), w.to(device), ids.to(device)


def sync(device):
    if device == "cuda":
        torch.cuda.synchronize()


def host_us(fns, device, calls, rounds, clock, stat, idle=False):
    """Host microseconds per call of each fn: per round, `calls` calls of each fn in turn, enqueued back
    to back after a synchronization (idle: each call timed alone after its own synchronization, so that
    every launch finds the GPU idle and no backlog of launches builds where the GPU's time per forward
    exceeds the host's). stat "median": the rounds' medians, and the median per-round difference of each
    fn to the first; "min": the fastest round of each, and their differences."""
    per = [[] for _ in fns]
    for _ in range(rounds):
        for i, fn in enumerate(fns):
            sync(device)
            if idle:
                total = 0.0
                for _ in range(calls):
                    sync(device)
                    t0 = clock()
                    fn()
                    total += clock() - t0
                per[i].append(total / calls * 1e6)
                continue
            t0 = clock()
            for _ in range(calls):
                fn()
            per[i].append((clock() - t0) / calls * 1e6)
    sync(device)
    if stat == "min":
        best = [min(p) for p in per]
        return best, [b - best[0] for b in best]
    medians = [statistics.median(p) for p in per]
    diffs = [statistics.median(a - b for a, b in zip(p, per[0])) for p in per]
    return medians, diffs


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
    ap.add_argument("--experts", type=int)
    ap.add_argument("--top-k", type=int)
    ap.add_argument("--hidden", type=int)
    ap.add_argument("--inter", type=int)
    ap.add_argument("--tokens")
    ap.add_argument("--format", default="nvfp4", choices=["nvfp4", "bf16"])
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--calls", type=int, help="calls per round (default 40 on CUDA, 400 on the CPU)")
    ap.add_argument("--rounds", type=int, help="rounds (default 41 on CUDA, 31 on the CPU)")
    ap.add_argument("--clock", choices=["wall", "thread"],
                    help="wall: time.perf_counter (the default on CUDA); thread: this thread's CPU time, "
                         "time.thread_time (the default on the CPU: it leaves out the time the thread waits "
                         "for a core on a shared machine)")
    ap.add_argument("--stat", choices=["median", "min"],
                    help="median of the rounds (the default on CUDA) or the fastest round (the default on the "
                         "CPU: the round least disturbed by other processes)")
    ap.add_argument("--idle", action="store_true",
                    help="time each call alone after a synchronization (the GPU idle at every launch) instead "
                         "of enqueuing a round's calls back to back")
    a = ap.parse_args()
    dev = a.device
    for k, v in DEFAULTS[dev].items():
        if getattr(a, k) is None:
            setattr(a, k, v)
    calls = a.calls or (40 if dev == "cuda" else 400)
    clock_name = a.clock or ("wall" if dev == "cuda" else "thread")
    clock = time.perf_counter if clock_name == "wall" else time.thread_time
    stat = a.stat or ("median" if dev == "cuda" else "min")
    rounds = a.rounds or (41 if dev == "cuda" else 31)
    E, K, H, I = a.experts, a.top_k, a.hidden, a.inter
    tokens = [int(t) for t in a.tokens.split(",")]
    if dev == "cpu":
        torch.set_num_threads(1)
    where = torch.cuda.get_device_name() if dev == "cuda" else "CPU backend (host time only)"
    print(f"megamoe {megamoe.__version__}, torch {torch.__version__}, {where}; E={E} K={K} H={H} I={I} {a.format}; "
          f"{clock_name} clock, {stat} of {rounds} rounds of {calls} calls{', each after a synchronization' if a.idle else ''}")
    m = random_module(E, K, H, I, max(max(tokens), 1), a.format, dev)
    handle, key = m._layer._handle, m._layer_id
    stream = ctypes.c_void_p(torch.cuda.current_stream().cuda_stream if dev == "cuda" else None)
    forward = _capi.lib.megamoe_layer_forward
    op = torch.ops.megamoe.experts
    print("T      C call us   op us  module us   op-C us  module-C us  mod(i32)-C us   graph ms   megamoe bench")
    for T in tokens:
        x, w, ids = inputs(T, E, K, H, dev)
        ids32 = ids.int()
        y = torch.empty_like(x)
        args = _capi.ForwardArgs(T, x.data_ptr(), ids32.data_ptr(), w.data_ptr(), None, y.data_ptr())
        args_ref = ctypes.byref(args)

        def c_call():
            if forward(handle, args_ref, stream):
                raise megamoe.Error(_capi.lib.megamoe_layer_last_error(handle).decode())

        (c_us, op_us, mod_us, _), (_, op_c, mod_c, mod32_c) = host_us(
            [c_call, lambda: op(key, x, w, ids32, None), lambda: m(x, w, ids), lambda: m(x, w, ids32)], dev, calls,
            rounds, clock, stat, a.idle)
        g_ms = f"{graph_ms(m, x, w, ids32):10.4f}" if dev == "cuda" else f"{'-':>10}"
        cli = ""
        if os.environ.get("MEGAMOE_CLI") and dev == "cuda":
            p = subprocess.run([os.environ["MEGAMOE_CLI"], "bench", "--experts", str(E), "--top-k", str(K),
                                "--hidden", str(H), "--inter", str(I), "--tokens", str(T), "--format", a.format,
                                "--backend", "cuda"], capture_output=True, text=True)
            cli = " | ".join(line.strip() for line in p.stdout.splitlines()[-2:]) if p.returncode == 0 else p.stderr[-200:]
        print(f"{T:<6} {c_us:9.1f} {op_us:7.1f} {mod_us:10.1f} {op_c:9.1f} {mod_c:12.1f} {mod32_c:13.1f} {g_ms}"
              f"   {cli}")
    m.check()


if __name__ == "__main__":
    main()
