"""Tiny NVFP4 MoE checkpoints written by the real tools, for tests that must load what users load.

The model: a two-layer Mixtral or Qwen3-MoE built from a small config (no download; `tiny_model`),
H = 256, I = 256 per expert, 8 experts, top-2, vocab 128, 4 attention heads (2 KV heads), random
weights from a seed, the experts at unit gain (gate_up_proj ~ N(0, 1/H), down_proj ~ N(0, 1/I), so
they carry much of each hidden state), saved in bfloat16. Every writer quantizes only the experts of
the MoE blocks (the routers, attention, norms, embeddings and lm_head stay bfloat16, so transformers
and vLLM's CPU build can run everything but the experts):

  write_bf16(kind, out)                         transformers' save_pretrained of the model
  write_llmcompressor(kind, out, "NVFP4")       llm-compressor's oneshot, compressed-tensors
  write_llmcompressor(kind, out, "NVFP4A16")      `nvfp4-pack-quantized` (W4A4 / weight only)
  write_modelopt(kind, out, "NVFP4")            ModelOpt's mtq.quantize + export_hf_checkpoint
  write_modelopt(kind, out, "W4A16")              (NVFP4_EXPERTS_ONLY_CFG; W4A16: its input
                                                   quantizers off)

Each writes a Hugging Face model folder `out` (config.json with the tool's quantization_config,
generation_config.json, model.safetensors; ModelOpt also hf_quant_config.json) and returns its path.
Calibration (W4A4) runs the model on 8 sequences of 32 random tokens (seed 1). Tensor names, as
transformers 5 saves them (Mixtral's block is `block_sparse_moe` in files, `mlp` in the module):
  llm-compressor: model.layers.N.{mlp|block_sparse_moe}.experts.E.{gate,up,down}_proj.
                  {weight_packed U8 [rows, cols/2], weight_scale F8_E4M3 [rows, cols/16],
                   weight_global_scale F32 [1], input_global_scale F32 [1] (NVFP4 only)}
  ModelOpt:       model.layers.N.mlp.experts.E.{gate,up,down}_proj.* (Qwen3-MoE) or
                  model.layers.N.block_sparse_moe.experts.E.{w1,w3,w2}.* (Mixtral), with
                  {weight U8, weight_scale F8_E4M3, weight_scale_2 F32 [], input_scale F32 [] (NVFP4)}

`checkpoint(kind, tool, scheme)` caches one folder per (kind, tool, scheme, seed) for the process
(a temporary folder removed at exit, or MEGAMOE_REALTOOLS_DIR, kept between runs and named after
this file's and the tools' versions, so a change writes it anew); `missing(tool)`
says why a tool cannot run here (pytest.skip it), None when it can. Both tools run on the CPU (about
20 s per checkpoint on 2 cores). From another environment (e.g. vLLM's):
    .venv/bin/python tests/py/realtools.py OUT --kind mixtral --tool llmcompressor --scheme NVFP4
"""
import argparse
import atexit
import copy
import importlib
import os
import shutil
import sys
import tempfile

KINDS = ("mixtral", "qwen3_moe")
TOOLS = {"bf16": ("BF16",), "llmcompressor": ("NVFP4", "NVFP4A16"), "modelopt": ("NVFP4", "W4A16")}
TOOL_MODULES = {"bf16": ("transformers",), "llmcompressor": ("transformers", "llmcompressor"),
                "modelopt": ("transformers", "modelopt.torch.quantization", "modelopt.torch.export")}
CALIB_SEQUENCES, CALIB_TOKENS, CALIB_SEED = 8, 32, 1


def missing(tool):
    """Why `tool` cannot write a checkpoint here (a module that does not import), or None."""
    if tool not in TOOLS:
        return f"unknown tool {tool!r} (one of {sorted(TOOLS)})"
    for mod in TOOL_MODULES[tool]:
        try:
            importlib.import_module(mod)
        except Exception as e:  # ImportError, or a tool that fails while importing
            return f"{mod} does not import here ({type(e).__name__}: {e}): {tool} checkpoints not written"
    return None


def tiny_config(kind):
    """The transformers config of the tiny model (see the module docstring)."""
    import transformers

    common = dict(vocab_size=128, hidden_size=256, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  num_experts_per_tok=2, max_position_embeddings=64, tie_word_embeddings=False)
    if kind == "mixtral":
        cfg = transformers.MixtralConfig(intermediate_size=256, num_local_experts=8, **common)
    elif kind == "qwen3_moe":
        cfg = transformers.Qwen3MoeConfig(intermediate_size=512, moe_intermediate_size=256, head_dim=64, num_experts=8,
                                          norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[], **common)
    else:
        raise ValueError(f"kind={kind!r}: expected one of {KINDS}")
    cfg.architectures = ["MixtralForCausalLM" if kind == "mixtral" else "Qwen3MoeForCausalLM"]
    return cfg


def tiny_model(kind, seed=0):
    """The tiny model in bfloat16, eval mode, experts at unit gain (see the module docstring)."""
    import torch
    import transformers

    torch.manual_seed(seed)
    cfg = tiny_config(kind)
    cls = transformers.MixtralForCausalLM if kind == "mixtral" else transformers.Qwen3MoeForCausalLM
    model = cls(cfg)
    with torch.no_grad():
        for mod in model.modules():
            if hasattr(mod, "gate_up_proj") and hasattr(mod, "down_proj"):
                E, I2, H = mod.gate_up_proj.shape
                mod.gate_up_proj.normal_(0, H ** -0.5)
                mod.down_proj.normal_(0, (I2 // 2) ** -0.5)
    return model.to(torch.bfloat16).eval()


def calibration_tokens():
    """The calibration batches: CALIB_SEQUENCES sequences of CALIB_TOKENS random token ids."""
    import torch

    g = torch.Generator().manual_seed(CALIB_SEED)
    return torch.randint(0, 128, (CALIB_SEQUENCES, CALIB_TOKENS), generator=g)


def _tokenizer():
    """A word-level tokenizer over the 128 token ids ("0" ... "127"): oneshot wants a processor beside a
    dataset, and the tiny model has none (the calibration data is token ids already)."""
    import tokenizers
    import transformers

    vocab = {str(i): i for i in range(128)}
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab=vocab, unk_token="0"))
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="0", pad_token="0")


def write_bf16(kind, out, seed=0):
    model = tiny_model(kind, seed)
    model.save_pretrained(out)
    return str(out)


def write_llmcompressor(kind, out, scheme="NVFP4", seed=0):
    """llm-compressor's oneshot with QuantizationModifier(scheme) on the experts' linear layers (the fused
    experts linearized first with its linearize_moe), saved compressed (nvfp4-pack-quantized)."""
    if scheme not in TOOLS["llmcompressor"]:
        raise ValueError(f"scheme={scheme!r}: expected one of {TOOLS['llmcompressor']}")
    from llmcompressor import oneshot
    from llmcompressor.modeling.moe.linearize import linearize_moe
    from llmcompressor.modifiers.quantization import QuantizationModifier

    import transformers

    # Loaded from a folder, as users do: oneshot reads the model's config again from where it came from.
    with tempfile.TemporaryDirectory() as src:
        tiny_model(kind, seed).save_pretrained(src)
        model = transformers.AutoModelForCausalLM.from_pretrained(src, dtype="bfloat16")
        linearize_moe(model)
        recipe = QuantizationModifier(targets=[r"re:.*\.experts\..*"], scheme=scheme, ignore=["lm_head"])
        if scheme == "NVFP4A16":
            oneshot(model=model, recipe=recipe)
        else:
            from datasets import Dataset

            ds = Dataset.from_dict({"input_ids": calibration_tokens().tolist()})
            oneshot(model=model, recipe=recipe, dataset=ds, processor=_tokenizer(),
                    num_calibration_samples=CALIB_SEQUENCES, max_seq_length=CALIB_TOKENS)
        model.save_pretrained(out, save_compressed=True)
    return str(out)


def write_modelopt(kind, out, scheme="NVFP4", seed=0):
    """ModelOpt's mtq.quantize with NVFP4_EXPERTS_ONLY_CFG (W4A16: the same with every input quantizer
    off), calibrated on calibration_tokens(), exported by export_hf_checkpoint."""
    if scheme not in TOOLS["modelopt"]:
        raise ValueError(f"scheme={scheme!r}: expected one of {TOOLS['modelopt']}")
    import modelopt.torch.quantization as mtq
    import torch
    from modelopt.torch.export import export_hf_checkpoint

    model = tiny_model(kind, seed)
    cfg = copy.deepcopy(mtq.NVFP4_EXPERTS_ONLY_CFG)
    if scheme == "W4A16":
        cfg["quant_cfg"].append({"quantizer_name": "*input_quantizer", "enable": False})
    batches = calibration_tokens().split(4)

    def forward_loop(m):
        with torch.no_grad():
            for b in batches:
                m(b)

    model = mtq.quantize(model, cfg, forward_loop=forward_loop)
    export_hf_checkpoint(model, export_dir=out)
    return str(out)


WRITERS = {"bf16": lambda kind, out, scheme, seed: write_bf16(kind, out, seed),
           "llmcompressor": write_llmcompressor, "modelopt": write_modelopt}

_cache = {}
_tmp = None


def _stamp(tool):
    """What a kept folder was written by: this file and the tool's version (a change writes anew)."""
    import hashlib
    import importlib.metadata as md

    h = hashlib.sha256(open(__file__, "rb").read())
    for dist in {"bf16": ("transformers", "torch"), "llmcompressor": ("llmcompressor", "transformers", "torch"),
                 "modelopt": ("nvidia-modelopt", "transformers", "torch")}[tool]:
        try:
            h.update(f"{dist}={md.version(dist)}".encode())
        except md.PackageNotFoundError:
            pass
    return h.hexdigest()[:10]


def checkpoint(kind, tool, scheme=None, seed=0):
    """The folder of `tool`'s checkpoint of the tiny `kind` model (scheme: the tool's first by default),
    written once per process (or once per MEGAMOE_REALTOOLS_DIR, where a finished folder is reused)."""
    global _tmp
    scheme = scheme or TOOLS[tool][0]
    key = (kind, tool, scheme, seed)
    if key in _cache:
        return _cache[key]
    root = os.environ.get("MEGAMOE_REALTOOLS_DIR")
    if not root:
        if _tmp is None:
            _tmp = tempfile.mkdtemp(prefix="megamoe-realtools-")
            atexit.register(shutil.rmtree, _tmp, True)
        root = _tmp
    out = os.path.join(root, f"{kind}-{tool}-{scheme}-seed{seed}-{_stamp(tool)}")
    done = os.path.join(out, ".complete")
    if not os.path.exists(done):
        shutil.rmtree(out, ignore_errors=True)
        WRITERS[tool](kind, out, scheme, seed)
        open(done, "w").close()
    _cache[key] = out
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description="Writes a tiny Mixtral / Qwen3-MoE checkpoint with a real tool.")
    ap.add_argument("out")
    ap.add_argument("--kind", choices=KINDS, required=True)
    ap.add_argument("--tool", choices=sorted(TOOLS), required=True)
    ap.add_argument("--scheme", default=None)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args(argv)
    why = missing(a.tool)
    if why:
        print(why, file=sys.stderr)
        return 3
    scheme = a.scheme or TOOLS[a.tool][0]
    if scheme not in TOOLS[a.tool]:
        ap.error(f"--scheme {scheme}: {a.tool} writes {', '.join(TOOLS[a.tool])}")
    print(WRITERS[a.tool](a.kind, a.out, scheme, a.seed))
    return 0


if __name__ == "__main__":
    sys.exit(main())
