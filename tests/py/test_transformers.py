"""Proof on models no one here wrote (issue 22): Hugging Face transformers' Mixtral and Qwen3-MoE, built
from small random configs (no download), with every sparse-MoE block's experts replaced by megamoe
(BF16, no norm; the models' routers stay). Logits against the same model in float32, routed as the
megamoe model routed (a top-k choice flipped by a rounding difference moves a token's output far; the
routers' decisions are recorded from the megamoe model and replayed in the others, so the comparison
measures the arithmetic, not the tie-breaks):
  - BF16 experts: megamoe's logits within BF16_FACTOR x the error of the model's own bf16 experts;
  - experts quantized by `megamoe quantize`: against a float32 model holding the same dequantized NVFP4
    weights, within NVFP4_BOUND (the layer quantizes its activations to NVFP4, SPEC §3).
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
NVFP4_BOUND = 0.05     # NVFP4 experts (NVFP4 activations) against the float32 model of the same weights

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


def dequantized(path, prefix, E):
    """The float32 gate_up_proj [E, 2I, H] and down_proj [E, H, I] of the NVFP4 experts of `prefix`."""
    t = mr.st_load(path)
    g, d = [], []
    for e in range(E):
        def w(proj):
            b = f"{prefix}.experts.{e}.{proj}."
            return mr.decode_nvfp4(t[b + "weight"], t[b + "weight_scale"]) * float(t[b + "weight_scale_2"].reshape(()))
        g.append(np.concatenate([w("gate_proj"), w("up_proj")]))
        d.append(w("down_proj"))
    return torch.from_numpy(np.stack(g)).float(), torch.from_numpy(np.stack(d)).float()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kind", ["mixtral", "qwen3_moe"])
def test_quantized_experts_swap(tmp_path, kind, device):
    model = build(kind, seed=3)
    tokens = torch.randint(0, 128, (2, 24), generator=torch.Generator().manual_seed(4))
    bf16_path, nvfp4_path = tmp_path / "experts_bf16.safetensors", tmp_path / "experts_nvfp4.safetensors"
    megamoe.save_safetensors(bf16_path, hf.expert_tensors(model))
    mr.run_cli("quantize", bf16_path, nvfp4_path)
    # the float reference: the same model with the dequantized NVFP4 weights, in float32
    ref_model = copy.deepcopy(model).float()
    for name, block in hf.moe_blocks(ref_model):
        gu, dn = dequantized(nvfp4_path, name, block.experts.gate_up_proj.shape[0])
        block.experts.gate_up_proj.data.copy_(gu)
        block.experts.down_proj.data.copy_(dn)
    m16 = copy.deepcopy(model).to(torch.bfloat16)
    unquantized = copy.deepcopy(model).float()
    hf.replace_experts(m16, max_tokens=tokens.numel(), device=device, checkpoint=nvfp4_path)
    assert [b.experts.is_nvfp4 for _, b in hf.moe_blocks(m16)] == [True, True]
    force_routing(m16, [ref_model, unquantized])
    mm = logits(m16, tokens, device)
    ref = logits(ref_model, tokens, device)
    err = rel(mm, ref)
    err_unquantized = rel(logits(unquantized, tokens, device), ref)
    print(f"{kind} {device} NVFP4: rel L2 vs float32 of the same quantized weights {err:.2e} "
          f"(the unquantized model is {err_unquantized:.2e} away)")
    assert err <= NVFP4_BOUND, f"{err:.2e} over {NVFP4_BOUND}"
    assert err < err_unquantized / 2, "the reference does not tell the quantized weights from the original ones"
