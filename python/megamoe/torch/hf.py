"""Hugging Face transformers models with megamoe experts: replace_experts(model) swaps the experts of
every sparse-MoE block (Mixtral, Qwen3-MoE and the other models whose block holds a fused `experts`
module with gate_up_proj [E, 2I, H] and down_proj [E, H, I], as transformers 5 defines them) for
megamoe layers; the block's router stays. transformers is not imported here: this works on the model
object alone.
"""
import torch

from ._module import MegaMoEExperts


class HFExperts(MegaMoEExperts):
    """MegaMoEExperts with the call signature of transformers' fused experts module:
    forward(hidden_states [T, H], top_k_index [T, K], top_k_weights [T, K]). Runs the experts in bf16
    and returns the model's dtype."""

    def forward(self, hidden_states, top_k_index, top_k_weights):
        y = super().forward(hidden_states.to(torch.bfloat16).contiguous(), top_k_weights.contiguous(),
                            top_k_index.contiguous())
        return y.to(hidden_states.dtype)


def moe_blocks(model):
    """(name, block) of every sparse-MoE block: a module whose `experts` has gate_up_proj and down_proj
    (or is megamoe's already) and which routes with a `gate` (the router)."""
    found = []
    for name, mod in model.named_modules():
        ex = getattr(mod, "experts", None)
        if isinstance(ex, torch.nn.Module) and hasattr(mod, "gate") and (
                isinstance(ex, HFExperts) or (hasattr(ex, "gate_up_proj") and hasattr(ex, "down_proj"))):
            found.append((name, mod))
    return found


def _top_k(block, model):
    k = getattr(block.gate, "top_k", None) or getattr(block, "top_k", None)
    if k is None:
        k = getattr(getattr(model, "config", None), "num_experts_per_tok", None)
    if k is None:
        raise ValueError("cannot tell the MoE block's top-k (no gate.top_k, top_k or config.num_experts_per_tok)")
    return int(k)


def replace_experts(model, *, max_tokens, device=None, checkpoint=None, activations=None):
    """Replaces the experts of every sparse-MoE block of a transformers model by HFExperts and returns
    the block names. BF16: the model's own expert weights (gate_up_proj rows are gate then up, as
    megamoe's w13). checkpoint: instead, the layer `{block name}` of a megamoe checkpoint (e.g. the
    NVFP4 output of `megamoe quantize`). max_tokens: the most tokens one forward passes (batch x
    sequence). device: where the experts run (default: where the block's weights are). activations:
    SPEC §3b's setting for NVFP4 layers (None: the library's default)."""
    blocks = moe_blocks(model)
    if not blocks:
        raise ValueError(
            "no sparse-MoE block with a fused `experts` module (gate_up_proj, down_proj) found: megamoe.torch.hf "
            "supports the transformers 5 layout of Mixtral, Qwen3-MoE and the like")
    names = []
    for name, block in blocks:
        ex = block.experts
        if isinstance(ex, HFExperts):
            continue
        dev = torch.device(device) if device is not None else ex.gate_up_proj.device
        top_k = _top_k(block, model)
        if checkpoint is not None:
            new = HFExperts.from_checkpoint(checkpoint, name, top_k=top_k, num_max_tokens_per_rank=max_tokens,
                                            device=dev, activations=activations)
        else:
            E, I2, H = ex.gate_up_proj.shape
            new = HFExperts(num_experts=E, num_local_experts=E, experts_start_idx=0, top_k=top_k, hidden_size=H,
                            intermediate_size=I2 // 2, post_expert_norm=None, num_max_tokens_per_rank=max_tokens,
                            is_nvfp4=False, prefix=name, device=dev)
            new.weight_loader(new.w13_weight, ex.gate_up_proj.detach().to(torch.bfloat16).cpu(), "w13_weight")
            new.weight_loader(new.w2_weight, ex.down_proj.detach().to(torch.bfloat16).cpu(), "w2_weight")
            new.finalize_weights()
        block.experts = new
        names.append(name)
    return names


def expert_tensors(model):
    """{'{block}.w13_weight': [E, 2I, H] bf16, '{block}.w2_weight': [E, H, I] bf16} of every MoE block: the
    stacked BF16 checkpoint `megamoe quantize` turns into NVFP4 (other tensors are not needed)."""
    out = {}
    for name, block in moe_blocks(model):
        out[f"{name}.w13_weight"] = block.experts.gate_up_proj.detach().to(torch.bfloat16).cpu().contiguous()
        out[f"{name}.w2_weight"] = block.experts.down_proj.detach().to(torch.bfloat16).cpu().contiguous()
    return out
