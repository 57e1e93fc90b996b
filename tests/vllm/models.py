"""Tiny MoE models for the vLLM plugin's tests, written as real tools write them, and their float64
reference (runs in the tests' .venv: torch, transformers, llm-compressor, ModelOpt).

Two architectures, from transformers configs with random weights (seeded), saved in bf16:
  qwen3    Qwen3MoeForCausalLM   H=256, moe I=256, E=8, K=2, 2 layers, vocab 512
  mixtral  MixtralForCausalLM    H=256, I=256,     E=8, K=2, 2 layers, vocab 512
`initializer_range` 0.2 spreads the logits, so greedy tokens have margins far above bf16 rounding.

NVFP4 exports of the experts only (vLLM's CPU build has no NVFP4 kernel for the attention's linears;
the other modules stay bf16, listed as ignored/excluded in the export's config):
  ct        llm-compressor oneshot, scheme NVFP4 (W4A4; calibrated on random token ids)
  ct-a16    llm-compressor oneshot, scheme NVFP4A16 (weight-only: no input scales)
  modelopt  ModelOpt mtq.quantize (NVFP4_DEFAULT_CFG's quantizers on the experts) + export_hf_checkpoint
and with_own_up_scales, a copy of an export whose up projections have global scales of their own.
"""
import copy
import importlib.util
import os

import torch

VOCAB = 512
ARCHS = ("qwen3", "mixtral")
NVFP4_TOOLS = ("ct", "ct-a16", "modelopt")


def _config(arch, hidden_size=256):
    common = dict(vocab_size=VOCAB, hidden_size=hidden_size, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=64, num_experts_per_tok=2, max_position_embeddings=512,
                  initializer_range=0.2, tie_word_embeddings=False)
    if arch == "qwen3":
        from transformers import Qwen3MoeConfig
        return Qwen3MoeConfig(intermediate_size=512, moe_intermediate_size=256, num_experts=8, norm_topk_prob=True,
                              **common)
    from transformers import MixtralConfig
    return MixtralConfig(intermediate_size=256, num_local_experts=8, **common)


def make_bf16(arch, path, seed=0, hidden_size=256):
    """Saves a random `arch` model in bf16 (safetensors, transformers' own naming) at path."""
    from transformers import AutoModelForCausalLM
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(_config(arch, hidden_size), dtype=torch.bfloat16)
    model.save_pretrained(path)
    _tokenizer().save_pretrained(path)
    return path


def _tokenizer():
    """A word-level tokenizer of VOCAB tokens "t0".."t511" (llm-compressor's calibration wants one)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(VOCAB)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="t0", pad_token="t0", eos_token="t1")


def _calibration_ids(n=8, length=32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, VOCAB, (n, length), generator=g)


def make_nvfp4(tool, src, path):
    """Quantizes the experts of the bf16 model at src with `tool` (NVFP4_TOOLS) and exports it to path."""
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.bfloat16)
    ids = _calibration_ids()
    if tool in ("ct", "ct-a16"):
        from datasets import Dataset
        from llmcompressor import oneshot
        from llmcompressor.modifiers.quantization import QuantizationModifier
        recipe = QuantizationModifier(targets=[r"re:.*\.experts\..*"], ignore=["lm_head"],
                                      scheme="NVFP4" if tool == "ct" else "NVFP4A16")
        data = Dataset.from_dict({"input_ids": ids.tolist(), "attention_mask": torch.ones_like(ids).tolist()})
        oneshot(model=model, recipe=recipe, dataset=data if tool == "ct" else None,
                num_calibration_samples=ids.shape[0], max_seq_length=ids.shape[1])
        model.save_pretrained(path, save_compressed=True)
    elif tool == "modelopt":
        import modelopt.torch.quantization as mtq
        from modelopt.torch.export import export_hf_checkpoint
        cfg = copy.deepcopy(mtq.NVFP4_DEFAULT_CFG)
        entries = {e["quantizer_name"]: e for e in cfg["quant_cfg"] if "quantizer_name" in e}
        cfg["quant_cfg"] = [{"quantizer_name": "*", "enable": False}] + [
            {"quantizer_name": f"*.experts*{q}", "cfg": entries[f"*{q}"]["cfg"]}
            for q in ("weight_quantizer", "input_quantizer")]

        def calibrate(m):
            with torch.no_grad():
                for row in ids:
                    m(row[None])
        model = mtq.quantize(model, cfg, calibrate)
        export_hf_checkpoint(model, export_dir=path)
    else:
        raise ValueError(f"tool {tool!r}: expected one of {NVFP4_TOOLS}")
    return path


# ---- the float64 reference --------------------------------------------------------------------

def _tensors(path):
    from safetensors.torch import load_file
    out = {}
    for f in sorted(os.listdir(path)):
        if f.endswith(".safetensors"):
            out.update(load_file(os.path.join(path, f)))
    return out


_E2M1 = torch.tensor([0, .5, 1, 1.5, 2, 3, 4, 6, -0., -.5, -1, -1.5, -2, -3, -4, -6], dtype=torch.float64)


def _dequantize(t, prefix):
    """Ŵ [N, K] float64 of one NVFP4 projection (SPEC §3): codes (low nibble first) times the e4m3 block
    scales times the global scale (ModelOpt's weight_scale_2, or compressed-tensors' reciprocal
    weight_global_scale inverted in float32, as megamoe inverts it)."""
    codes = t.get(f"{prefix}.weight_packed", t.get(f"{prefix}.weight"))
    q = torch.stack([codes & 0xF, codes >> 4], dim=-1).reshape(codes.shape[0], -1).long()
    sf = t[f"{prefix}.weight_scale"].to(torch.float64).repeat_interleave(16, dim=1)
    if f"{prefix}.weight_scale_2" in t:
        alpha = t[f"{prefix}.weight_scale_2"].float().reshape(())
    else:
        alpha = torch.reciprocal(t[f"{prefix}.weight_global_scale"].float().reshape(()))
    return _E2M1[q] * sf * alpha.double()


def with_own_up_scales(ckpt, path):
    """A copy of the NVFP4 export at ckpt whose up projections' global scales are doubled (the tools
    write gate's and up's equal, for vLLM's methods that keep one): a valid model of its own, on which
    a layer that used the gate's scale for up would differ from the reference."""
    import shutil
    from safetensors.torch import load_file, save_file
    shutil.copytree(ckpt, path)
    for f in os.listdir(path):
        if f.endswith(".safetensors"):
            t = load_file(os.path.join(path, f))
            for name in t:
                if ("up_proj" in name or ".w3." in name) and name.endswith("weight_scale_2"):
                    t[name] = t[name] * 2
                elif ("up_proj" in name or ".w3." in name) and name.endswith("weight_global_scale"):
                    t[name] = t[name] / 2  # compressed-tensors stores the reciprocal
            save_file(t, os.path.join(path, f), metadata={"format": "pt"})
    return path


def gate_up_scales_differ(ckpt):
    """Whether some expert's gate and up global scales differ in the export at ckpt (where they do, a
    layer that used the gate's for both, as vLLM's own NVFP4 methods do, would not equal the reference)."""
    t = _tensors(ckpt)
    for name, v in t.items():
        for gate, up in (("gate_proj", "up_proj"), (".w1.", ".w3.")):
            if gate in name and ("weight_scale_2" in name or "weight_global_scale" in name):
                other = t.get(name.replace(gate, up))
                if other is not None and not torch.equal(v, other):
                    return True
    return False


def reference_model(src, ckpt):
    """The float64 transformers model of the export at ckpt: the bf16 model at src (its non-expert
    weights, checked equal to the export's) with the export's experts dequantized (ckpt = src: the bf16
    model itself)."""
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float64, experts_implementation="eager")
    t = _tensors(ckpt)
    state = model.state_dict()
    for name, value in t.items():  # the export's bf16 tensors are the model's
        if name in state and value.dtype == torch.bfloat16:
            assert torch.equal(state[name], value.double()), name
    if not any(name.endswith(".weight_scale") for name in t):
        return model.eval()  # a BF16 model: its own weights
    for li, layer in enumerate(model.model.layers):
        experts = layer.mlp.experts
        base = next(p for p in (f"model.layers.{li}.mlp.experts", f"model.layers.{li}.block_sparse_moe.experts")
                    if any(k.startswith(p + ".0.") for k in t))
        names = ("gate_proj", "up_proj", "down_proj") if f"{base}.0.gate_proj.weight_scale" in t else ("w1", "w3", "w2")
        with torch.no_grad():
            for e in range(experts.num_experts):
                g, u, d = (_dequantize(t, f"{base}.{e}.{n}") for n in names)
                experts.gate_up_proj[e].copy_(torch.cat([g, u], dim=0))
                experts.down_proj[e].copy_(d)
    return model.eval()


def _bf16(t):
    return t.to(torch.bfloat16).to(t.dtype)


def _experts_with_bf16_io(experts):
    """The experts' forward as megamoe computes BF16-activation layers (SPEC §3b, §4), in float64 but
    for its three roundings to bf16: x on entry, a = silu(g)·u, and y, the routing-weighted sum."""
    def forward(hidden, top_k_index, top_k_weights):
        x = _bf16(hidden)
        y = torch.zeros_like(x)
        for e in range(experts.num_experts):
            tok, slot = torch.where(top_k_index == e)
            if tok.numel():
                g, u = torch.nn.functional.linear(x[tok], experts.gate_up_proj[e]).chunk(2, dim=-1)
                a = _bf16(torch.nn.functional.silu(g) * u)
                y.index_add_(0, tok, torch.nn.functional.linear(a, experts.down_proj[e]) * top_k_weights[tok, slot, None])
        return _bf16(y)
    return forward


def reference_experts(model, layer, x, topk_weights, topk_ids):
    """y of the MoE layer `layer` of a reference_model on the given inputs (float64 but for megamoe's
    bf16 roundings, _experts_with_bf16_io): what megamoe's layer computes, SPEC §3b / §4."""
    experts = model.model.layers[layer].mlp.experts
    with torch.no_grad():
        return _experts_with_bf16_io(experts)(torch.tensor(x, dtype=torch.float64),
                                              torch.tensor(topk_ids, dtype=torch.long),
                                              torch.tensor(topk_weights, dtype=torch.float64)).numpy()


def reference_logprobs(model, prompts, routes=None, bf16_io=False):
    """For each prompt: log_softmax of the logits predicting positions 1.. ([len-1, VOCAB] float64), and
    the smallest routing margin of its tokens over the layers (the gap between the K-th and (K+1)-th
    largest router logit). routes[i][layer] ([len, K] expert ids) replays another run's routing for
    prompt i: where a margin is small, rounding elsewhere in the model (bf16, the order of sums) may send
    a token to another expert than float64 does, and from that token on the two runs compute different
    functions; replayed, they compute the same one. Routing weights are float64 softmax probabilities of
    the chosen experts, renormalized over them (both architectures' routers do so). bf16_io: the experts
    round as megamoe does (_experts_with_bf16_io), so that a float32 run's remaining distance is
    float32 against float64 alone."""
    K = model.config.num_experts_per_tok
    state = {"prompt": 0, "margins": []}

    def router(gate, layer):
        def forward(hidden):
            logits = torch.nn.functional.linear(hidden.reshape(-1, hidden.shape[-1]), gate.weight)
            top = logits.topk(K + 1, dim=-1)
            state["margins"].append((top.values[:, -2] - top.values[:, -1]).min().item())
            idx = top.indices[:, :K]
            if routes is not None:
                idx = torch.tensor(routes[state["prompt"]][layer], dtype=torch.long)
            probs = torch.softmax(logits, dim=-1).gather(1, idx)
            return logits, probs / probs.sum(dim=-1, keepdim=True), idx
        return forward

    saved = []
    for i, layer in enumerate(model.model.layers):
        saved.append((layer.mlp.gate.forward, layer.mlp.experts.forward))
        layer.mlp.gate.forward = router(layer.mlp.gate, i)
        if bf16_io:
            layer.mlp.experts.forward = _experts_with_bf16_io(layer.mlp.experts)
    out = []
    try:
        with torch.no_grad():
            for i, p in enumerate(prompts):
                state["prompt"], state["margins"] = i, []
                logits = model(torch.tensor([p])).logits[0, :-1]
                out.append((torch.log_softmax(logits, dim=-1).numpy(), min(state["margins"])))
    finally:
        for layer, (gate, experts) in zip(model.model.layers, saved):
            layer.mlp.gate.forward, layer.mlp.experts.forward = gate, experts
    return out


class ToolMissing(Exception):
    """A tool that writes an export is not installed (the reason is the message)."""


class Models:
    """The models of the tests and the benchmark by name, made once each under `root`:
    "<arch>" bf16, "<arch>-h320" bf16 at H = 320 (a size megamoe refuses), "<arch>-<tool>" an NVFP4
    export (NVFP4_TOOLS), "<arch>-<tool>-up2" that export through with_own_up_scales."""

    def __init__(self, root):
        self.root, self.made = str(root), {}

    def __call__(self, name):
        if name not in self.made:
            arch, _, tool = name.partition("-")
            path = os.path.join(self.root, name)
            if tool in ("", "h320"):
                self.made[name] = make_bf16(arch, path, hidden_size=320 if tool else 256)
            elif tool.endswith("-up2"):
                self.made[name] = with_own_up_scales(self(name[:-len("-up2")]), path)
            else:
                module = "modelopt" if tool == "modelopt" else "llmcompressor"
                if importlib.util.find_spec(module) is None:
                    raise ToolMissing(f"{module} is not installed in the tests' .venv")
                self.made[name] = make_nvfp4(tool, self(arch), path)
        return self.made[name]
