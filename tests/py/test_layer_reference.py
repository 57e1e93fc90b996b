"""The whole layer: `megamoe run` on checkpoints and inputs written by the safetensors package,
against the float64 reference of mmref.py, in both formats (NVFP4 in both activation modes, SPEC §3b),
every naming style, R = 1, 2, 4."""
import zlib

import numpy as np
import pytest

import mmref as mr

# Keys: "bf16" (BF16 weights), "nvfp4" (NVFP4 weights and activations, SPEC §3), "w4a16" (NVFP4
# weights, BF16 activations, §3b: the bf16 layer's arithmetic on decoded weights, so its bound).
TOL = {"nvfp4": 5e-3, "bf16": 5e-4, "w4a16": 5e-4}


def tol_key(fmt, activations):
    return "w4a16" if fmt == "nvfp4" and activations == "bf16" else fmt


def check_rows(y, x, ids, pad):
    """SPEC §5: NaN rows exactly where a live token is non-finite, zero rows where no slot is valid."""
    xf = np.asarray(x).astype(np.float32)
    nonfinite = ~np.isfinite(xf).all(axis=1) & ~pad
    no_slot = ((ids < 0).all(axis=1) | pad) & ~nonfinite
    yf = y.astype(np.float64)
    assert np.isnan(yf[nonfinite]).all()
    assert not np.isnan(yf[~nonfinite]).any()
    assert (yf[no_slot] == 0).all()


def run_layer(tmp_path, model, style, x, ids, w, pad, ranks=(1, 2, 4), prefix="model.layers.0.mlp.experts_layer",
              extra=(), gamma=None, eps=1e-6, clamp=0.0, shards=0, scalar_shape=(), modes=None, input_scales=True):
    """Runs the checkpoint with `megamoe run` for each R (an NVFP4 model in both activation modes, or
    those of `modes`) and checks y against the float64 reference; returns the errors by activation mode."""
    tensors = mr.checkpoint_tensors(model, prefix, style, scalar_shape, input_scales=input_scales)
    tensors["model.embed_tokens.weight"] = np.zeros((4, 8), dtype=np.float32)  # an unrelated tensor
    if shards:
        ckpt = tmp_path / "ckpt"
        mr.st_save_sharded(ckpt, tensors, shards)
    else:
        ckpt = tmp_path / "model.safetensors"
        mr.st_save(ckpt, tensors)
    inp = tmp_path / "inputs.safetensors"
    mr.write_inputs(inp, x, ids, w, pad)
    errs = {}
    for act in modes or (["bf16", "nvfp4"] if model["format"] == "nvfp4" else ["bf16"]):
        ref = mr.reference_layer(model, x, ids, w, pad, norm_eps=eps, clamp=clamp,
                                 gamma=gamma if gamma is not None else model["norm"], activations=act)
        ys = []
        for R in ranks:
            out = tmp_path / f"y{R}.safetensors"
            mr.run_cli("run", "--checkpoint", ckpt, "--input", inp, "--output", out, "--ranks", R,
                       "--activations", act, *extra)
            y = mr.st_load(out)["y"]
            assert y.dtype == mr.BF16 and y.shape == x.shape
            ys.append(y)
        for y in ys[1:]:
            assert y.view(np.uint16).tobytes() == ys[0].view(np.uint16).tobytes(), "y depends on R"
        check_rows(ys[0], x, ids, pad)
        live = np.isfinite(ref).all(axis=1)
        # SPEC §5 ends with y = bf16_rn(sum): the reference takes that last rounding too.
        err = mr.rel_l2(ys[0].astype(np.float64)[live], mr.bf16_round(ref[live]))
        tol = TOL[tol_key(model["format"], act)]
        assert err <= tol, f"relative L2 {err:.2e} over {tol} ({model['format']}, activations {act})"
        print(f"rel_l2 {model['format']} activations {act} {style}: {err:.2e}")
        errs[act] = err
    return errs


@pytest.mark.parametrize("fmt,style", [
    ("nvfp4", "stacked"), ("nvfp4", "per_expert"), ("nvfp4", "per_expert_w"), ("nvfp4", "ct_per_expert"),
    ("nvfp4", "ct_stacked"), ("bf16", "stacked"), ("bf16", "per_expert"), ("bf16", "per_expert_w")])
def test_naming_styles(tmp_path, fmt, style):
    E, K, H, I, T = 8, 4, 256, 256, 40
    model = mr.random_model(fmt, E, H, I, seed=zlib.crc32(f"{fmt}/{style}".encode()))
    x, ids, w, pad = mr.random_inputs(T, K, H, E, seed=7)
    mr.calibrate_a2(model, x, ids, pad)
    run_layer(tmp_path, model, style, x, ids, w, pad)


@pytest.mark.parametrize("fmt", ["nvfp4", "bf16"])
def test_sharded_scalars_as_1(tmp_path, fmt):
    E, K, H, I, T = 8, 2, 512, 256, 33
    model = mr.random_model(fmt, E, H, I, seed=3)
    x, ids, w, pad = mr.random_inputs(T, K, H, E, seed=8)
    mr.calibrate_a2(model, x, ids, pad)
    run_layer(tmp_path, model, "per_expert", x, ids, w, pad, shards=3, scalar_shape=(1,))


@pytest.mark.parametrize("fmt", ["nvfp4", "bf16"])
def test_zero_centered_norm_eps_clamp(tmp_path, fmt):
    E, K, H, I, T = 4, 3, 256, 512, 24
    model = mr.random_model(fmt, E, H, I, seed=5)
    model["norm"] = (0.1 * np.random.default_rng(1).standard_normal(H)).astype(mr.BF16)  # stored as bf16
    gamma = model["norm"].astype(np.float64) + 1.0
    x, ids, w, pad = mr.random_inputs(T, K, H, E, seed=9)
    mr.calibrate_a2(model, x, ids, pad)
    clamp = 0.3
    # Calibrate a2 with the clamp in force, as the quantizer would.
    run_layer(tmp_path, model, "stacked", x, ids, w, pad, ranks=(1, 4), gamma=gamma, eps=1e-3, clamp=clamp,
              extra=("--norm-zero-centered", "--norm-gain-center", "1.0", "--norm-eps", "1e-3", "--clamp", str(clamp)))


@pytest.mark.parametrize("fmt", ["nvfp4", "bf16"])
def test_no_norm_k1_k8_t_max(tmp_path, fmt):
    for K, E in [(1, 4), (8, 16)]:
        H, I, T = 256, 256, 16
        model = mr.random_model(fmt, E, H, I, seed=K, with_norm=False)
        x, ids, w, pad = mr.random_inputs(T, K, H, E, seed=K + 1)
        mr.calibrate_a2(model, x, ids, pad)
        # T = T_max per rank: 16 tokens over 2 ranks with --max-tokens 8.
        run_layer(tmp_path, model, "stacked", x, ids, w, pad, ranks=(1, 2))
        out = tmp_path / "tmax.safetensors"
        mr.run_cli("run", "--checkpoint", tmp_path / "model.safetensors", "--input", tmp_path / "inputs.safetensors",
                   "--output", out, "--ranks", 2, "--max-tokens", 8)


def test_all_tokens_one_expert_and_empty_experts(tmp_path):
    E, K, H, I, T = 8, 2, 256, 256, 20
    model = mr.random_model("nvfp4", E, H, I, seed=11)
    x, ids, w, pad = mr.random_inputs(T, K, H, E, seed=12, edge_cases=False)
    ids[:, 0] = 5   # every token on expert 5 (rank 2 of 4), most experts see nothing
    ids[:, 1] = -1
    mr.calibrate_a2(model, x, ids, pad)
    run_layer(tmp_path, model, "stacked", x, ids, w, pad)


def test_empty_input(tmp_path):
    E, K, H, I = 8, 2, 256, 256
    model = mr.random_model("bf16", E, H, I, seed=13)
    mr.st_save(tmp_path / "m.safetensors", mr.checkpoint_tensors(model, "moe", "stacked"))
    x = np.zeros((0, H), dtype=mr.BF16)
    mr.write_inputs(tmp_path / "in.safetensors", x, np.zeros((0, K), np.int32), np.zeros((0, K), np.float32))
    mr.run_cli("run", "--checkpoint", tmp_path / "m.safetensors", "--input", tmp_path / "in.safetensors",
               "--output", tmp_path / "y.safetensors", "--ranks", 2)
    assert mr.st_load(tmp_path / "y.safetensors")["y"].shape == (0, H)


def test_activations_option(tmp_path):
    """SPEC §3b: a BF16-weight layer refuses nvfp4 activations, naming the rule; a bad value is a usage error."""
    E, K, H, I, T = 4, 2, 256, 256, 8
    model = mr.random_model("bf16", E, H, I, seed=14)
    mr.st_save(tmp_path / "m.safetensors", mr.checkpoint_tensors(model, "moe", "stacked"))
    x, ids, w, pad = mr.random_inputs(T, K, H, E, seed=15)
    mr.write_inputs(tmp_path / "in.safetensors", x, ids, w, pad)
    args = ("run", "--checkpoint", tmp_path / "m.safetensors", "--input", tmp_path / "in.safetensors",
            "--output", tmp_path / "y.safetensors")
    p = mr.run_cli(*args, "--activations", "nvfp4", check=False)
    assert p.returncode == 1 and "BF16-weight layer accepts only BF16" in p.stderr, p.stderr
    p = mr.run_cli(*args, "--activations", "fp8", check=False)
    assert p.returncode != 0 and "fp8" in p.stderr, p.stderr
    mr.run_cli(*args, "--activations", "bf16")


@pytest.mark.parametrize("fmt,style,I", [
    ("nvfp4", "stacked", 192), ("nvfp4", "ct_per_expert", 320), ("nvfp4", "per_expert", 64),
    ("bf16", "per_expert", 192), ("bf16", "stacked", 320)])
def test_intermediate_multiple_of_64(tmp_path, fmt, style, I):
    """SPEC §1: I is any multiple of 64 (real models use 1408); the CPU backend computes at I exactly."""
    E, K, H, T = 8, 4, 256, 40
    model = mr.random_model(fmt, E, H, I, seed=zlib.crc32(f"{fmt}/{style}/{I}".encode()))
    x, ids, w, pad = mr.random_inputs(T, K, H, E, seed=I)
    mr.calibrate_a2(model, x, ids, pad)
    run_layer(tmp_path, model, style, x, ids, w, pad)


@pytest.mark.parametrize("style", ["stacked", "per_expert", "ct_per_expert", "ct_stacked"])
def test_weight_only_exports(tmp_path, style):
    """SPEC §6: a weight-only NVFP4 export (compressed-tensors NVFP4A16, ModelOpt W4A16: no input scales)
    runs with activations bf16 against the float64 reference; activations nvfp4 refuses it, naming the
    missing input scale and the mode that takes it."""
    E, K, H, I, T = 8, 4, 256, 192, 40
    model = mr.random_model("nvfp4", E, H, I, seed=zlib.crc32(f"weight-only/{style}".encode()))
    x, ids, w, pad = mr.random_inputs(T, K, H, E, seed=21)
    run_layer(tmp_path, model, style, x, ids, w, pad, ranks=(1, 2), modes=["bf16"], input_scales=False)
    ckpt = tmp_path / "model.safetensors"
    assert not any("input" in n for n in mr.st_load(ckpt)), "the export has input scales"
    p = mr.run_cli("run", "--checkpoint", ckpt, "--input", tmp_path / "inputs.safetensors", "--output",
                   tmp_path / "y.safetensors", "--activations", "nvfp4", check=False)
    field = {"stacked": "w2_input_scale", "ct_stacked": "w2_input_global_scale",
             "per_expert": "experts.0.down_proj.input_scale",
             "ct_per_expert": "experts.0.down_proj.input_global_scale"}[style]
    assert p.returncode == 1, p.stderr
    assert field in p.stderr and "activations=bf16" in p.stderr and "weight-only" in p.stderr, p.stderr
