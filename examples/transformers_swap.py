"""A Hugging Face transformers MoE model with megamoe experts, end to end (no download: a small random
Mixtral or Qwen3-MoE config):

  1. the model in bf16, as transformers runs it;
  2. the same model with every sparse-MoE block's experts replaced by megamoe BF16 layers (the routers
     stay): megamoe.torch.hf.replace_experts(model, max_tokens=...);
  3. the experts quantized to NVFP4 by megamoe's quantizer (what `megamoe quantize` does) and loaded
     from that checkpoint.

Prints the logits of each and how far they are from the model in float32, with every model routed as
the megamoe BF16 model routed (its routers' choices recorded and replayed in the others, as the table in
docs/PYTHON.md does): one top-k choice that a rounding difference flips moves a token's output far, and
would make the figures measure tie-breaks rather than arithmetic.
    python3 examples/transformers_swap.py [--model mixtral|qwen3_moe] [--device cpu|cuda]
"""
import argparse
import copy
import tempfile

import torch
import transformers

import megamoe
from megamoe.torch import hf


def small_model(kind):
    torch.manual_seed(0)
    if kind == "mixtral":
        cfg = transformers.MixtralConfig(vocab_size=128, hidden_size=256, intermediate_size=256, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2, num_local_experts=8,
                                         num_experts_per_tok=2)
        model = transformers.MixtralForCausalLM(cfg)
    else:
        cfg = transformers.Qwen3MoeConfig(vocab_size=128, hidden_size=256, intermediate_size=512,
                                          moe_intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                                          num_key_value_heads=2, head_dim=64, num_experts=8, num_experts_per_tok=2,
                                          norm_topk_prob=True)
        model = transformers.Qwen3MoeForCausalLM(cfg)
    with torch.no_grad():  # experts at unit gain, so that they matter next to the residual stream
        for _, block in hf.moe_blocks(model):
            E, I2, H = block.experts.gate_up_proj.shape
            block.experts.gate_up_proj.normal_(0, H ** -0.5)
            block.experts.down_proj.normal_(0, (I2 // 2) ** -0.5)
    return model.eval()


class Router(torch.nn.Module):
    """A block's router that records (mode "record") or replays (mode "replay", from `source`) the
    routing weights and expert ids it returns."""

    def __init__(self, gate, source=None):
        super().__init__()
        self.gate, self.source, self.saved = gate, source, None

    def forward(self, hidden_states):
        logits, w, ids = self.gate(hidden_states)
        if self.source is None:
            self.saved = (w.detach(), ids.detach())
            return logits, w, ids
        sw, sids = self.source.saved
        return logits, sw.to(w.device, w.dtype), sids.to(ids.device)


def replay_routing(src, *dsts):
    """src records its routers' choices; each of dsts replays them."""
    routers = []
    for _, block in hf.moe_blocks(src):
        block.gate = Router(block.gate)
        routers.append(block.gate)
    for dst in dsts:
        for r, (_, block) in zip(routers, hf.moe_blocks(dst)):
            block.gate = Router(block.gate, source=r)


def run(model, tokens, device):
    with torch.no_grad():
        return model.to(device)(tokens.to(device)).logits.float().cpu()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="mixtral", choices=["mixtral", "qwen3_moe"])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--activations", default=None, choices=["bf16", "nvfp4"],
                    help="the NVFP4 layers' activations (SPEC §3b; default: the library's, bf16)")
    a = ap.parse_args()
    model = small_model(a.model)
    tokens = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(1))
    f32 = run(copy.deepcopy(model).float(), tokens, a.device)

    bf16 = copy.deepcopy(model).to(torch.bfloat16)
    original = run(bf16, tokens, a.device)
    swapped_model = copy.deepcopy(bf16)
    names = hf.replace_experts(swapped_model, max_tokens=tokens.numel(), device=a.device)
    swapped = run(swapped_model, tokens, a.device)

    with tempfile.TemporaryDirectory() as d:
        megamoe.save_safetensors(f"{d}/experts_bf16.safetensors", hf.expert_tensors(model))
        megamoe.quantize_checkpoint(f"{d}/experts_bf16.safetensors", f"{d}/experts_nvfp4.safetensors")
        q = copy.deepcopy(model).to(torch.bfloat16)
        hf.replace_experts(q, max_tokens=tokens.numel(), device=a.device, checkpoint=f"{d}/experts_nvfp4.safetensors",
                           activations=a.activations)
        act = hf.moe_blocks(q)[0][1].experts.activations
        quantized = run(q, tokens, a.device)

        # The same, every model routed as the megamoe BF16 model routes (its choices replayed).
        ref32, ref16 = copy.deepcopy(model).float(), copy.deepcopy(model).to(torch.bfloat16)
        replay_routing(swapped_model, ref32, ref16, q)
        swapped_r = run(swapped_model, tokens, a.device)
        f32_r, original_r, quantized_r = (run(m, tokens, a.device) for m in (ref32, ref16, q))

    def rel(x, ref=f32):
        return float((x - ref).norm() / ref.norm())

    torch.set_printoptions(precision=3, sci_mode=False)
    print(f"{a.model} on {a.device}, megamoe {megamoe.__version__}; experts replaced in {names}")
    print("logits[0, -1, :6]  transformers bf16:", original[0, -1, :6])
    print("logits[0, -1, :6]  megamoe bf16:     ", swapped[0, -1, :6])
    print(f"logits[0, -1, :6]  megamoe nvfp4 ({act} activations):", quantized[0, -1, :6])
    print(f"relative L2 to the float32 model, each model routed by its own routers: transformers bf16 "
          f"{rel(original):.3e}, megamoe bf16 {rel(swapped):.3e}, megamoe nvfp4 ({act} activations) {rel(quantized):.3e}")
    print(f"relative L2 to the float32 model, routers replayed (every model routed as megamoe bf16 routed; "
          f"docs/PYTHON.md's table): transformers bf16 {rel(original_r, f32_r):.3e}, megamoe bf16 "
          f"{rel(swapped_r, f32_r):.3e}, megamoe nvfp4 ({act} activations) {rel(quantized_r, f32_r):.3e}")
    agree = (swapped.argmax(-1) == original.argmax(-1)).float().mean()
    print(f"next-token argmax agreement, megamoe bf16 vs transformers bf16: {agree:.1%}")


if __name__ == "__main__":
    main()
