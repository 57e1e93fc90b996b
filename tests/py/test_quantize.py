"""`megamoe quantize`: BF16 experts to NVFP4, bit-exact against a numpy ModelOpt-style quantizer,
in both input naming styles, sharded folders included; the result runs and matches the reference."""
import os
import resource
import signal
import subprocess

import numpy as np
import pytest

import mmref as mr

E, H, I = 4, 256, 512


@pytest.mark.parametrize("style,shards,I", [("stacked", 0, I), ("per_expert", 0, I), ("per_expert_w", 2, I),
                                            ("stacked", 0, 320), ("per_expert", 0, 192)])
def test_quantize_bit_exact_and_runs(tmp_path, style, shards, I):
    """I = 320 and 192: any multiple of 64 (SPEC §1), as real models' 1408."""
    bf = mr.random_model("bf16", E, H, I, seed=31 + I % 512)
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


# ---- A hostile user's inputs (issue 25): shapes checked before any data is read, clear messages,
# nothing left behind on failure, the input never replaced ----

def no_sanitizer_report(p):
    assert p.returncode in (0, 1, 2), (p.returncode, p.stderr)
    assert "runtime error" not in p.stderr and "Sanitizer" not in p.stderr, p.stderr


def quantize_fails(tmp_path, tensors, *needles, extra=(), unwanted=("NaN",)):
    src, dst = tmp_path / "bad_in.safetensors", tmp_path / "bad_out.safetensors"
    mr.st_save(src, tensors)
    p = mr.run_cli("quantize", src, dst, "--calib-tokens", 4, *extra, check=False)
    no_sanitizer_report(p)
    assert p.returncode == 1, p.stderr
    for n in needles:
        assert n in p.stderr, f"{n!r} not in {p.stderr!r}"
    for n in unwanted:
        assert n not in p.stderr, f"{n!r} in {p.stderr!r}"
    assert not dst.exists() and "wrote" not in p.stderr
    return p.stderr


def test_quantize_checks_stacked_shapes(tmp_path):
    bf = mr.random_model("bf16", E, H, I, seed=41)
    good = mr.checkpoint_tensors(bf, "m", "stacked")
    w2 = good["m.w2_weight"]
    for bad in (np.zeros((1, 1), mr.BF16), np.zeros((E, H, 384), mr.BF16), np.ascontiguousarray(w2.transpose(0, 2, 1)),
                w2[:2].copy(), np.zeros((E + 1, H, I), mr.BF16)):
        quantize_fails(tmp_path, {**good, "m.w2_weight": bad}, "m.w2_weight", f"expected [{E}, {H}, {I}]")
    # w13 given as [E, H, 2I]: read as H=1024, I=128, which w2 then contradicts
    quantize_fails(tmp_path, {**good, "m.w13_weight": np.ascontiguousarray(good["m.w13_weight"].transpose(0, 2, 1))},
                   "m.w2_weight", f"expected [{E}, 1024, 128]")
    # as [E, 2I, H] of I = 96: not a multiple of 64, which the layer rules refuse
    quantize_fails(tmp_path, {**good, "m.w13_weight": np.zeros((E, 192, H), mr.BF16)}, "I=96", "multiple of 64")
    for dt in (np.float32, np.uint8):
        quantize_fails(tmp_path, {**good, "m.w2_weight": np.zeros((E, H, I), dt)}, "m.w2_weight",
                       "expected BF16")


def test_quantize_names_the_shape_problem(tmp_path):
    for h, i, needle in ((250, 512, "H=250"), (264, 512, "H=264"), (272, 512, "H=272"), (256, 100, "I=100"),
                         (256, 96, "I=96"), (256, 32, "I=32")):
        rule = "multiple of 256" if needle.startswith("H") else "multiple of 64"
        rng = np.random.default_rng(1)
        bf = {"format": "bf16", "E": E, "H": h, "I": i, "norm": None,
              "w13": (rng.standard_normal((E, 2 * i, h)) * 0.02).astype(mr.BF16),
              "w2": (rng.standard_normal((E, h, i)) * 0.02).astype(mr.BF16)}
        for style in ("stacked", "per_expert"):
            t = mr.checkpoint_tensors(bf, "m", style)
            quantize_fails(tmp_path, t, needle, rule)
            mr.st_save(tmp_path / "odd.safetensors", t)
            p = mr.run_cli("inspect", tmp_path / "odd.safetensors", check=False)
            no_sanitizer_report(p)
            assert p.returncode == 1 and needle in p.stderr and rule in p.stderr, p.stderr
    # per expert: one down projection of another I
    bf = mr.random_model("bf16", E, H, I, seed=42)
    t = mr.checkpoint_tensors(bf, "m", "per_expert")
    t["m.experts.3.down_proj.weight"] = np.zeros((H, 256), mr.BF16)
    quantize_fails(tmp_path, t, "m.experts.3.down_proj.weight", f"expected [{H}, {I}]")
    t = mr.checkpoint_tensors(bf, "m", "per_expert")
    t["m.experts.1.up_proj.weight"] = np.zeros((I, H), np.float32)
    quantize_fails(tmp_path, t, "m.experts.1.up_proj.weight", "expected BF16")


def test_quantize_refuses_weights_that_overflow(tmp_path):
    bf = mr.random_model("bf16", E, H, I, seed=43)
    t = mr.checkpoint_tensors(bf, "m", "per_expert")
    t["m.experts.2.gate_proj.weight"] = np.full((I, H), 1e37, mr.BF16)
    t["m.experts.2.up_proj.weight"] = np.full((I, H), 1e37, mr.BF16)
    quantize_fails(tmp_path, t, "expert 2", "overflow")


def test_quantize_names_nan_and_inf(tmp_path):
    bf = mr.random_model("bf16", E, H, I, seed=44)
    for v, word in ((np.nan, "NaN"), (np.inf, "infinity")):
        t = mr.checkpoint_tensors(bf, "m", "stacked")
        w = t["m.w13_weight"].copy()
        w[3, 5, 7] = v
        t["m.w13_weight"] = w
        quantize_fails(tmp_path, t, "m.w13_weight", "expert 3", word, unwanted=())


def test_quantize_clamp_validated(tmp_path):
    bf = mr.random_model("bf16", E, H, I, seed=45)
    mr.st_save(tmp_path / "in.safetensors", mr.checkpoint_tensors(bf, "m", "stacked"))
    for bad in ("nan", "-1", "inf", "-inf"):
        p = mr.run_cli("quantize", tmp_path / "in.safetensors", tmp_path / "o.safetensors", "--clamp", bad,
                       check=False)
        no_sanitizer_report(p)
        assert p.returncode != 0 and "clamp" in p.stderr and "finite and >= 0" in p.stderr, p.stderr
        assert not (tmp_path / "o.safetensors").exists()


def test_failed_folder_quantize_leaves_nothing(tmp_path):
    bf = mr.random_model("bf16", E, H, I, seed=46)
    t = mr.checkpoint_tensors(bf, "m", "per_expert")
    names = sorted(t)
    # the last expert weight of the second shard (st_save_sharded puts sorted name i in shard i % 2)
    last = [n for i, n in enumerate(names) if i % 2 == 1 and ".experts." in n][-1]
    w = t[last].copy()
    w[0, 0] = np.nan
    t[last] = w
    mr.st_save_sharded(tmp_path / "in", t, 2)
    before = sorted(os.listdir(tmp_path))
    p = mr.run_cli("quantize", tmp_path / "in", tmp_path / "out", "--calib-tokens", 4, check=False)
    no_sanitizer_report(p)
    assert p.returncode == 1 and last in p.stderr, p.stderr
    assert sorted(os.listdir(tmp_path)) == before  # no OUT, no temporary folder
    # A write that fails part-way (files limited to 4 KB): the temporary folder is removed too.
    mr.st_save_sharded(tmp_path / "in2", mr.checkpoint_tensors(bf, "m", "per_expert"), 2)
    before = sorted(os.listdir(tmp_path))

    def limit_file_size():
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG instead
        resource.setrlimit(resource.RLIMIT_FSIZE, (4096, 4096))

    p = subprocess.run([mr.cli_path(), "quantize", str(tmp_path / "in2"), str(tmp_path / "out"), "--calib-tokens",
                        "4"], capture_output=True, text=True, timeout=300, preexec_fn=limit_file_size)
    no_sanitizer_report(p)
    assert p.returncode == 1 and "wrote" not in p.stderr, p.stderr
    assert sorted(os.listdir(tmp_path)) == before
    # An existing OUT folder is not mixed into.
    (tmp_path / "out").mkdir()
    p = mr.run_cli("quantize", tmp_path / "in2", tmp_path / "out", "--calib-tokens", 4, check=False)
    assert p.returncode == 1 and "exists" in p.stderr, p.stderr
    mr.run_cli("quantize", tmp_path / "in2", tmp_path / "out2", "--calib-tokens", 4)
    assert sorted(os.listdir(tmp_path / "out2")) == sorted(os.listdir(tmp_path / "in2"))


def test_quantize_never_replaces_its_input(tmp_path):
    bf = mr.random_model("bf16", E, H, I, seed=47)
    src = tmp_path / "in.safetensors"
    mr.st_save(src, mr.checkpoint_tensors(bf, "m", "stacked"))
    os.link(src, tmp_path / "hard.safetensors")
    os.symlink(src, tmp_path / "soft.safetensors")
    data = src.read_bytes()
    for out in (src, tmp_path / "hard.safetensors", tmp_path / "soft.safetensors", tmp_path / "." / "in.safetensors"):
        p = mr.run_cli("quantize", src, out, check=False)
        no_sanitizer_report(p)
        assert p.returncode == 1 and "would replace" in p.stderr, p.stderr
    assert src.read_bytes() == data
    mr.st_save_sharded(tmp_path / "folder", mr.checkpoint_tensors(bf, "m", "per_expert"), 2)
    p = mr.run_cli("quantize", tmp_path / "folder", tmp_path / "folder", check=False)
    assert p.returncode == 1 and ("would replace" in p.stderr or "exists" in p.stderr), p.stderr
