"""transformers models swapped onto megamoe from checkpoints that real tools wrote (issue 38 item 7,
issue 39 item 3), on the CPU: tests/py/realtools.py writes the tiny Mixtral and Qwen3-MoE with
llm-compressor (compressed-tensors NVFP4, NVFP4A16) and ModelOpt (NVFP4, W4A16), experts only.

  - replace_experts(model, checkpoint=<export>) finds every block's layer, Mixtral's included (its
    files name the block `block_sparse_moe`, transformers 5's module is `mlp`), and the logits equal
    the same model whose experts are the float64 reference (SPEC §3 / §3b) of the export's weights, as
    the test of `megamoe quantize`'s checkpoints does (tests/py/test_transformers.py);
  - save_pretrained after replace_experts round-trips: a BF16 swap saves the model transformers loads
    back unchanged; a swap from a checkpoint saves its layers, which replace_experts loads back.
A tool that does not import here skips its cases, saying so."""
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers", reason="transformers is not installed: HF checkpoint tests not run")

import mmref as mr  # noqa: E402
import realtools  # noqa: E402
import test_transformers as tt  # noqa: E402

import megamoe  # noqa: E402
from megamoe.torch import hf  # noqa: E402

EXPORTS = [(tool, scheme) for tool in ("llmcompressor", "modelopt") for scheme in realtools.TOOLS[tool]]
WEIGHT_ONLY = {"NVFP4A16", "W4A16"}
TOKENS = torch.randint(0, 128, (2, 24), generator=torch.Generator().manual_seed(4))


def export(kind, tool, scheme):
    why = realtools.missing(tool)
    if why:
        pytest.skip(why)
    return realtools.checkpoint(kind, tool, scheme)


def loaded(kind):
    """The tiny model as transformers loads it from its bf16 save_pretrained folder (a model built from
    the config and cast to bf16 keeps bf16 rotary buffers, a loaded one float32: compare like with like)."""
    why = realtools.missing("bf16")
    if why:
        pytest.skip(why)
    path = realtools.checkpoint(kind, "bf16")
    return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).eval()


def reference_layer(path, prefix, E):
    """The NVFP4 layer `prefix` of a checkpoint as an mmref model, read with the safetensors package from
    whichever per-expert naming the tool wrote (gate_proj/up_proj/down_proj or w1/w3/w2; ModelOpt's
    weight / weight_scale_2 / input_scale, or compressed-tensors' weight_packed and reciprocal
    weight_global_scale / input_global_scale)."""
    import glob

    t = {}
    for f in glob.glob(f"{path}/*.safetensors"):
        t.update(mr.st_load(f))
    proj = ("w1", "w3", "w2") if f"{prefix}.experts.0.w1.weight" in t else ("gate_proj", "up_proj", "down_proj")
    packed = f"{prefix}.experts.0.{proj[0]}.weight_packed" in t

    def f(e, p, field):
        if packed:
            field = {"weight": "weight_packed", "weight_scale_2": "weight_global_scale",
                     "input_scale": "input_global_scale"}.get(field, field)
        v = t.get(f"{prefix}.experts.{e}.{proj[p]}.{field}")
        if v is not None and packed and field.endswith("global_scale"):
            v = np.float32(1) / v.astype(np.float32)
        return v

    m = {"format": "nvfp4", "E": E, "norm": None}
    m["w13"] = np.stack([np.concatenate([f(e, 0, "weight"), f(e, 1, "weight")]) for e in range(E)])
    m["w13_sf"] = np.stack([np.concatenate([f(e, 0, "weight_scale"), f(e, 1, "weight_scale")])
                            for e in range(E)]).view(np.uint8)
    m["w13_s2"] = np.array([[f(e, p, "weight_scale_2").item() for p in (0, 1)] for e in range(E)], dtype=np.float32)
    m["w2"] = np.stack([f(e, 2, "weight") for e in range(E)])
    m["w2_sf"] = np.stack([f(e, 2, "weight_scale") for e in range(E)]).view(np.uint8)
    m["w2_s2"] = np.array([f(e, 2, "weight_scale_2").item() for e in range(E)], dtype=np.float32)
    if f(0, 2, "input_scale") is not None:
        m["w2_in"] = np.array([f(e, 2, "input_scale").item() for e in range(E)], dtype=np.float32)
    m["H"], m["I"] = m["w2"].shape[1], m["w2"].shape[2] * 2
    return m


def swap(model, path, act):
    return hf.replace_experts(model, max_tokens=TOKENS.numel(), checkpoint=path, activations=act)


@pytest.mark.parametrize("tool,scheme", EXPORTS, ids=[f"{t}-{s}" for t, s in EXPORTS])
@pytest.mark.parametrize("kind", realtools.KINDS)
def test_replace_experts_loads_real_tool_exports(kind, tool, scheme):
    path = export(kind, tool, scheme)
    acts = ["bf16"] if scheme in WEIGHT_ONLY else ["bf16", "nvfp4"]
    with megamoe.Checkpoint(path) as ck:
        prefixes = [info["prefix"] for info in ck.layers()]
    want = "block_sparse_moe" if kind == "mixtral" else "mlp"
    assert prefixes == [f"model.layers.{i}.{want}" for i in (0, 1)], prefixes
    if scheme in WEIGHT_ONLY:  # no input scales: an nvfp4 layer refuses the export, naming what takes it
        with pytest.raises(megamoe.Error, match=r"input_(global_)?scale.*activations=bf16"):
            swap(realtools.tiny_model(kind), path, "nvfp4")
    for act in acts:
        model = realtools.tiny_model(kind)
        names = swap(model, path, act)
        assert names == ["model.layers.0.mlp", "model.layers.1.mlp"]
        ref_model = realtools.tiny_model(kind)
        for (name, block), p in zip(hf.moe_blocks(ref_model), prefixes):
            block.experts = tt.ReferenceExperts(reference_layer(path, p, 8), act)
        tt.force_routing(model, [ref_model])
        err = tt.rel(tt.logits(model, TOKENS, "cpu"), tt.logits(ref_model, TOKENS, "cpu"))
        print(f"{kind} {tool} {scheme}, {act} activations: rel L2 vs the float64 reference experts {err:.2e}")
        assert err <= tt.NVFP4_BOUND


def test_checkpoint_prefix_maps_block_names():
    names = ["model.layers.0.block_sparse_moe", "model.layers.1.mlp", "model.layers.2.mlp.experts"]
    assert hf.checkpoint_prefix(names, "model.layers.0.mlp") == "model.layers.0.block_sparse_moe"
    assert hf.checkpoint_prefix(names, "model.layers.1.mlp") == "model.layers.1.mlp"
    assert hf.checkpoint_prefix(names, "model.layers.2.mlp") == "model.layers.2.mlp.experts"
    assert hf.checkpoint_prefix(names, "model.layers.3.mlp") is None


def test_a_checkpoint_without_the_block_says_which_layers_it_has(tmp_path):
    model = realtools.tiny_model("qwen3_moe")
    mr.st_save(tmp_path / "other.safetensors",
               mr.checkpoint_tensors(mr.random_model("bf16", 8, 256, 256, seed=1, with_norm=False), "x.moe", "stacked"))
    with pytest.raises(megamoe.BadWeightError, match=r"no MoE layer for the block 'model.layers.0.mlp'.*\['x.moe'\]"):
        hf.replace_experts(model, max_tokens=8, checkpoint=tmp_path / "other.safetensors")


@pytest.mark.parametrize("kind", realtools.KINDS)
def test_save_pretrained_after_a_bf16_swap_round_trips(tmp_path, kind):
    original = loaded(kind).state_dict()
    swapped = loaded(kind)
    hf.replace_experts(swapped, max_tokens=TOKENS.numel())
    mm = tt.logits(swapped, TOKENS, "cpu")
    swapped.save_pretrained(tmp_path / "saved")
    again = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "saved", dtype=torch.bfloat16).eval()
    saved = again.state_dict()
    assert sorted(saved) == sorted(original)
    for k, v in original.items():
        assert torch.equal(saved[k], v), f"{k} differs from the model that was swapped"
    hf.replace_experts(again, max_tokens=TOKENS.numel())
    assert torch.equal(tt.logits(again, TOKENS, "cpu"), mm)
    dropped = loaded(kind)
    hf.replace_experts(dropped, max_tokens=TOKENS.numel(), keep_weights=False)
    with pytest.raises(megamoe.UnsupportedError, match="state_dict.. of a finalized module"):
        dropped.save_pretrained(tmp_path / "dropped")


@pytest.mark.parametrize("tool,scheme", [("llmcompressor", "NVFP4"), ("modelopt", "NVFP4")])
@pytest.mark.parametrize("kind", realtools.KINDS)
def test_save_pretrained_after_a_checkpoint_swap_round_trips(tmp_path, kind, tool, scheme):
    path = export(kind, tool, scheme)
    swapped = loaded(kind)
    swap(swapped, path, "nvfp4")
    mm = tt.logits(swapped, TOKENS, "cpu")
    swapped.save_pretrained(tmp_path / "saved")
    again = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "saved", dtype=torch.bfloat16).eval()
    hf.replace_experts(again, max_tokens=TOKENS.numel(), checkpoint=tmp_path / "saved", activations="nvfp4")
    assert torch.equal(tt.logits(again, TOKENS, "cpu"), mm)
