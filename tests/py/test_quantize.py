"""`megamoe quantize`: BF16 experts to NVFP4, bit-exact against a numpy ModelOpt-style quantizer,
in both input naming styles, sharded folders included; the result runs and matches the reference."""
import numpy as np
import pytest

import mmref as mr

E, H, I = 4, 256, 512


@pytest.mark.parametrize("style,shards", [("stacked", 0), ("per_expert", 0), ("per_expert_w", 2)])
def test_quantize_bit_exact_and_runs(tmp_path, style, shards):
    bf = mr.random_model("bf16", E, H, I, seed=31)
    tensors = mr.checkpoint_tensors(bf, "model.layers.0.mlp", style)
    tensors["lm_head.weight"] = np.arange(12, dtype=np.float32).reshape(3, 4)  # passes through
    if shards:
        src = tmp_path / "in"
        mr.st_save_sharded(src, tensors, shards)
        dst = tmp_path / "out"
    else:
        src = tmp_path / "in.safetensors"
        mr.st_save(src, tensors)
        dst = tmp_path / "out.safetensors"
    p = mr.run_cli("quantize", src, dst, "--calib-tokens", 16)
    assert "wrote" in p.stderr
    if shards:
        out = {}
        for f in sorted(dst.glob("*.safetensors")):
            out.update(mr.st_load(f))
        assert (dst / "model.safetensors.index.json").exists()
    else:
        out = mr.st_load(dst)
    assert (out["lm_head.weight"] == tensors["lm_head.weight"]).all()
    assert (out["model.layers.0.mlp.post_expert_norm.weight"] == bf["norm"]).all()
    names = mr.PROJ["w13" if style == "per_expert_w" else "gate_up_down"]
    nv = {"format": "nvfp4", "E": E, "H": H, "I": I, "norm": bf["norm"],
          "w13": np.zeros((E, 2 * I, H // 2), np.uint8), "w13_sf": np.zeros((E, 2 * I, H // 16), np.uint8),
          "w2": np.zeros((E, H, I // 2), np.uint8), "w2_sf": np.zeros((E, H, I // 16), np.uint8),
          "w13_s2": np.zeros((E, 2), np.float32), "w13_in": np.zeros((E, 2), np.float32),
          "w2_s2": np.zeros(E, np.float32), "w2_in": np.zeros(E, np.float32)}
    for e in range(E):
        for j, proj in enumerate(names):
            base = f"model.layers.0.mlp.experts.{e}.{proj}."
            w = bf["w13"][e, j * I:(j + 1) * I] if j < 2 else bf["w2"][e]
            codes, sf, alpha = mr.quantize_weight(w)
            assert out[base + "weight"].dtype == np.uint8 and (out[base + "weight"] == codes).all()
            assert (out[base + "weight_scale"].view(np.uint8) == sf).all()
            assert out[base + "weight_scale_2"].shape == () and out[base + "weight_scale_2"] == alpha
            ins = out[base + "input_scale"]
            assert ins.shape == () and np.isfinite(ins) and ins > 0
            if j < 2:
                nv["w13"][e, j * I:(j + 1) * I], nv["w13_sf"][e, j * I:(j + 1) * I] = codes, sf
                nv["w13_s2"][e, j], nv["w13_in"][e, j] = alpha, ins
            else:
                nv["w2"][e], nv["w2_sf"][e], nv["w2_s2"][e], nv["w2_in"][e] = codes, sf, alpha, ins
    # The quantized checkpoint runs and matches the reference computed from the same NVFP4 tensors.
    x, ids, w, pad = mr.random_inputs(20, 2, H, E, seed=32)
    mr.write_inputs(tmp_path / "x.safetensors", x, ids, w, pad)
    mr.run_cli("run", "--checkpoint", dst, "--input", tmp_path / "x.safetensors", "--output", tmp_path / "y.safetensors")
    y = mr.st_load(tmp_path / "y.safetensors")["y"].astype(np.float64)
    ref = mr.reference_layer(nv, x, ids, w, pad, gamma=bf["norm"])
    live = np.isfinite(ref).all(axis=1)
    assert mr.rel_l2(y[live], mr.bf16_round(ref[live])) <= 5e-3
    # And on tokens like the calibration's (N(0, 1)), NVFP4 stays near the BF16 layer it came from.
    x = np.random.default_rng(35).standard_normal((20, H)).astype(mr.BF16)
    mr.write_inputs(tmp_path / "x.safetensors", x, ids, w)
    mr.run_cli("run", "--checkpoint", dst, "--input", tmp_path / "x.safetensors", "--output", tmp_path / "y.safetensors")
    y = mr.st_load(tmp_path / "y.safetensors")["y"].astype(np.float64)
    ref_bf = mr.reference_layer(bf, x, ids, w, gamma=bf["norm"])
    err = mr.rel_l2(y, ref_bf)
    assert err < 0.3, err


def test_quantize_errors(tmp_path):
    nv = mr.random_model("nvfp4", E, H, I, seed=33)
    mr.st_save(tmp_path / "nv.safetensors", mr.checkpoint_tensors(nv, "m", "stacked"))
    p = mr.run_cli("quantize", tmp_path / "nv.safetensors", tmp_path / "o.safetensors", check=False)
    assert p.returncode != 0 and "no BF16 MoE expert weights" in p.stderr
    bf = mr.random_model("bf16", E, H, I, seed=34)
    t = mr.checkpoint_tensors(bf, "m", "per_expert")
    w = t["m.experts.2.down_proj.weight"].copy()
    w[0, 0] = np.nan
    t["m.experts.2.down_proj.weight"] = w
    mr.st_save(tmp_path / "nan.safetensors", t)
    p = mr.run_cli("quantize", tmp_path / "nan.safetensors", tmp_path / "o.safetensors", check=False)
    assert p.returncode != 0 and "m.experts.2.down_proj" in p.stderr and "NaN" in p.stderr
