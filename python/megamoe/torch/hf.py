"""Hugging Face transformers models with megamoe experts: replace_experts(model) swaps the experts of
every sparse-MoE block (Mixtral, Qwen3-MoE and the other models whose block holds a fused `experts`
module with gate_up_proj [E, 2I, H] and down_proj [E, H, I], as transformers 5 defines them) for
megamoe layers; the block's router stays. transformers is not imported here: this works on the model
object alone.
"""
import torch

import megamoe
from ._module import MegaMoEExperts, _device

# Block names of checkpoints beside transformers 5's module names: Mixtral (and PhiMoE) checkpoints name
# the sparse-MoE block `block_sparse_moe`, which transformers 5 loads as `mlp`.
BLOCK_ALIASES = (("mlp", "block_sparse_moe"),)


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
    if not isinstance(model, torch.nn.Module):
        raise megamoe.ArgumentTypeError(f"model: expected a torch.nn.Module, got {type(model).__name__}", 1)
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


def checkpoint_prefix(names, block):
    """The checkpoint layer (one of `names`, the prefixes megamoe.Checkpoint.layers() finds) that holds the
    experts of the transformers block `block` (a module name, e.g. model.layers.3.mlp): the block's own
    name, its `experts` child, and the same under the checkpoints' names of BLOCK_ALIASES (Mixtral:
    model.layers.3.block_sparse_moe); None when none is there."""
    candidates = [block]
    head, _, last = block.rpartition(".")
    for new, old in BLOCK_ALIASES:
        for a, b in ((new, old), (old, new)):
            if last == a:
                candidates.append(f"{head}.{b}" if head else b)
    candidates += [c + ".experts" for c in list(candidates)]
    for c in candidates:
        if c in names:
            return c
    return None


def replace_experts(model, *, max_tokens, device=None, checkpoint=None, activations=None, keep_weights=True):
    """Replaces the experts of every sparse-MoE block of a transformers model by HFExperts and returns
    the block names. BF16: the model's own expert weights (gate_up_proj rows are gate then up, as
    megamoe's w13). checkpoint: instead, the layer of each block in a megamoe-loadable checkpoint (the
    NVFP4 output of `megamoe quantize`, an llm-compressor or ModelOpt export, a save_pretrained of a
    swapped model; a file or a folder), found at the block's name or the checkpoint's name for it
    (checkpoint_prefix: Mixtral's block_sparse_moe). max_tokens: the most tokens one forward passes
    (batch x sequence). device: where the experts run (default: where the block's weights are).
    activations: SPEC §3b's setting for NVFP4 layers (None: the library's default).

    state_dict / save_pretrained of the swapped model: a BF16 layer made from the model's own weights
    writes them back as gate_up_proj / down_proj, so the saved model loads in transformers as before,
    from a host copy the module keeps (keep_weights=False drops it, and state_dict then raises); a layer
    from a checkpoint writes the layer's tensors re-read from that file (which must stay) in the stacked
    layout (`{block}.experts.w13_weight`, ...), names transformers does not load, and
    replace_experts(model, checkpoint=<the saved folder>) puts them back."""
    megamoe._int(max_tokens, "max_tokens", 1)
    megamoe._bool(keep_weights, "keep_weights")
    blocks = moe_blocks(model)  # (checks that model is a module)
    if not blocks:
        raise ValueError(
            "no sparse-MoE block with a fused `experts` module (gate_up_proj, down_proj) found: megamoe.torch.hf "
            "supports the transformers 5 layout of Mixtral, Qwen3-MoE and the like")
    prefixes = {}
    if checkpoint is not None:
        with megamoe.Checkpoint(checkpoint, _what="checkpoint") as ck:
            names = [info["prefix"] for info in ck.layers()]
            for name, block in blocks:
                if isinstance(block.experts, HFExperts):
                    continue
                p = checkpoint_prefix(names, name)
                if p is None:
                    raise megamoe.BadWeightError(
                        f"checkpoint {ck.path}: no MoE layer for the block {name!r} (looked for {name!r} and the "
                        f"names checkpoints use for it); the checkpoint's MoE layers: {names[:8]}"
                        f"{' ...' if len(names) > 8 else ''}", 3)
                prefixes[name] = p
    names = []
    for name, block in blocks:
        ex = block.experts
        if isinstance(ex, HFExperts):
            continue
        dev = _device(device) if device is not None else ex.gate_up_proj.device
        top_k = _top_k(block, model)
        if checkpoint is not None:
            new = HFExperts.from_checkpoint(checkpoint, prefixes[name], top_k=top_k,
                                            num_max_tokens_per_rank=max_tokens, device=dev, activations=activations)
        else:
            E, I2, H = ex.gate_up_proj.shape
            new = HFExperts(num_experts=E, num_local_experts=E, experts_start_idx=0, top_k=top_k, hidden_size=H,
                            intermediate_size=I2 // 2, post_expert_norm=None, num_max_tokens_per_rank=max_tokens,
                            is_nvfp4=False, prefix=name, device=dev)
            gu, dn = ex.gate_up_proj.detach().cpu(), ex.down_proj.detach().cpu()
            new.weight_loader(new.w13_weight, gu.to(torch.bfloat16), "w13_weight")
            new.weight_loader(new.w2_weight, dn.to(torch.bfloat16), "w2_weight")
            new.finalize_weights()
            if keep_weights:
                new._source = ("tensors", {"gate_up_proj": gu, "down_proj": dn})
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
