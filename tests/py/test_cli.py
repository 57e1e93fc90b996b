"""Every bad input gives a non-zero exit and a message naming the problem (SPEC §5); --help works."""
import shutil

import numpy as np
import pytest

import mmref as mr

E, K, H, I, T = 8, 2, 256, 256, 12


@pytest.fixture()
def setup(tmp_path):
    model = mr.random_model("nvfp4", E, H, I, seed=21)
    x, ids, w, pad = mr.random_inputs(T, K, H, E, seed=22)
    mr.calibrate_a2(model, x, ids, pad)
    tensors = mr.checkpoint_tensors(model, "layer", "per_expert")
    inp = tmp_path / "in.safetensors"
    mr.write_inputs(inp, x, ids, w, pad)
    return tmp_path, tensors, (x, ids, w, pad), inp


def run_expect_fail(tmp_path, tensors, inp, *needles, extra=()):
    ck = tmp_path / "bad.safetensors"
    mr.st_save(ck, tensors)
    p = mr.run_cli("run", "--checkpoint", ck, "--input", inp, "--output", tmp_path / "y.safetensors", *extra,
                   check=False)
    assert p.returncode != 0, p.stdout
    for n in needles:
        assert n in p.stderr, f"{n!r} not in {p.stderr!r}"
    assert not (tmp_path / "y.safetensors").exists()
    return p.stderr


def test_good_run_then_each_bad_checkpoint(setup):
    tmp, tensors, _, inp = setup
    mr.st_save(tmp / "good.safetensors", tensors)
    mr.run_cli("run", "--checkpoint", tmp / "good.safetensors", "--input", inp, "--output", tmp / "ok.safetensors")
    # A missing tensor.
    t = dict(tensors)
    del t["layer.experts.3.down_proj.weight_scale"]
    run_expect_fail(tmp, t, inp, "layer.experts.3.down_proj.weight_scale", "missing")
    # Wrong dtype, wrong shape: named with the file.
    t = dict(tensors)
    t["layer.experts.2.up_proj.weight_scale"] = t["layer.experts.2.up_proj.weight_scale"].view(np.uint8)
    run_expect_fail(tmp, t, inp, "experts.2.up_proj.weight_scale", "dtype U8, expected F8_E4M3", "bad.safetensors")
    t = dict(tensors)
    t["layer.experts.1.gate_proj.weight"] = t["layer.experts.1.gate_proj.weight"][:, :64]
    run_expect_fail(tmp, t, inp, "experts.1.gate_proj.weight", "expected [256, 128]")
    # An unknown weight name.
    t = dict(tensors)
    t["layer.experts.0.gate_proj.bias"] = np.zeros(I, np.float32)
    run_expect_fail(tmp, t, inp, "unexpected expert weight", "layer.experts.0.gate_proj.bias")
    # A NaN or negative block scale, a zero or NaN global scale: named with the expert.
    for byte, what in [(0x7F, "NaN"), (0xFF, "NaN"), (0xC0, "negative")]:
        t = dict(tensors)
        sf = t["layer.experts.5.down_proj.weight_scale"].view(np.uint8).copy()
        sf[3, 1] = byte
        t["layer.experts.5.down_proj.weight_scale"] = sf.view(mr.E4M3)
        run_expect_fail(tmp, t, inp, "experts.5.down_proj.weight_scale", "expert 5", what)
    for v in [0.0, np.nan, np.inf, -1.0]:
        t = dict(tensors)
        t["layer.experts.6.gate_proj.weight_scale_2"] = np.float32(v)
        run_expect_fail(tmp, t, inp, "experts.6.gate_proj.weight_scale_2", "finite and > 0")
        t = dict(tensors)
        t["layer.experts.4.down_proj.input_scale"] = np.float32(v)
        run_expect_fail(tmp, t, inp, "experts.4.down_proj.input_scale", "finite and > 0")


def test_bad_inputs(setup):
    tmp, tensors, (x, ids, w, pad), inp = setup
    ck = tmp / "good.safetensors"
    mr.st_save(ck, tensors)

    def fail(inputs, *needles, extra=()):
        path = tmp / "bad_in.safetensors"
        mr.st_save(path, inputs)
        p = mr.run_cli("run", "--checkpoint", ck, "--input", path, "--output", tmp / "y.safetensors", *extra, check=False)
        assert p.returncode != 0
        for n in needles:
            assert n in p.stderr, f"{n!r} not in {p.stderr!r}"

    good = {"hidden_states": x, "topk_ids": ids, "topk_weights": w, "is_padding": pad}
    bad_ids = ids.copy()
    bad_ids[5, 1] = E
    fail({**good, "topk_ids": bad_ids}, "token 5 slot 1", f"expert id {E} is outside [-1, {E})")
    bad_ids[5, 1] = -2
    fail({**good, "topk_ids": bad_ids}, "expert id -2")
    fail(good, f"got {T} tokens", "max_tokens=4", extra=("--max-tokens", 4))
    fail({k: v for k, v in good.items() if k != "topk_ids"}, "topk_ids")
    fail({**good, "topk_ids": ids.astype(np.int64)}, "topk_ids must be [T=12, K] I32")
    fail({**good, "hidden_states": x.astype(np.float32)}, "hidden_states must be [T, H] BF16")
    fail({**good, "hidden_states": np.zeros((T, 512), mr.BF16)}, "H=512", "H=256")
    fail({**good, "topk_weights": w[:, :1].copy()}, "topk_weights must be [T=12, K=2] F32")


def test_bad_files_and_usage(setup, tmp_path):
    tmp, tensors, _, inp = setup
    mr.st_save(tmp / "good.safetensors", tensors)
    data = (tmp / "good.safetensors").read_bytes()
    (tmp / "trunc.safetensors").write_bytes(data[: len(data) // 2])
    p = mr.run_cli("run", "--checkpoint", tmp / "trunc.safetensors", "--input", inp, "--output", tmp / "y", check=False)
    assert p.returncode != 0 and "trunc.safetensors" in p.stderr and "run past the end" in p.stderr
    p = mr.run_cli("run", "--checkpoint", tmp / "nope.safetensors", "--input", inp, "--output", tmp / "y", check=False)
    assert p.returncode != 0 and "nope.safetensors" in p.stderr
    p = mr.run_cli("inspect", tmp / "trunc.safetensors", check=False)
    assert p.returncode != 0 and "trunc.safetensors" in p.stderr
    for cmd in ["demo", "run", "bench", "inspect", "quantize"]:
        p = mr.run_cli(cmd, "--help")
        assert "usage: megamoe " + cmd in p.stdout
    assert mr.run_cli(check=False).returncode == 2
    assert mr.run_cli("frobnicate", check=False).returncode == 2
    assert mr.run_cli("run", check=False).returncode == 2
    p = mr.run_cli("run", "--checkpoint", tmp / "good.safetensors", "--input", inp, "--output", tmp / "y",
                   "--ranks", "abc", check=False)
    assert p.returncode != 0 and "abc" in p.stderr
    p = mr.run_cli("run", "--checkpoint", tmp / "good.safetensors", "--input", inp, "--output", tmp / "y",
                   "--ranks", "3", check=False)
    assert p.returncode != 0 and "E=8" in p.stderr and "R=3" in p.stderr
    for bad in (["--gemm", "fast"], ["--gpus", "0"], ["--tokens", "1,x"], ["--peak-tflops", "0"]):
        p = mr.run_cli("bench", *bad, check=False)
        assert p.returncode != 0 and bad[1] in p.stderr, (bad, p.stderr)
    p = mr.run_cli("bench", "--help")
    assert "--gpus" in p.stdout and "--gemm" in p.stdout and "--peak-tflops" in p.stdout


def test_cuda_backend_message_without_gpu(setup):
    tmp, tensors, _, inp = setup
    if shutil.which("nvidia-smi") and mr.run_cli("demo", "--backend", "cuda", "--tokens", "8", check=False).returncode == 0:
        pytest.skip("a usable GPU is present: the no-GPU message cannot be checked here")
    mr.st_save(tmp / "good.safetensors", tensors)
    p = mr.run_cli("run", "--checkpoint", tmp / "good.safetensors", "--input", inp, "--output", tmp / "y",
                   "--backend", "cuda", check=False)
    assert p.returncode != 0 and "--backend cuda" in p.stderr and "CUDA" in p.stderr
    p = mr.run_cli("run", "--checkpoint", tmp / "good.safetensors", "--input", inp, "--output", tmp / "y",
                   "--gpus", "2", check=False)
    assert p.returncode != 0 and "--gpus" in p.stderr
    p = mr.run_cli("bench", "--gpus", "2", "--tokens", "4", check=False)
    assert p.returncode != 0 and "--gpus" in p.stderr
