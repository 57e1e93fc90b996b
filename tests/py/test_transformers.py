"""Proof on models no one here wrote (issue 22): Hugging Face transformers' Mixtral and Qwen3-MoE, built
from small random configs (no download), with every sparse-MoE block's experts replaced by megamoe
(BF16, no norm; the models' routers stay). Logits against the same model in float32, routed as the
megamoe model routed (a top-k choice flipped by a rounding difference moves a token's output far; the
routers' decisions are recorded from the megamoe model and replayed in the others, so the comparison
measures the arithmetic, not the tie-breaks):
  - BF16 experts: megamoe's logits within BF16_FACTOR x the error of the model's own bf16 experts;
  - experts quantized by `megamoe quantize`, with either activations setting: against the same bf16
    model whose experts are the float64 reference of SPEC §3 (NVFP4 activations) or §3b (BF16
    activations) of tests/py/mmref.py on the same quantized checkpoint, within NVFP4_BOUND. The rest
    of the model runs in bf16 in both: NVFP4 activation quantization turns a rounding-sized change
    of its input into a quantization-noise-sized change of its output, so a float32 model around the
    reference experts would measure that noise, not the layer. The float32 model with the dequantized
    weights and unquantized activations is printed beside it.
On the CPU (CI) and, where there is one, the GPU (skipped visibly otherwise)."""
import copy

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers", reason="transformers is not installed: transformers tests not run")

import mmref as mr  # noqa: E402
import torchutil as tu  # noqa: E402

import megamoe  # noqa: E402
from megamoe.torch import hf  # noqa: E402

# Measured (see docs/PYTHON.md "Accuracy"): relative L2 of the logits against the float32 model.
BF16_FACTOR = 1.5      # megamoe bf16 error <= 1.5 x the error of the model's own bf16 experts (+ 1e-3)
NVFP4_BOUND = 0.02     # NVFP4 experts against the bf16 model with the SPEC §3 / §3b reference experts

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not tu.cuda_gpu(), reason="no GPU for the CUDA backend: transformers GPU tests not run"))]


def build(kind, seed=0):
    torch.manual_seed(seed)
    if kind == "mixtral":
        cfg = transformers.MixtralConfig(vocab_size=128, hidden_size=256, intermediate_size=256, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2, num_local_experts=8,
                                         num_experts_per_tok=2, max_position_embeddings=64)
        model = transformers.MixtralForCausalLM(cfg)
    else:
        cfg = transformers.Qwen3MoeConfig(vocab_size=128, hidden_size=256, intermediate_size=512,
                                          moe_intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                                          num_key_value_heads=2, head_dim=64, num_experts=8, num_experts_per_tok=2,
                                          norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[],
                                          max_position_embeddings=64)
        model = transformers.Qwen3MoeForCausalLM(cfg)
    cfg._attn_implementation = "eager"
    # Experts at unit gain, so that they carry a large part of every hidden state (the default 0.02
    # initialization would leave them a rounding error beside the residual stream).
    with torch.no_grad():
        for _, block in hf.moe_blocks(model):
            E, I2, H = block.experts.gate_up_proj.shape
            block.experts.gate_up_proj.normal_(0, H ** -0.5)
            block.experts.down_proj.normal_(0, (I2 // 2) ** -0.5)
    return model.eval()


class ForcedGate(torch.nn.Module):
    """Wraps a block's router: "record" keeps the (weights, ids) it returns, "replay" returns the
    recorded ones (weights in the dtype the wrapped router gives)."""

    def __init__(self, gate):
        super().__init__()
        self.gate, self.mode, self.saved = gate, "record", None

    def forward(self, hidden_states):
        logits_, w, ids = self.gate(hidden_states)
        if self.mode == "record":
            self.saved = (w.detach().float().cpu(), ids.detach().cpu())
            return logits_, w, ids
        return logits_, self.saved[0].to(w.device, w.dtype), self.saved[1].to(ids.device)


def force_routing(src, dsts):
    """Replaces the routers of src and every model of dsts by ForcedGates sharing src's recordings."""
    gates = []
    for _, b in hf.moe_blocks(src):
        b.gate = ForcedGate(b.gate)
        gates.append(b.gate)
    for dst in dsts:
        for g, (_, b) in zip(gates, hf.moe_blocks(dst)):
            b.gate = ForcedGate(b.gate)
            b.gate.mode = "replay"
            b.gate.saved_from = g
    return gates


class _Replay:
    @staticmethod
    def sync(model):
        for _, b in hf.moe_blocks(model):
            if isinstance(b.gate, ForcedGate) and b.gate.mode == "replay":
                b.gate.saved = b.gate.saved_from.saved


def logits(model, tokens, device):
    _Replay.sync(model)
    with torch.no_grad():
        return model.to(device)(tokens.to(device)).logits.float().cpu()


def rel(a, b):
    a, b = a.detach().float(), b.detach().float()
    return float((a - b).norm() / b.norm())


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kind", ["mixtral", "qwen3_moe"])
def test_bf16_experts_swap(kind, device):
    model = build(kind)
    tokens = torch.randint(0, 128, (2, 24), generator=torch.Generator().manual_seed(1))
    m16 = copy.deepcopy(model).to(torch.bfloat16)
    hf16, f32, no_experts = copy.deepcopy(m16), copy.deepcopy(model).float(), copy.deepcopy(model).float()
    names = hf.replace_experts(m16, max_tokens=tokens.numel(), device=device)
    assert names == ["model.layers.0.mlp", "model.layers.1.mlp"]
    assert [isinstance(b.experts, hf.HFExperts) for _, b in hf.moe_blocks(m16)] == [True, True]
    for _, b in hf.moe_blocks(no_experts):
        b.experts.down_proj.data.zero_()
    force_routing(m16, [hf16, f32, no_experts])
    mm = logits(m16, tokens, device)
    ref, hf_bf16 = logits(f32, tokens, device), logits(hf16, tokens, device)
    err_hf, err_mm = rel(hf_bf16, ref), rel(mm, ref)
    # the experts matter: without them the logits are far off
    err_none = rel(logits(no_experts, tokens, device), ref)
    print(f"{kind} {device}: rel L2 vs float32: megamoe {err_mm:.2e}, transformers bf16 {err_hf:.2e}, "
          f"megamoe vs transformers bf16 {rel(mm, hf_bf16):.2e}, experts removed {err_none:.2e}")
    assert err_none > 0.2
    assert err_mm <= BF16_FACTOR * err_hf + 1e-3, f"megamoe {err_mm:.2e} vs transformers bf16 {err_hf:.2e}"


def nvfp4_layer(path, prefix, E):
    """The NVFP4 experts of `prefix` in a per-expert checkpoint as an mmref model (stacked arrays)."""
    t = mr.st_load(path)

    def f(e, proj, field):
        return t[f"{prefix}.experts.{e}.{proj}.{field}"]

    m = {"format": "nvfp4", "E": E, "norm": None}
    m["w13"] = np.stack([np.concatenate([f(e, "gate_proj", "weight"), f(e, "up_proj", "weight")]) for e in range(E)])
    m["w13_sf"] = np.stack([np.concatenate([f(e, "gate_proj", "weight_scale"), f(e, "up_proj", "weight_scale")])
                            for e in range(E)]).view(np.uint8)
    m["w13_s2"] = np.array([[f(e, p, "weight_scale_2").item() for p in ("gate_proj", "up_proj")] for e in range(E)],
                           dtype=np.float32)
    m["w2"] = np.stack([f(e, "down_proj", "weight") for e in range(E)])
    m["w2_sf"] = np.stack([f(e, "down_proj", "weight_scale") for e in range(E)]).view(np.uint8)
    m["w2_s2"] = np.array([f(e, "down_proj", "weight_scale_2").item() for e in range(E)], dtype=np.float32)
    m["w2_in"] = np.array([f(e, "down_proj", "input_scale").item() for e in range(E)], dtype=np.float32)
    m["H"], m["I"] = m["w2"].shape[1], m["w2"].shape[2] * 2
    return m


def dequantized(m):
    """float32 gate_up_proj [E, 2I, H] and down_proj [E, H, I] of an mmref NVFP4 model."""
    g = mr.decode_nvfp4(m["w13"], m["w13_sf"])
    I = m["I"]
    g[:, :I] *= m["w13_s2"][:, 0, None, None]
    g[:, I:] *= m["w13_s2"][:, 1, None, None]
    d = mr.decode_nvfp4(m["w2"], m["w2_sf"]) * m["w2_s2"][:, None, None]
    return torch.from_numpy(g).float(), torch.from_numpy(d).float()


class ReferenceExperts(torch.nn.Module):
    """The experts as SPEC §3 defines them, in float64 (mmref.reference_layer), on the bf16-rounded
    hidden states the layer takes; the fused-experts call signature of transformers."""

    def __init__(self, model, activations):
        super().__init__()
        self.model, self.activations = model, activations

    def forward(self, hidden_states, top_k_index, top_k_weights):
        x = tu.numpy_of(hidden_states.to(torch.bfloat16))
        y = mr.reference_layer(self.model, x, top_k_index.cpu().numpy().astype(np.int32),
                               top_k_weights.detach().float().cpu().numpy(), activations=self.activations)
        return torch.from_numpy(mr.bf16_round(y)).to(hidden_states.device, hidden_states.dtype)


@pytest.mark.parametrize("act", ["bf16", "nvfp4"])
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kind", ["mixtral", "qwen3_moe"])
def test_quantized_experts_swap(tmp_path, kind, device, act):
    model = build(kind, seed=3)
    tokens = torch.randint(0, 128, (2, 24), generator=torch.Generator().manual_seed(4))
    bf16_path, nvfp4_path = tmp_path / "experts_bf16.safetensors", tmp_path / "experts_nvfp4.safetensors"
    megamoe.save_safetensors(bf16_path, hf.expert_tensors(model))
    mr.run_cli("quantize", bf16_path, nvfp4_path)
    # models around the same quantized weights: the SPEC §3 / §3b reference experts in the bf16 model (ref),
    # and the dequantized weights with unquantized activations in float32 (weights_only)
    ref_model, weights_only = copy.deepcopy(model).to(torch.bfloat16), copy.deepcopy(model).float()
    for (name, rb), (_, wb) in zip(hf.moe_blocks(ref_model), hf.moe_blocks(weights_only)):
        q = nvfp4_layer(nvfp4_path, name, rb.experts.gate_up_proj.shape[0])
        rb.experts = ReferenceExperts(q, act)
        gu, dn = dequantized(q)
        wb.experts.gate_up_proj.data.copy_(gu)
        wb.experts.down_proj.data.copy_(dn)
    m16 = copy.deepcopy(model).to(torch.bfloat16)
    unquantized = copy.deepcopy(model).float()
    hf.replace_experts(m16, max_tokens=tokens.numel(), device=device, checkpoint=nvfp4_path,
                       activations=act)
    assert [b.experts.is_nvfp4 for _, b in hf.moe_blocks(m16)] == [True, True]
    force_routing(m16, [ref_model, weights_only, unquantized])
    mm = logits(m16, tokens, device)
    ref = logits(ref_model, tokens, device)
    err = rel(mm, ref)
    err_w = rel(logits(weights_only, tokens, device), ref)
    err_unquantized = rel(logits(unquantized, tokens, device), ref)
    print(f"{kind} {device} NVFP4 weights, {act} activations: rel L2 vs the model with float64 reference experts {err:.2e}; "
          f"dequantized weights with unquantized activations {err_w:.2e}, original weights {err_unquantized:.2e}")
    assert err <= NVFP4_BOUND, f"{err:.2e} over {NVFP4_BOUND}"
    if act == "nvfp4":
        assert err < err_w / 4, "the reference does not tell the layer's numerics from unquantized activations"
