"""megamoe.torch on the CUDA backend (issue 22): the module against the float64 reference, opcheck,
torch.compile(fullgraph=True), CUDA graph capture and replay on new inputs bitwise equal to eager, ids
out of range reported by check() without a host sync, R ranks on one GPU bitwise equal to one rank.
Skipped (shown as skipped by ctest) without a GPU the library's CUDA backend can use.
On the GPU machine: MEGAMOE_LIBRARY=.../libmegamoe.so MEGAMOE_CLI=.../megamoe python3 -m pytest -rs tests/py/test_torch_gpu.py
"""
import numpy as np
import pytest

torch = pytest.importorskip("torch")

import mmref as mr  # noqa: E402
import torchutil as tu  # noqa: E402
from test_layer_reference import check_rows  # noqa: E402

import megamoe  # noqa: E402

pytestmark = pytest.mark.skipif(not tu.cuda_gpu(), reason="no GPU for the CUDA backend: GPU tests not run")

from test_multi_gpu import TOL_GPU  # noqa: E402  (the GPU's bounds against the float64 reference)
from test_layer_reference import tol_key  # noqa: E402

MODES = [("nvfp4", "nvfp4"), ("nvfp4", "bf16"), ("bf16", "bf16")]  # (weights, activations)
DEV = "cuda"


def case(fmt, E=16, K=4, H=512, I=256, T=48, seed=7, edge=True):
    model = mr.random_model(fmt, E, H, I, seed=seed)
    x, ids, w, pad = mr.random_inputs(T, K, H, E, seed=seed + 1, edge_cases=edge)
    mr.calibrate_a2(model, x, ids, pad)
    return model, x, ids, w, pad


def new_inputs(T, K, H, E, seed):
    x, ids, w, pad = mr.random_inputs(T, K, H, E, seed=seed, edge_cases=False)
    return tu.torch_inputs(x, ids, w, pad, DEV)


@pytest.mark.parametrize("fmt,act", MODES)
def test_cuda_module_against_reference(fmt, act):
    model, x, ids, w, pad = case(fmt)
    m = tu.make_module(model, K=4, t_max=64, device=DEV, activations=act)
    y = m(*tu.torch_inputs(x, ids, w, pad, DEV))
    m.check()
    assert y.is_cuda and y.dtype == torch.bfloat16
    yn = tu.numpy_of(y)
    check_rows(yn, x, ids, pad)
    ref = mr.reference_layer(model, x, ids, w, pad, gamma=model["norm"], activations=act)
    live = np.isfinite(ref).all(axis=1)
    err = mr.rel_l2(yn.astype(np.float64)[live], mr.bf16_round(ref[live]))
    tol = TOL_GPU[tol_key(fmt, act)]
    print(f"rel_l2 {fmt} activations {act} cuda: {err:.2e}")
    assert err <= tol, f"relative L2 {err:.2e} over {tol}"
    mem = m.memory()
    assert mem["checkpoint_bytes"] == 0 and mem["weight_bytes"] > 0


@pytest.mark.parametrize("fmt", ["nvfp4", "bf16"])
def test_opcheck_cuda(fmt):
    model, x, ids, w, pad = case(fmt, T=32)
    m = tu.make_module(model, K=4, t_max=32, device=DEV)
    X, W, ID, P = tu.torch_inputs(x, ids, w, pad, DEV)
    X = torch.nan_to_num(X, nan=1.0, posinf=1.0)  # opcheck compares outputs with NaN != NaN
    torch.library.opcheck(torch.ops.megamoe.experts.default, (m._layer_id, X, W, ID, P))
    torch.library.opcheck(torch.ops.megamoe.experts.default, (m._layer_id, X, W, ID, None))


@pytest.mark.parametrize("fmt,act", MODES)
def test_cuda_graph_replay_equals_eager(fmt, act):
    E, K, H, T = 16, 4, 512, 40
    model, *_ = case(fmt, T=T)
    m = tu.make_module(model, K=K, t_max=64, device=DEV, activations=act)
    sx, sw, sid, sp = new_inputs(T, K, H, E, seed=100)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):  # warm up on a side stream, as torch's graph docs ask
        for _ in range(2):
            m(sx, sw, sid, sp)
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        sy = m(sx, sw, sid, sp)
    for seed in (101, 102, 103):
        x, w, ids, pad = new_inputs(T, K, H, E, seed=seed)
        pad[::7] = True
        sx.copy_(x), sw.copy_(w), sid.copy_(ids), sp.copy_(pad)
        g.replay()
        eager = m(x, w, ids, pad)
        torch.cuda.synchronize()
        assert tu.same_bits(sy, eager), f"graph replay differs from eager (inputs seed {seed})"
        assert torch.isfinite(eager.float()).all() and eager.float().abs().sum() > 0


class Net(torch.nn.Module):
    def __init__(self, experts):
        super().__init__()
        self.experts = experts

    def forward(self, x, w, ids):
        return self.experts(x * 2, w, ids) + x  # exact in bf16: compiled == eager bitwise


def test_compile_fullgraph_cuda_and_in_graph():
    E, K, H, T = 16, 4, 512, 33
    model, *_ = case("nvfp4", T=T)
    net = Net(tu.make_module(model, K=K, t_max=64, device=DEV))
    torch._dynamo.reset()
    compiled = torch.compile(net, fullgraph=True)
    for seed in (200, 201):
        x, w, ids, _ = new_inputs(T, K, H, E, seed=seed)
        assert tu.same_bits(compiled(x, w, ids.long()), net(x, w, ids.long()))
    # the "reduce-overhead" mode replays CUDA graphs of the compiled model
    torch._dynamo.reset()
    ro = torch.compile(net, fullgraph=True, mode="reduce-overhead")
    for seed in (210, 211, 212, 213):
        x, w, ids, _ = new_inputs(T, K, H, E, seed=seed)
        got = ro(x, w, ids.long()).clone()
        assert tu.same_bits(got, net(x, w, ids.long()))


def test_bad_ids_reported_by_check_without_sync():
    model, x, ids, w, pad = case("bf16", T=16, edge=False)
    m = tu.make_module(model, K=4, t_max=16, device=DEV)
    X, W, ID, P = tu.torch_inputs(x, ids, w, pad, DEV)
    y0 = m(X, W, ID, P)
    bad = ID.clone()
    bad[2, 3] = 1000
    torch.cuda.set_sync_debug_mode("error")  # the op must not synchronize the host
    try:
        m(X, W, bad, P)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    with pytest.raises(megamoe.BadInputError, match="1000"):
        m.check()
    assert tu.same_bits(m(X, W, ID, P), y0), "the layer changed after bad ids"
    m.check()


@pytest.mark.parametrize("value", [2**32 + 1, -2**40, 16])
def test_int64_ids_past_int32_reported_by_check_with_their_value(value):
    """int64 ids (vLLM's router gives them) are narrowed on the device without a host sync; an id past
    int32 stays a bad id (it does not wrap onto an expert), and check() names its real value."""
    model, x, ids, w, pad = case("bf16", T=16, edge=False)
    m = tu.make_module(model, K=4, t_max=16, device=DEV)
    X, W, ID, P = tu.torch_inputs(x, ids, w, pad, DEV)
    y0 = m(X, W, ID, P)
    bad = ID.long()
    bad[2, 3] = value
    torch.cuda.set_sync_debug_mode("error")
    try:
        op = torch.ops.megamoe.experts
        op(m._layer_id, X, W.bfloat16().float(), bad, P)
        op.default(m._layer_id, X, W.bfloat16(), bad, P)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    with pytest.raises(megamoe.BadInputError, match=f"token 2 slot 3: expert id {value} is outside"):
        m.check()
    assert tu.same_bits(m(X, W, ID.long(), P), y0)
    m.check()


def test_forwards_on_two_streams_do_not_share_the_buffer_at_once():
    """Two modules of one shape (one buffer, SPEC §7) called on two CUDA streams without any
    synchronization between them: the second stream waits for the first (docs/PYTHON.md, Threads),
    so each y is the one a lone call gives."""
    model_a, x, ids, w, pad = case("nvfp4", T=48, seed=7)
    model_b, *_ = case("nvfp4", T=48, seed=9)
    a, b = tu.make_module(model_a, K=4, t_max=64, device=DEV), tu.make_module(model_b, K=4, t_max=64, device=DEV)
    args = tu.torch_inputs(x, ids, w, pad, DEV)
    want_a, want_b = a(*args), b(*args)
    torch.cuda.synchronize()
    s1, s2 = torch.cuda.Stream(), torch.cuda.Stream()
    ys = []
    for _ in range(20):
        with torch.cuda.stream(s1):
            ya = a(*args)
        with torch.cuda.stream(s2):
            yb = b(*args)
        ys.append((ya, yb))
    torch.cuda.synchronize()
    for ya, yb in ys:
        assert tu.same_bits(ya, want_a) and tu.same_bits(yb, want_b)


def test_cuda_op_eager_path_equals_the_dispatcher():
    """On CUDA, torch.ops.megamoe.experts called eagerly on plain tensors (its kernel without the
    dispatcher) and through the dispatcher (the OpOverload) give the same y bitwise, contiguous on the
    layer's device, enqueued on the current stream without a host synchronization."""
    model, x, ids, w, pad = case("nvfp4", T=24, edge=False)
    m = tu.make_module(model, K=4, t_max=24, device=DEV)
    X, W, ID, P = tu.torch_inputs(x, ids, w, pad, DEV)
    op, key = torch.ops.megamoe.experts, m._layer_id
    y_disp = op.default(key, X, W, ID, P)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    torch.cuda.set_sync_debug_mode("error")  # the op must not synchronize the host
    try:
        with torch.cuda.stream(s):
            y_fast, y_mod = op(key, X, W, ID, P), m(X, W, ID.long(), P)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    s.synchronize()
    for y in (y_fast, y_mod):
        assert y.device == X.device and y.dtype == torch.bfloat16 and y.stride() == (X.shape[1], 1)
        assert tu.same_bits(y, y_disp)
    m.check()


def test_cuda_input_errors():
    model, x, ids, w, pad = case("bf16", T=8, edge=False)
    m = tu.make_module(model, K=4, t_max=8, device=DEV)
    X, W, ID, P = tu.torch_inputs(x, ids, w, pad, DEV)
    with pytest.raises(megamoe.InvalidArgumentError, match="hidden_states: on device cpu, the layer runs on cuda:0"):
        m(X.cpu(), W, ID, P)
    with pytest.raises(megamoe.InvalidArgumentError, match="topk_ids: on device cpu"):
        m(X, W, ID.cpu(), P)
    with pytest.raises(megamoe.InvalidArgumentError, match="not contiguous"):
        m(torch.zeros(512, 8, dtype=torch.bfloat16, device=DEV).t(), W, ID, P)
    # contiguous but 2 bytes past a 16-byte boundary: the kernels read x 16 bytes at a time
    T, H = X.shape
    buf = torch.zeros(T * H + 1, dtype=torch.bfloat16, device=DEV)
    with pytest.raises(megamoe.InvalidArgumentError, match=r"hidden_states at address 0x\w+ is not 16-byte aligned"):
        m(buf[1:].view(T, H), W, ID, P)
    assert m(buf[1:1].view(0, H), W[:0], ID[:0], None).shape == (0, H)  # no tokens: nothing is read
    m(X, W, ID, P)  # still works


@pytest.mark.parametrize("R", [2, 4])
def test_ranks_on_one_gpu_equal_one_rank(R):
    """The CUDA backend with R ranks in this process (expert parallelism on one GPU): each rank's y
    bitwise equal to the one-rank layer's rows for the same tokens (SPEC §5: y does not depend on R)."""
    E, K, H, I, T = 16, 4, 512, 256, 37
    for fmt in ("nvfp4", "bf16"):
        model, x, ids, w, pad = case(fmt, E=E, K=K, H=H, I=I, T=T, seed=40 + R)
        X, W, ID, P = tu.torch_inputs(x, ids, w, pad, DEV)
        X = torch.nan_to_num(X)

        def run(ranks, chunks):
            g = megamoe.Group("cuda", num_ranks=ranks, device=torch.cuda.current_device())
            layer = megamoe.Layer(g, num_experts=E, top_k=K, hidden_size=H, intermediate_size=I, max_tokens=T,
                                  format=fmt, name=f"R{ranks}")
            for name, t in tu.module_weights(model):
                layer.load_weight(name, t)
            layer.load_norm_weight(tu.torch_of(model["norm"]))
            layer.finalize()
            ys = [torch.empty(len(c), H, dtype=torch.bfloat16, device=DEV) for c in chunks]
            parts = [(X[c].contiguous(), ID[c].contiguous(), W[c].contiguous(), P[c].contiguous()) for c in chunks]
            layer.forward_ptrs([(len(c), p[0].data_ptr(), p[1].data_ptr(), p[2].data_ptr(), p[3].data_ptr(),
                                 y.data_ptr()) for c, p, y in zip(chunks, parts, ys)],
                               torch.cuda.current_stream().cuda_stream)
            layer.check()
            torch.cuda.synchronize()
            out = torch.cat(ys)
            g.close()
            return out

        y1 = run(1, [torch.arange(T)])
        bounds = np.linspace(0, T, R + 1).astype(int)
        chunks = [torch.arange(bounds[r], bounds[r + 1]) for r in range(R)]
        yR = run(R, chunks)
        assert tu.same_bits(yR, y1), f"{fmt}: R={R} ranks on one GPU differ from one rank"
