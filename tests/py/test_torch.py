"""megamoe.torch on the CPU backend (issue 22): the MegaMoEExperts life cycle, the op megamoe::experts
(opcheck, torch.compile), errors that name argument and value, and y bitwise equal to `megamoe run` on
the same layer, within the float64 reference's bounds."""
import gc

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import mmref as mr  # noqa: E402
import torchutil as tu  # noqa: E402
from test_layer_reference import TOL, check_rows, tol_key  # noqa: E402

import megamoe  # noqa: E402
from megamoe.torch import MegaMoEExperts  # noqa: E402


def layer_case(fmt, E=8, K=4, H=256, I=256, T=40, seed=5):
    model = mr.random_model(fmt, E, H, I, seed=seed)
    x, ids, w, pad = mr.random_inputs(T, K, H, E, seed=seed + 1)
    mr.calibrate_a2(model, x, ids, pad)
    return model, x, ids, w, pad


MODES = [("nvfp4", "nvfp4"), ("nvfp4", "bf16"), ("bf16", "bf16")]  # (weights, activations: SPEC §3, §3b, §4)


@pytest.mark.parametrize("fmt,act", MODES)
def test_module_equals_cli_and_reference(tmp_path, fmt, act):
    model, x, ids, w, pad = layer_case(fmt)
    m = tu.make_module(model, K=4, t_max=64, activations=act)
    assert m.activations == act
    y = m(*tu.torch_inputs(x, ids, w, pad))
    assert y.dtype == torch.bfloat16 and tuple(y.shape) == x.shape
    y_cli = tu.cli_y(tmp_path, model, x, ids, w, pad, activations=act)
    assert tu.same_bits(y, y_cli), "the module's y differs from `megamoe run` on the same layer"
    yn = tu.numpy_of(y)
    check_rows(yn, x, ids, pad)
    ref = mr.reference_layer(model, x, ids, w, pad, gamma=model["norm"], activations=act)
    live = np.isfinite(ref).all(axis=1)
    err = mr.rel_l2(yn.astype(np.float64)[live], mr.bf16_round(ref[live]))
    tol = TOL[tol_key(fmt, act)]
    assert err <= tol, f"relative L2 {err:.2e} over {tol}"
    # int64 ids and bf16 routing weights (what models produce) are converted, same result
    y2 = m(tu.torch_of(x), tu.torch_of(w).bfloat16().float(), tu.torch_of(ids).long(), tu.torch_of(pad))
    y3 = m(tu.torch_of(x), tu.torch_of(w).bfloat16(), tu.torch_of(ids).long(), tu.torch_of(pad))
    assert tu.same_bits(y2, y3)


@pytest.mark.parametrize("style,shards", [("per_expert", 0), ("ct_stacked", 0), ("per_expert_w", 3)])
def test_from_checkpoint(tmp_path, style, shards):
    model, x, ids, w, pad = layer_case("nvfp4", seed=11)
    prefix = "model.layers.3.mlp"
    tensors = mr.checkpoint_tensors(model, prefix, style)
    if shards:
        ckpt = tmp_path / "ckpt"
        mr.st_save_sharded(ckpt, tensors, shards)
    else:
        ckpt = tmp_path / "model.safetensors"
        mr.st_save(ckpt, tensors)
    m = MegaMoEExperts.from_checkpoint(ckpt, prefix, top_k=4, num_max_tokens_per_rank=64, device="cpu",
                                       **tu.spec3_activations("nvfp4"))
    assert m.finalized and m.is_nvfp4 and m.num_experts == 8 and m.post_expert_norm is not None
    y = m(*tu.torch_inputs(x, ids, w, pad))
    assert tu.same_bits(y, tu.make_module(model, K=4, t_max=64)(*tu.torch_inputs(x, ids, w, pad)))


def test_life_cycle_parameters_memory():
    model, *_ = layer_case("nvfp4")
    m = MegaMoEExperts(num_experts=8, num_local_experts=8, experts_start_idx=0, top_k=4, hidden_size=256,
                       intermediate_size=256, post_expert_norm=None, num_max_tokens_per_rank=64, is_nvfp4=True,
                       prefix="blk", device="cpu", **tu.spec3_activations("nvfp4"))
    expect = {"w13_weight": ((8, 512, 128), torch.uint8), "w13_weight_scale": ((8, 512, 16), torch.float8_e4m3fn),
              "w13_weight_scale_2": ((8, 2), torch.float32), "w13_input_scale": ((8, 2), torch.float32),
              "w2_weight": ((8, 256, 128), torch.uint8), "w2_weight_scale": ((8, 256, 16), torch.float8_e4m3fn),
              "w2_weight_scale_2": ((8,), torch.float32), "w2_input_scale": ((8,), torch.float32)}
    params = dict(m.named_parameters())
    assert set(params) == set(expect)
    for n, (shape, dtype) in expect.items():
        assert tuple(params[n].shape) == shape and params[n].dtype == dtype, n
        assert params[n].weight_loader == m.weight_loader
    with pytest.raises(megamoe.NotFinalizedError, match=r"^blk: forward before finalize_weights\(\)"):
        m(torch.zeros(1, 256, dtype=torch.bfloat16), torch.ones(1, 4), torch.zeros(1, 4, dtype=torch.int32))
    names = []
    gen = m.load_weights(tu.module_weights(model))
    names.append(next(gen))  # a generator: loads as it is consumed
    names += list(gen)
    assert names == list(expect)
    with pytest.raises(megamoe.BadWeightError, match=r"blk: unexpected expert weight 'w3_weight'"):
        list(m.load_weights([("w3_weight", torch.zeros(8, 2))]))
    with pytest.raises(megamoe.BadWeightError, match=r"blk: expert weight 'w2_weight' shard \(8, 256, 64\) does not fit "
                                                     r"parameter \(8, 256, 128\)"):
        m.weight_loader(m.w2_weight, torch.zeros(8, 256, 64, dtype=torch.uint8), "w2_weight")
    # [E, 1] per-expert scalars load as [E]
    m.weight_loader(m.w2_input_scale, tu.torch_of(model["w2_in"]).reshape(8, 1), "w2_input_scale")
    m.finalize_weights()
    m.finalize_weights()  # idempotent
    for n in expect:
        assert getattr(m, n) is None, f"{n} kept after finalize_weights"
    assert not list(m.parameters())
    mem = m.memory()
    assert mem["checkpoint_bytes"] == 0 and mem["weight_bytes"] > 0 and mem["buffer_bytes"] > 0
    assert m.resident_bytes == mem["weight_bytes"] and m.peak_bytes >= m.resident_bytes
    # 2*I*H/2 + 2*I*H/16 + H*I/2 + H*I/16 bytes of codes and scales per expert at least
    assert mem["weight_bytes"] >= 8 * (512 * 128 + 512 * 16 + 256 * 128 + 256 * 16)


def test_local_shard_of_all_experts():
    """weight_loader copies [experts_start_idx, end): a module given a whole-model tensor keeps its slice."""
    model, *_ = layer_case("bf16")
    m = MegaMoEExperts(num_experts=8, num_local_experts=8, experts_start_idx=0, top_k=4, hidden_size=256,
                       intermediate_size=256, num_max_tokens_per_rank=8, is_nvfp4=False, device="cpu")
    full = tu.torch_of(model["w13"])
    m.weight_loader(m.w13_weight, full, "w13_weight")
    assert torch.equal(m.w13_weight.view(torch.int16), full.view(torch.int16))
    with pytest.raises(megamoe.BadWeightError, match="does not hold all 8 experts"):
        m.weight_loader(m.w13_weight, full[:4], "w13_weight")
    # without a process group the module is rank 0 of 1: it must own every expert
    with pytest.raises(megamoe.InvalidArgumentError, match="num_local_experts=4, experts_start_idx=4"):
        MegaMoEExperts(num_experts=8, num_local_experts=4, experts_start_idx=4, top_k=4, hidden_size=256,
                       intermediate_size=256, num_max_tokens_per_rank=8, is_nvfp4=False, device="cpu")


def test_sizes_refused_at_construction():
    with pytest.raises(megamoe.InvalidArgumentError, match="300"):
        MegaMoEExperts(num_experts=8, num_local_experts=8, experts_start_idx=0, top_k=2, hidden_size=300,
                       intermediate_size=256, num_max_tokens_per_rank=8, is_nvfp4=False, device="cpu")


def test_bad_inputs_raise_and_layer_keeps_working():
    model, x, ids, w, pad = layer_case("bf16", T=16)
    m = tu.make_module(model, K=4, t_max=16, prefix="L7")
    args = tu.torch_inputs(x, ids, w, pad)
    y0 = m(*args)
    X, W, ID, P = args
    cases = [
        ((X.float(), W, ID, P), megamoe.InvalidArgumentError, r"L7'?: hidden_states: dtype float32, expected bfloat16"),
        ((X[:, :128].contiguous(), W, ID, P), megamoe.InvalidArgumentError, r"hidden_states: shape \(16, 128\), expected \(16, 256\)"),
        ((X, W, ID[:, :2].contiguous(), P), megamoe.InvalidArgumentError, r"topk_ids: shape \(16, 2\), expected \(16, 4\)"),
        ((X, W, ID.float(), P), megamoe.InvalidArgumentError, "topk_ids: dtype float32, expected int32"),
        ((X, W.double(), ID, P), megamoe.InvalidArgumentError, "topk_weights: dtype float64, expected float32"),
        ((X, W, ID.t().contiguous().t(), P), megamoe.InvalidArgumentError, r"topk_ids: not contiguous \(strides \(1, 16\)\)"),
        ((X, W, ID, P[:8]), megamoe.InvalidArgumentError, r"is_padding: shape \(8,\), expected \(16,\)"),
        ((X.reshape(1, 16, 256), W, ID, P), megamoe.InvalidArgumentError, r"hidden_states \(1, 16, 256\), expected \[T, 256\]"),
        ((X.reshape(-1), W, ID, P), megamoe.InvalidArgumentError, r"hidden_states \(4096,\), expected \[T, 256\]"),
    ]
    for a, exc, msg in cases:
        with pytest.raises(exc, match=msg):
            m(*a)
    # T above the layer's maximum: both numbers named, by forward and input_buffer
    x17 = torch.zeros(17, 256, dtype=torch.bfloat16)
    with pytest.raises(megamoe.BadInputError, match="^L7: MegaMoE got 17 tokens, but the buffer was sized for 16"):
        m(x17, torch.ones(17, 4), torch.zeros(17, 4, dtype=torch.int32))
    with pytest.raises(megamoe.BadInputError, match="got 17 tokens, but the buffer was sized for 16"):
        m.input_buffer(17)
    with pytest.raises(megamoe.BadInputError, match="17 tokens"):  # the op checks too
        torch.ops.megamoe.experts(m._layer_id, x17, torch.ones(17, 4), torch.zeros(17, 4, dtype=torch.int32))
    # ids out of range: the CPU backend reports them from the forward, naming the id
    bad = ID.clone()
    bad[3, 1] = 8
    with pytest.raises(megamoe.BadInputError, match=r"\b8\b"):
        m(X, W, bad, P)
    bad[3, 1] = -2
    with pytest.raises(megamoe.BadInputError, match="-2"):
        m(X, W, bad, P)
    assert tu.same_bits(m(*args), y0), "the layer changed after bad input"
    # every error is a megamoe.Error
    assert issubclass(megamoe.BadInputError, megamoe.Error) and issubclass(megamoe.ClosedError, megamoe.Error)


def test_op_errors_name_argument_and_value():
    """The op called directly (as engines and torch.compile call it), not through the module: each bad
    input raises a megamoe.Error naming the argument and value, whether the op's own checks (what the C
    library cannot see: dtype, shape, device, contiguity) or the C library's (finalize, T, routing
    weights) find it, and the layer keeps working."""
    model, x, ids, w, pad = layer_case("bf16", T=16)
    m = tu.make_module(model, K=4, t_max=16, prefix="L8")
    X, W, ID, P = tu.torch_inputs(x, ids, w, pad)
    op, key = torch.ops.megamoe.experts, m._layer_id
    y0 = op(key, X, W, ID, P)
    assert tu.same_bits(y0, m(X, W, ID, P))
    bad_w = W.clone()
    live = (ID[:, 0] != -1) & ~P.bool()
    t = int(torch.nonzero(live)[0, 0])
    bad_w[t, 0] = float("inf")
    Inv, Bad = megamoe.InvalidArgumentError, megamoe.BadInputError
    x17, w17 = torch.zeros(17, 256, dtype=torch.bfloat16), torch.ones(17, 4)
    ids17 = torch.zeros(17, 4, dtype=torch.int32)
    cases = [
        ((10**9, X, W, ID, P), megamoe.ClosedError, "no layer with id 1000000000"),
        ((key, X, W, ID, P.int()), Inv, "L8'?: is_padding: dtype int32, expected bool or uint8"),
        ((key, X.reshape(-1), W, ID, P), Inv, r"hidden_states \(4096,\), expected \[T, 256\]"),
        ((key, X, W[:8], ID, P), Inv, r"topk_weights: shape \(8, 4\), expected \(16, 4\)"),
        ((key, X[:, ::2], W, ID, P), Inv, r"hidden_states: shape \(16, 128\), expected \(16, 256\)"),
        ((key, torch.zeros(256, 16, dtype=torch.bfloat16).t(), W, ID, P), Inv,
         r"hidden_states: not contiguous \(strides \(1, 16\)\)"),
        ((key, X, bad_w, ID, P), Bad, rf"layer 'L8'.*token {t} slot 0: topk_weights is inf"),
        ((key, x17, w17, ids17, None), Bad, "layer 'L8'.*17 tokens.*16"),
    ]
    for a, exc, msg in cases:
        with pytest.raises(exc, match=msg):
            op(*a)
    assert tu.same_bits(op(key, X, W, ID, P), y0), "the layer changed after bad input"
    # a layer not finalized: the C library refuses the forward
    raw = MegaMoEExperts(num_experts=8, num_local_experts=8, experts_start_idx=0, top_k=4, hidden_size=256,
                         intermediate_size=256, num_max_tokens_per_rank=16, is_nvfp4=False, prefix="L9", device="cpu")
    with pytest.raises(megamoe.NotFinalizedError, match="L9.*finalize"):
        op(raw._layer_id, X, W, ID, P)


def test_size_stride_checks_agree():
    """The kernel checks topk_weights' and topk_ids' sizes and strides with torch's C function
    assert_size_stride where it agrees with the Python check (found at import): both accept and refuse
    the same tensors, except that the C one passes every tensor of no elements (the kernel checks those
    sizes itself)."""
    from megamoe.torch import _op

    c_check = getattr(getattr(torch._C._dynamo, "guards", None), "assert_size_stride", None)
    if _op._size_stride is _op._python_size_stride:
        pytest.skip(f"this torch's assert_size_stride ({c_check}) is not used: the Python check runs")
    base = torch.zeros(6, 4)
    cases = [(base, (6, 4)), (base[:3], (3, 4)), (base[:1], (1, 4)), (base[::3], (2, 4)), (base[::6], (1, 4)),
             (base[:, :2], (6, 2)), (base.t(), (4, 6)), (base.t()[:1], (1, 6)), (base.reshape(24), (6, 4)),
             (base[:, :1], (6, 1)), (base.reshape(24, 1), (24, 1)), (base, (6, 3)), (base, (5, 4)), (base[:0], (0, 4))]
    for t, size in cases:
        stride = (size[1], 1)
        results = []
        for check in (c_check, _op._python_size_stride):
            try:
                results.append(bool(check(t, size, stride)))
            except AssertionError:
                results.append(False)
        assert results[0] == results[1], (tuple(t.shape), t.stride(), size, results)


@pytest.mark.parametrize("fast", [True, False])
def test_op_checks_and_allocation_with_torch_functions_or_without(monkeypatch, fast):
    """With torch's C functions for the size/stride check and y's allocation, or (a torch without them)
    the Python check and torch.empty_strided: y bitwise equal, and every bad input of topk_weights and
    topk_ids raises naming the argument, also at T = 0 (where assert_size_stride checks no sizes)."""
    from megamoe.torch import _op

    if not fast:
        monkeypatch.setattr(_op, "_size_stride", _op._python_size_stride)
        monkeypatch.setitem(_op._allocators, "cpu", _op._torch_empty_strided("cpu"))
    model, x, ids, w, pad = layer_case("bf16", T=8)
    m = tu.make_module(model, K=4, t_max=8, prefix="L10")
    X, W, ID, P = tu.torch_inputs(x, ids, w, pad)
    op, key = torch.ops.megamoe.experts, m._layer_id
    y = op(key, X, W, ID, P)
    assert tu.same_bits(y, m(X, W, ID, P)) and y.stride() == (256, 1)
    ref = mr.reference_layer(model, x, ids, w, pad, gamma=model["norm"], activations="bf16")
    check_rows(tu.numpy_of(y), x, ids, pad)
    live = np.isfinite(ref).all(axis=1)
    assert mr.rel_l2(tu.numpy_of(y).astype(np.float64)[live], mr.bf16_round(ref[live])) <= TOL[tol_key("bf16", "bf16")]
    e, e_w, e_ids = torch.zeros(0, 256, dtype=torch.bfloat16), torch.zeros(0, 4), torch.zeros(0, 4, dtype=torch.int32)
    Inv = megamoe.InvalidArgumentError
    cases = [
        ((X, W, ID[:, :3].contiguous(), P), r"L10'?: topk_ids: shape \(8, 3\), expected \(8, 4\)"),
        ((X, W[:4], ID, P), r"topk_weights: shape \(4, 4\), expected \(8, 4\)"),
        ((X, W.reshape(-1), ID, P), r"topk_weights: shape \(32,\), expected \(8, 4\)"),
        ((X, W.t().contiguous().t(), ID, P), r"topk_weights: not contiguous \(strides \(1, 8\)\)"),
        ((X, W, torch.zeros(8, 8, dtype=torch.int32)[:, ::2], P), r"topk_ids: not contiguous \(strides \(8, 2\)\)"),
        ((e, torch.zeros(0, 3), e_ids, None), r"topk_weights: shape \(0, 3\), expected \(0, 4\)"),
        ((e, e_w, torch.zeros(0, 2, dtype=torch.int32), None), r"topk_ids: shape \(0, 2\), expected \(0, 4\)"),
        ((e, e_w, e_ids.reshape(0), None), r"topk_ids: shape \(0,\), expected \(0, 4\)"),
    ]
    for a, msg in cases:
        with pytest.raises(Inv, match=msg):
            op(key, *a)
        with pytest.raises(Inv, match=msg):
            m(*a)
    assert op(key, e, e_w, e_ids).shape == (0, 256)
    assert tu.same_bits(op(key, X, W, ID, P), y), "the layer changed after bad input"


def test_op_refuses_a_layer_of_several_ranks():
    """The op passes one megamoe_forward_args: a layer of R > 1 local ranks (which reads R of them) is
    refused when registered, not run on memory past the one it is given."""
    from megamoe.torch import _op

    layer = megamoe.Layer(megamoe.Group("cpu", num_ranks=2), num_experts=8, top_k=2, hidden_size=256,
                          intermediate_size=256, max_tokens=4, format="bf16", name="two")
    with pytest.raises(megamoe.InvalidArgumentError, match="'two'.*one local rank.*2"):
        _op.register(layer)


def test_op_in_grad_mode_and_not_differentiable():
    """Inputs that require grad (a model run without torch.no_grad) give the same y; the op has no
    autograd formula, so backward through it gives no gradient: PyTorch warns or raises, naming the op
    (which of the two depends on how the op is registered and on the torch version), never a silent
    gradient."""
    model, x, ids, w, pad = layer_case("bf16", T=8)
    m = tu.make_module(model, K=4, t_max=8)
    X, W, ID, P = tu.torch_inputs(x, ids, w, pad)
    y0 = m(X, W, ID, P)
    Xg, Wg = X.clone().requires_grad_(), W.clone().requires_grad_()
    y = m(Xg, Wg, ID, P)
    assert tu.same_bits(y.detach(), y0)
    import warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            y.float().sum().backward()
            raised = None
        except RuntimeError as e:
            raised = str(e)
    said = raised or " ".join(str(c.message) for c in caught)
    assert "megamoe" in said and ("autograd" in said), said
    assert Xg.grad is None and Wg.grad is None


def test_bad_scale_raises_and_loading_again_works():
    model, x, ids, w, pad = layer_case("nvfp4", T=16)
    m = MegaMoEExperts(num_experts=8, num_local_experts=8, experts_start_idx=0, top_k=4, hidden_size=256,
                       intermediate_size=256, num_max_tokens_per_rank=16, is_nvfp4=True, prefix="Lq", device="cpu",
                       **tu.spec3_activations("nvfp4"))
    weights = dict(tu.module_weights(model))
    bad = weights["w2_weight_scale_2"].clone()
    bad[5] = float("nan")
    list(m.load_weights(list(weights.items())))
    m.weight_loader(m.w2_weight_scale_2, bad, "w2_weight_scale_2")
    with pytest.raises(megamoe.BadWeightError, match="expert 5"):
        m.finalize_weights()
    assert not m.finalized and m.w2_weight_scale_2 is not None
    m.weight_loader(m.w2_weight_scale_2, weights["w2_weight_scale_2"], "w2_weight_scale_2")
    m.finalize_weights()
    ref = tu.make_module(model, K=4, t_max=16, norm=False)
    assert tu.same_bits(m(*tu.torch_inputs(x, ids, w, pad)), ref(*tu.torch_inputs(x, ids, w, pad)))


def test_closed_group_raises():
    g = megamoe.Group("cpu")
    layer = megamoe.Layer(g, num_experts=8, top_k=2, hidden_size=256, intermediate_size=256, max_tokens=4,
                          format="bf16", name="orphan")
    g.close()
    assert layer.closed
    with pytest.raises(megamoe.ClosedError, match="layer 'orphan' is closed \\(its group was closed\\)"):
        layer.finalize()
    with pytest.raises(megamoe.ClosedError):
        megamoe.Layer(g, num_experts=8, top_k=2, hidden_size=256, intermediate_size=256, max_tokens=4, format="bf16")
    # the shared groups of megamoe.torch: closing them makes the modules raise, not crash
    model, x, ids, w, pad = layer_case("bf16", T=4)
    m = tu.make_module(model, K=4, t_max=4)
    megamoe.torch.close_groups()
    with pytest.raises(megamoe.ClosedError):
        m(*tu.torch_inputs(x, ids, w, pad))
    # a layer keeps its group alive: dropping every other reference closes nothing early
    layer = megamoe.Layer(megamoe.Group("cpu"), num_experts=8, top_k=2, hidden_size=256, intermediate_size=256,
                          max_tokens=4, format="bf16")
    gc.collect()
    assert not layer.group.closed and layer.memory()["buffer_bytes"] > 0


def test_modules_of_one_shape_share_a_group_and_buffer():
    model, x, ids, w, pad = layer_case("bf16", T=8)
    a = tu.make_module(model, K=4, t_max=8, prefix="a")
    b = tu.make_module(model, K=4, t_max=8, prefix="b")
    assert a._layer.group is b._layer.group
    assert a.memory()["buffer_bytes"] == a._layer.group.buffer_bytes(8, 8, 4, 256, 256)
    assert tu.same_bits(a(*tu.torch_inputs(x, ids, w, pad)), b(*tu.torch_inputs(x, ids, w, pad)))


def test_activations_setting():
    kw = dict(num_experts=8, num_local_experts=8, experts_start_idx=0, top_k=2, hidden_size=256, intermediate_size=256,
              num_max_tokens_per_rank=4, device="cpu")
    assert MegaMoEExperts(is_nvfp4=False, activations="bf16", **kw).activations == "bf16"
    with pytest.raises(megamoe.InvalidArgumentError, match="activations='fp8'"):
        MegaMoEExperts(is_nvfp4=True, activations="fp8", **kw)
    with pytest.raises(megamoe.Error, match="activations|ACTIVATIONS"):
        MegaMoEExperts(is_nvfp4=False, activations="nvfp4", **kw)
    # SPEC §3b: NVFP4 weights default to BF16 activations; NVFP4 activations on request
    assert MegaMoEExperts(is_nvfp4=True, **kw).activations == "bf16"
    assert MegaMoEExperts(is_nvfp4=True, activations="nvfp4", **kw).activations == "nvfp4"


def test_bf16_activations_differ_from_nvfp4_and_are_closer_to_the_weights():
    """SPEC §3b: activations='bf16' leaves x and a unquantized, so its y is closer to the float64 layer
    with unquantized activations than the NVFP4-activation layer's."""
    model, x, ids, w, pad = layer_case("nvfp4", T=32, seed=21)
    x = np.nan_to_num(x.astype(np.float32)).astype(mr.BF16)
    a16 = tu.make_module(model, K=4, t_max=32, activations="bf16")(*tu.torch_inputs(x, ids, w, pad))
    a4 = tu.make_module(model, K=4, t_max=32, activations="nvfp4")(*tu.torch_inputs(x, ids, w, pad))
    assert not tu.same_bits(a16, a4)
    bf = dict(model, format="bf16")
    bf["w13"] = mr.decode_nvfp4(model["w13"], model["w13_sf"])
    bf["w13"][:, :256] *= model["w13_s2"][:, 0, None, None]
    bf["w13"][:, 256:] *= model["w13_s2"][:, 1, None, None]
    bf["w2"] = mr.decode_nvfp4(model["w2"], model["w2_sf"]) * model["w2_s2"][:, None, None]
    ref = mr.reference_layer(bf, x, ids, w, pad, gamma=model["norm"])
    live = np.isfinite(ref).all(axis=1)
    e16 = mr.rel_l2(tu.numpy_of(a16).astype(np.float64)[live], ref[live])
    e4 = mr.rel_l2(tu.numpy_of(a4).astype(np.float64)[live], ref[live])
    assert e16 < 1e-2 and e16 < e4 / 4, (e16, e4)


def test_opcheck_cpu():
    model, x, ids, w, pad = layer_case("nvfp4", T=16)
    m = tu.make_module(model, K=4, t_max=16)
    X, W, ID, P = tu.torch_inputs(x, ids, w, pad)
    X = torch.nan_to_num(X, nan=1.0, posinf=1.0)  # opcheck compares outputs with NaN != NaN
    for args in ((m._layer_id, X, W, ID, P), (m._layer_id, X, W, ID, None), (m._layer_id, X[:0], W[:0], ID[:0], None)):
        torch.library.opcheck(torch.ops.megamoe.experts.default, args)


def test_y_is_contiguous_whatever_the_strides_of_hidden_states():
    """y is a contiguous [T, H] tensor (strides (H, 1)) for every valid hidden_states, also a one-row view
    of a larger tensor (contiguous, with any row stride), from the kernel, the module and the fake
    implementation alike (torch.compile plans y's layout from the fake one)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    model, x, ids, w, pad = layer_case("bf16", T=4)
    m = tu.make_module(model, K=4, t_max=4)
    X, W, ID, P = tu.torch_inputs(x, ids, w, pad)
    big = torch.zeros(5, 256, dtype=torch.bfloat16)
    big[0] = X[0]
    x1 = big[::5]  # [1, 256] with strides (1280, 1)
    assert x1.is_contiguous() and x1.stride() == (1280, 1)
    args = (m._layer_id, x1, W[:1], ID[:1], P[:1])
    y_op, y_mod = torch.ops.megamoe.experts(*args), m(*args[1:])
    assert y_op.stride() == y_mod.stride() == (256, 1)
    assert tu.same_bits(y_op, m(X[:1], W[:1], ID[:1], P[:1])) and tu.same_bits(y_mod, y_op)
    with FakeTensorMode() as fm:
        fy = torch.ops.megamoe.experts(m._layer_id, *(fm.from_tensor(t) for t in args[1:]))
    assert fy.shape == (1, 256) and fy.stride() == (256, 1) and fy.dtype == torch.bfloat16
    torch.library.opcheck(torch.ops.megamoe.experts.default, args)


class TwoStep(torch.nn.Module):
    """A model around the experts: scaling by 2 and the residual add are exact in bf16, so compiled and
    eager must agree bitwise."""

    def __init__(self, experts):
        super().__init__()
        self.experts = experts

    def forward(self, x, w, ids):
        return self.experts(x * 2, w, ids) + x


def test_compile_fullgraph_cpu():
    model, x, ids, w, pad = layer_case("bf16", T=16)
    net = TwoStep(tu.make_module(model, K=4, t_max=16))
    X, W, ID, _ = tu.torch_inputs(x, ids, w, None)
    X = torch.nan_to_num(X)
    eager = net(X, W, ID.long())
    torch._dynamo.reset()
    compiled = torch.compile(net, fullgraph=True)
    assert tu.same_bits(compiled(X, W, ID.long()), eager)
    x2, ids2, w2, _ = mr.random_inputs(16, 4, 256, 8, seed=99, edge_cases=False)
    X2, W2, ID2, _ = tu.torch_inputs(x2, ids2, w2, None)
    assert tu.same_bits(compiled(X2, W2, ID2.long()), net(X2, W2, ID2.long()))


def test_module_eager_path_skips_the_dispatcher_only_where_it_may(monkeypatch):
    """In eager mode the module calls the op's kernel directly (the same checks and C call, past the
    dispatcher): y bitwise equal to the op's. Inputs that require grad and tensor subclasses
    (FakeTensor) still go through the op, so autograd's and fake mode's handling stays the op's."""
    import megamoe.torch._module as mod
    from torch._subclasses.fake_tensor import FakeTensorMode

    model, x, ids, w, pad = layer_case("nvfp4", T=12)
    m = tu.make_module(model, K=4, t_max=12)
    X, W, ID, P = tu.torch_inputs(x, ids, w, pad)
    y_op = torch.ops.megamoe.experts(m._layer_id, X, W, ID, P)
    calls = []
    real = mod._experts
    monkeypatch.setattr(mod, "_experts", lambda *a: calls.append(1) or real(*a))
    assert tu.same_bits(m(X, W, ID, P), y_op) and tu.same_bits(m(X, W, ID.long(), P), y_op)
    assert calls == []  # the eager path
    y = m(X.clone().requires_grad_(), W, ID, P)
    assert calls == [1] and tu.same_bits(y.detach(), y_op)  # grad: the op
    with FakeTensorMode() as fm:
        fy = m(fm.from_tensor(X), fm.from_tensor(W), fm.from_tensor(ID), fm.from_tensor(P))
    assert calls == [1, 1] and tuple(fy.shape) == tuple(X.shape) and fy.dtype == torch.bfloat16  # fake: the op
    # The eager path raises as the op does, and the layer keeps working.
    with pytest.raises(megamoe.InvalidArgumentError, match="topk_weights"):
        m(X, W.double(), ID, P)
    assert tu.same_bits(m(X, W, ID, P), y_op)


def test_eager_calls_skip_the_dispatcher_only_where_nothing_watches_it(monkeypatch):
    """torch.ops.megamoe.experts and the module run the op's kernel directly (the same checks and C
    call, y bitwise equal) on plain tensors in eager mode, and go through PyTorch's dispatcher wherever
    something records or transforms the ops it dispatches: inputs that require grad, keyword arguments
    (the packet's own call), fake tensors, a TorchDispatchMode (which then sees megamoe.experts from the
    op and from the module alike), the profiler."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.utils._python_dispatch import TorchDispatchMode

    from megamoe.torch import _op

    class Seen(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops.append(str(func))
            return func(*args, **(kwargs or {}))

    model, x, ids, w, pad = layer_case("nvfp4", T=6)
    m = tu.make_module(model, K=4, t_max=6)
    X, W, ID, P = tu.torch_inputs(x, ids, w, pad)
    op, key = torch.ops.megamoe.experts, m._layer_id
    y0 = op.default(key, X, W, ID, P)  # the OpOverload: always the dispatcher
    through = []
    real = _op._packet_call
    monkeypatch.setattr(_op, "_packet_call", lambda *a, **k: through.append(1) or real(*a, **k))
    assert tu.same_bits(op(key, X, W, ID, P), y0) and tu.same_bits(m(X, W, ID, P), y0)
    Xg = X.clone().requires_grad_()
    with torch.no_grad():
        assert tu.same_bits(op(key, Xg, W, ID, P), y0)  # no gradient to record
    assert through == []
    assert tu.same_bits(op(key, X, W, ID, is_padding=P), y0) and len(through) == 1
    assert tu.same_bits(op(key, Xg, W, ID, P).detach(), y0) and len(through) == 2
    with FakeTensorMode() as fm:
        fy = op(key, *(fm.from_tensor(t) for t in (X, W, ID, P)))
    assert len(through) == 3 and tuple(fy.shape) == tuple(X.shape)
    with Seen() as seen:
        y_op, y_mod = op(key, X, W, ID, P), m(X, W, ID, P)
    assert len(through) == 4 and seen.ops.count("megamoe.experts.default") == 2, seen.ops
    assert tu.same_bits(y_op, y0) and tu.same_bits(y_mod, y0)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        y = op(key, X, W, ID, P)
    assert len(through) == 5 and tu.same_bits(y, y0)
    assert any(e.name == "megamoe::experts" for e in prof.events())
    # errors are the same on both paths
    for call in (op, op.default):
        with pytest.raises(megamoe.InvalidArgumentError, match="topk_weights: dtype float64"):
            call(key, X, W.double(), ID, P)


def test_empty_forward():
    model, *_ = layer_case("bf16", T=1)
    m = tu.make_module(model, K=4, t_max=4)
    y = m(torch.zeros(0, 256, dtype=torch.bfloat16), torch.zeros(0, 4), torch.zeros(0, 4, dtype=torch.int32))
    assert tuple(y.shape) == (0, 256)


def test_readme_python_section_runs(capsys):
    """The README's "Python" section: its code block runs and prints what it says."""
    import os
    import re

    readme = open(os.path.join(os.path.dirname(__file__), "..", "..", "README.md")).read()
    section = readme.split("## Python", 1)[1].split("\n## ", 1)[0]
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    assert len(code.strip().splitlines()) <= 12
    exec(compile(code, "README.md", "exec"), {})
    assert capsys.readouterr().out.strip().startswith("torch.Size([16, 256]) torch.bfloat16")


@pytest.mark.parametrize("idle", [[], ["--idle"]], ids=["back_to_back", "idle"])
def test_bench_op_runs_on_the_cpu(idle):
    """examples/bench_op.py (the binding's benchmark, run on the GPU machine by bench/device/check_py.sh) runs
    on the CPU backend and prints a row of positive host times (C call, op, module) per token count,
    with its calls enqueued back to back or each timed alone (--idle)."""
    import os
    import subprocess
    import sys

    root = os.path.join(os.path.dirname(__file__), "..", "..")
    env = dict(os.environ)
    if os.environ.get("MEGAMOE_LIBRARY"):  # the package of this source tree, as torchutil imports it
        env["PYTHONPATH"] = os.pathsep.join([os.path.join(root, "python"), os.environ.get("PYTHONPATH", "")])
    p = subprocess.run([sys.executable, os.path.join(root, "examples", "bench_op.py"), "--device", "cpu",
                        "--rounds", "2", "--calls", "20", "--tokens", "0,1"] + idle,
                       capture_output=True, text=True, env=env, timeout=300)
    assert p.returncode == 0, p.stderr[-2000:]
    lines = p.stdout.splitlines()
    assert lines[1].split()[:7] == ["T", "C", "call", "us", "op", "us", "module"], p.stdout
    rows = [line.split() for line in lines[2:]]
    assert [r[0] for r in rows] == ["0", "1"], p.stdout
    for r in rows:  # (their differences are noise-sized here: 2 rounds on a shared CPU)
        assert all(float(v) > 0 for v in r[1:4]), p.stdout
