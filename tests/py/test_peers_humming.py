"""The routing that bench/peers/humming_moe.py builds for Humming's indexed MoE GEMMs, on the CPU (no GPU,
no Humming): moe_align against a plain per-expert reference, and each GEMM's routing read the way
Humming's kernel reads it (its scheduler: block b's rows at sorted_ids[b*M:(b+1)*M], its expert at
expert_ids[b], ceil(ntp / M) blocks, M the kernel's own M tile) computing every slot once with its
own expert; and HummingMoE.forward on a torch stand-in for Humming's GEMMs that reads its routing so,
against a plain MoE."""
import json
import math
import types
import os
import sys

import pytest

torch = pytest.importorskip("torch")

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "bench", "peers"))
import humming_moe as hm  # noqa: E402


def routing_ids(T, K, E, seed, experts=None):
    """[T, K] i32, K distinct experts per token, drawn from `experts` (all E when None)."""
    g = torch.Generator().manual_seed(seed)
    pool = torch.arange(E) if experts is None else torch.tensor(experts)
    pick = torch.rand(T, len(pool), generator=g).topk(K, dim=1).indices
    return pool[pick].to(torch.int32)


def plain_align(ids, E, bs):
    """The routing by loops: per expert in order its slots ascending, padded with T*K to a multiple of bs."""
    flat = ids.reshape(-1).tolist()
    tk = len(flat)
    rows, experts = [], []
    for e in range(E):
        mine = [s for s in range(tk) if flat[s] == e]
        blocks = math.ceil(len(mine) / bs)
        rows += mine + [tk] * (blocks * bs - len(mine))
        experts += [e] * blocks
    return rows, experts


def kernel_pairs(sorted_ids, expert_ids, ntp, block_m, tk, E):
    """(slot, expert) for every row Humming's indexed kernel with M tile block_m computes from this routing;
    raises IndexError where it would read past a routing tensor or use an expert outside 0..E-1."""
    sorted_ids, expert_ids, ntp = sorted_ids.tolist(), expert_ids.tolist(), int(ntp[0])
    pairs = []
    for b in range(math.ceil(ntp / block_m)):
        if b >= len(expert_ids) or (b + 1) * block_m > len(sorted_ids):
            raise IndexError(f"block {b} reads past the routing tensors")
        e = expert_ids[b]
        if not 0 <= e < E:
            raise IndexError(f"block {b} has expert {e}")
        pairs += [(s, e) for s in sorted_ids[b * block_m:(b + 1) * block_m] if s < tk]
    return sorted(pairs)


def want_pairs(ids):
    return [(s, e) for s, e in enumerate(ids.reshape(-1).tolist())]


CASES = [  # T, K, E, bs, experts used (None: all)
    (4, 2, 8, 8, None), (64, 2, 8, 24, None), (64, 2, 8, 32, None), (512, 8, 128, 48, None),
    (512, 8, 128, 40, None), (3, 8, 128, 72, None), (1, 8, 256, 8, None), (50, 3, 16, 16, [0, 5, 15]),
    (200, 2, 8, 96, [2, 3]),
]


@pytest.mark.parametrize("T,K,E,bs,experts", CASES)
def test_moe_align_matches_plain_reference(T, K, E, bs, experts):
    ids = routing_ids(T, K, E, seed=T * 31 + bs, experts=experts)
    sorted_ids, expert_ids, ntp = hm.moe_align(ids, E, bs)
    rows, experts_ref = plain_align(ids, E, bs)
    n = int(ntp[0])
    assert n == len(rows) and n % bs == 0
    assert sorted_ids[:n].tolist() == rows
    assert expert_ids[:n // bs].tolist() == experts_ref
    assert (sorted_ids[n:] == T * K).all() and (expert_ids[n // bs:] == -1).all()
    # Room for any routing of T*K slots over E experts: each used expert adds at most bs - 1 pad rows.
    assert len(sorted_ids) % bs == 0 and len(sorted_ids) >= T * K + min(E, T * K) * (bs - 1)
    assert len(expert_ids) * bs == len(sorted_ids)
    assert kernel_pairs(sorted_ids, expert_ids, ntp, bs, T * K, E) == want_pairs(ids)


def tuning(*ranges):
    """A tuning list [[lo, hi, config], ...] from (lo, hi, M tile) triples, the last one unbounded."""
    out = [[lo, hi, {"block_shape": [m, 256, 64]}] for lo, hi, m in ranges]
    out[-1][1] = 1 << 30
    return out


# Humming 0.1.20's H200 tuning lists (indexed GEMM, NVFP4 weights, BF16 activations), shortened around
# M = T*K where the gate/up and the down kernels' M tiles differ: Mixtral-like T = 64 (M = 128: 24 and
# 32) and Qwen3-30B-like T = 512 (M = 4096: 48 and 40), where the harness's y was wrong / Humming faulted.
MIXTRAL = {"w13": tuning((0, 48, 8), (48, 96, 16), (96, 152, 24), (152, 208, 32), (208, 0, 40)),
           "w2": tuning((0, 48, 8), (48, 96, 16), (96, 120, 24), (120, 136, 32), (136, 0, 40))}
QWEN3 = {"w13": tuning((0, 808, 8), (808, 4064, 40), (4064, 4864, 48), (4864, 0, 56)),
         "w2": tuning((0, 808, 8), (808, 4096, 40), (4096, 5056, 48), (5056, 0, 56))}


@pytest.mark.parametrize("T,K,E,tunings,tiles", [
    (64, 2, 8, MIXTRAL, {"w13": 24, "w2": 32}),
    (512, 8, 128, QWEN3, {"w13": 48, "w2": 40}),
    (4, 2, 8, MIXTRAL, {"w13": 8, "w2": 8}),
])
def test_each_gemm_routing_fits_its_kernel(T, K, E, tunings, tiles):
    ids = routing_ids(T, K, E, seed=T)
    route = hm.gemm_routing(ids, E, tunings, T * K)
    for name, (bs, sorted_ids, expert_ids, ntp) in route.items():
        block_m = hm.tuning_block_m(tunings[name], T * K)  # the kernel the launcher runs at M = T*K
        assert bs == block_m == tiles[name]
        assert kernel_pairs(sorted_ids, expert_ids, ntp, block_m, T * K, E) == want_pairs(ids), name
    if tiles["w13"] == tiles["w2"]:  # one align serves both
        assert route["w13"][1] is route["w2"][1]


def test_routing_for_another_tile_is_caught():
    """Routing padded to the gate/up kernel's tile, read by the down kernel (one align for both, the
    harness before gemm_routing): Mixtral-like T = 64 computes slots with the wrong expert; Qwen3-like
    T = 512 reaches blocks of expert -1 (on the GPU an illegal memory access)."""
    ids = routing_ids(64, 2, 8, seed=64)
    sid, eid, ntp = hm.moe_align(ids, 8, 24)
    assert kernel_pairs(sid, eid, ntp, 32, 128, 8) != want_pairs(ids)
    ids = routing_ids(512, 8, 128, seed=512)
    sid, eid, ntp = hm.moe_align(ids, 128, 48)
    with pytest.raises(IndexError, match="expert -1"):
        kernel_pairs(sid, eid, ntp, 40, 4096, 128)


def test_tuning_block_m_ranges():
    t = tuning((0, 8, 8), (8, 96, 16), (96, 0, 24))
    assert [hm.tuning_block_m(t, m) for m in (1, 8, 9, 96, 97, 1 << 20)] == [8, 8, 16, 16, 24, 24]
    t[-1][1] = 0  # hi <= 0: up to 1 << 30, as in Humming's launcher
    assert hm.tuning_block_m(t, 1 << 30) == 24
    with pytest.raises(ValueError, match="M = 0"):
        hm.tuning_block_m(t, 0)


class StandInMethod:
    """Humming's HummingMethod as HummingMoE calls it, in torch: the indexed GEMM with the M tile its
    tuning list gives at valid_shape_m, reading the routing as kernel_pairs does; dense f32 weights."""

    @staticmethod
    def may_quant_input(layer, inputs, sublayer_name):
        return inputs, None

    @staticmethod
    def forward_layer(layer, inputs, input_scale, outputs, sublayer_name, sorted_ids, expert_ids,
                      num_tokens_padded, top_k, valid_shape_m, compute_config, tuning_config):
        weight = getattr(layer, sublayer_name)
        block_m = hm.tuning_block_m(json.loads(tuning_config), valid_shape_m)
        E = weight.shape[0]
        for s, e in kernel_pairs(sorted_ids, expert_ids, num_tokens_padded, block_m, outputs.shape[0], E):
            outputs[s] = (weight[e] @ inputs[s // top_k].float()).to(outputs.dtype)


def stand_in_moe(E, H, I, tunings, seed):
    moe = object.__new__(hm.HummingMoE)
    g = torch.Generator().manual_seed(seed)
    moe.M, moe.E, moe.I, moe.H = StandInMethod, E, I, H
    moe.layer = types.SimpleNamespace(w13=torch.randn(E, 2 * I, H, generator=g) / H ** 0.5,
                                      w2=torch.randn(E, H, I, generator=g) / I ** 0.5)
    moe.compute, moe.tuning = "{}", tunings
    moe.tuning_str = {name: json.dumps(t) for name, t in tunings.items()}
    return moe


def plain_moe(moe, x, ids, weights):
    y = torch.zeros(x.shape[0], moe.H)
    for t in range(x.shape[0]):
        for k in range(ids.shape[1]):
            e = int(ids[t, k])
            gu = (moe.layer.w13[e] @ x[t].float()).to(torch.bfloat16).float()
            a = (torch.nn.functional.silu(gu[:moe.I]) * gu[moe.I:]).to(torch.bfloat16).float()
            y[t] += weights[t, k] * (moe.layer.w2[e] @ a).to(torch.bfloat16).float()
    return y


@pytest.mark.parametrize("T,K,E,tunings", [(64, 2, 8, MIXTRAL), (512, 8, 128, QWEN3), (4, 2, 8, MIXTRAL)])
def test_forward_on_stand_in_gemms(T, K, E, tunings):
    H, I = 16, 8
    moe = stand_in_moe(E, H, I, tunings, seed=T)
    g = torch.Generator().manual_seed(T + 1)
    x = torch.randn(T, H, generator=g).to(torch.bfloat16)
    ids = routing_ids(T, K, E, seed=T + 2)
    weights = torch.softmax(torch.randn(T, K, generator=g), dim=1)
    bufs = tuple(torch.full((T * K, n), float("nan"), dtype=torch.bfloat16) for n in (2 * I, I, H))
    y = moe.forward(x, ids, weights, bufs).float()
    ref = plain_moe(moe, x, ids, weights)
    assert float((y - ref).norm() / ref.norm()) < 1e-2
