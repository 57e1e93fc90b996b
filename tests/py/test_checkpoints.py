"""The C safetensors reader against files the Python safetensors package writes, the C writer
read back by the package, and `megamoe inspect` on every naming style and a sharded folder."""
import numpy as np

import mmref as mr


def inspect(path, *extra):
    return mr.run_cli("inspect", path, *extra).stdout


def test_reader_matches_package(tmp_path):
    rng = np.random.default_rng(1)
    tensors = {
        "a.f32": rng.standard_normal((3, 5)).astype(np.float32),
        "b.bf16": rng.standard_normal((7,)).astype(mr.BF16),
        "c.u8": rng.integers(0, 256, (2, 3, 4), dtype=np.uint8),
        "d.i32": rng.integers(-5, 5, (4,), dtype=np.int32),
        "e.e4m3": rng.standard_normal((9,)).astype(mr.E4M3),
        "f.bool": rng.random(5) < 0.5,
        "g.f64": rng.standard_normal((1, 1)),
        "h.i64": np.arange(3, dtype=np.int64),
        "i.f16": rng.standard_normal(4).astype(np.float16),
        "j.empty": np.zeros((0, 3), np.float32),
    }
    mr.st_save(tmp_path / "t.safetensors", tensors)
    out = inspect(tmp_path / "t.safetensors", "--tensors")
    names = {"F32": np.float32, "BF16": mr.BF16, "U8": np.uint8, "I32": np.int32, "F8_E4M3": mr.E4M3,
             "BOOL": np.bool_, "F64": np.float64, "I64": np.int64, "F16": np.float16}
    for name, a in tensors.items():
        line = next(l for l in out.splitlines() if l.split() and l.split()[0] == name)
        dt = line.split()[1]
        assert np.dtype(names[dt]) == a.dtype, line
        assert line.split(None, 2)[2] == "[" + ", ".join(map(str, a.shape)) + "]", line
    assert "10 tensors" in out


def test_writer_read_by_package(tmp_path):
    # y written by the C writer through `megamoe run` on an all-padding input, plus [] scalars
    # written by `megamoe quantize` (test_quantize.py) are read back by the package there.
    model = mr.random_model("bf16", 4, 256, 256, seed=2, with_norm=False)
    mr.st_save(tmp_path / "m.safetensors", mr.checkpoint_tensors(model, "", "stacked"))
    x = np.ones((3, 256), mr.BF16)
    mr.write_inputs(tmp_path / "in.safetensors", x, np.zeros((3, 1), np.int32), np.ones((3, 1), np.float32),
                    np.ones(3, bool))
    mr.run_cli("run", "--checkpoint", tmp_path / "m.safetensors", "--input", tmp_path / "in.safetensors",
               "--output", tmp_path / "y.safetensors")
    y = mr.st_load(tmp_path / "y.safetensors")["y"]
    assert y.shape == (3, 256) and (y.astype(np.float32) == 0).all()


def test_inspect_styles_and_shards(tmp_path):
    for fmt in ["nvfp4", "bf16"]:
        model = mr.random_model(fmt, 4, 256, 512, seed=3)
        styles = ["stacked", "per_expert", "per_expert_w"] + (["ct_per_expert", "ct_stacked"] if fmt == "nvfp4" else [])
        for style in styles:
            path = tmp_path / f"{fmt}_{style}.safetensors"
            mr.st_save(path, mr.checkpoint_tensors(model, "model.layers.7.mlp", style))
            out = inspect(path)
            assert "1 MoE layer" in out and "model.layers.7.mlp" in out, out
            assert f"E=4 H=256 I=512 norm=yes" in out and fmt.upper() in out, out
    t = mr.checkpoint_tensors(mr.random_model("nvfp4", 4, 256, 256, seed=4), "model.layers.0.mlp", "per_expert")
    t.update(mr.checkpoint_tensors(mr.random_model("bf16", 8, 256, 256, seed=5, with_norm=False), "model.layers.1.mlp",
                                   "stacked"))
    mr.st_save_sharded(tmp_path / "sharded", t, 4)
    out = inspect(tmp_path / "sharded")
    assert "4 files" in out and "2 MoE layers" in out
    assert "model.layers.0.mlp" in out and "model.layers.1.mlp" in out and "norm=no" in out
    # A checkpoint with two layers needs --prefix to run.
    x = np.ones((2, 256), mr.BF16)
    mr.write_inputs(tmp_path / "in.safetensors", x, np.zeros((2, 1), np.int32), np.ones((2, 1), np.float32))
    p = mr.run_cli("run", "--checkpoint", tmp_path / "sharded", "--input", tmp_path / "in.safetensors", "--output",
                   tmp_path / "y.safetensors", check=False)
    assert p.returncode != 0 and "--prefix" in p.stderr
    mr.run_cli("run", "--checkpoint", tmp_path / "sharded", "--prefix", "model.layers.1.mlp", "--input",
               tmp_path / "in.safetensors", "--output", tmp_path / "y.safetensors")


def test_inspect_intermediate_multiple_of_64(tmp_path):
    """SPEC §1: any I that is a multiple of 64 (GLM-4.5-Air and DeepSeek-V2-Lite use 1408)."""
    for fmt, style, I in (("nvfp4", "per_expert", 1408), ("nvfp4", "ct_stacked", 192), ("bf16", "stacked", 64)):
        path = tmp_path / f"{fmt}_{style}_{I}.safetensors"
        mr.st_save(path, mr.checkpoint_tensors(mr.random_model(fmt, 2, 256, I, seed=I), "model.layers.1.mlp", style))
        out = inspect(path)
        assert "1 MoE layer" in out and f"E=2 H=256 I={I} norm=yes" in out and fmt.upper() in out, out
    # One below and one between the multiples are refused, naming the rule.
    for I in (32, 200):
        path = tmp_path / f"odd_{I}.safetensors"
        mr.st_save(path, mr.checkpoint_tensors(mr.random_model("bf16", 2, 256, I, seed=I), "m", "stacked"))
        p = mr.run_cli("inspect", path, check=False)
        assert p.returncode == 1 and f"I={I}" in p.stderr and "multiple of 64" in p.stderr, p.stderr
