"""Every bad input gives a non-zero exit and a message naming the problem (SPEC §5); --help works."""
import json
import os
import re
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


# ---- A hostile user's inputs (issue 25): each fails cleanly, with a message naming the problem ----

def no_sanitizer_report(p):
    """The process ended by its own error path: no ASan/UBSan report, no signal."""
    assert p.returncode in (0, 1, 2), (p.returncode, p.stderr)
    assert "runtime error" not in p.stderr and "Sanitizer" not in p.stderr, p.stderr


def test_threads_bounded(setup):
    tmp, tensors, _, inp = setup
    mr.st_save(tmp / "good.safetensors", tensors)
    for n in ("100000", "40000", "1025", "-1"):
        p = mr.run_cli("run", "--checkpoint", tmp / "good.safetensors", "--input", inp, "--output",
                       tmp / "y.safetensors", "--threads", n, check=False)
        no_sanitizer_report(p)
        assert p.returncode != 0 and "--threads" in p.stderr and "1024" in p.stderr, p.stderr
        assert not (tmp / "y.safetensors").exists()
        p = mr.run_cli("bench", "--experts", 8, "--top-k", 2, "--hidden", 256, "--inter", 256, "--tokens", 4,
                       "--threads", n, check=False)
        no_sanitizer_report(p)
        assert p.returncode != 0 and "--threads" in p.stderr and "1024" in p.stderr, p.stderr
        p = mr.run_cli("demo", "--backend", "cpu", "--tokens", 4, "--threads", n, check=False)
        no_sanitizer_report(p)
        assert p.returncode != 0 and "--threads" in p.stderr and "1024" in p.stderr, p.stderr
    mr.run_cli("run", "--checkpoint", tmp / "good.safetensors", "--input", inp, "--output",
               tmp / "y.safetensors", "--threads", "1024")


def test_ranks_bounded(setup):
    tmp, tensors, _, inp = setup
    mr.st_save(tmp / "good.safetensors", tensors)
    for n in ("2147483647", "1000000", "0"):
        p = mr.run_cli("run", "--checkpoint", tmp / "good.safetensors", "--input", inp, "--output",
                       tmp / "y.safetensors", "--ranks", n, check=False)
        no_sanitizer_report(p)
        assert p.returncode != 0 and "--ranks" in p.stderr, p.stderr
        p = mr.run_cli("bench", "--experts", 8, "--top-k", 2, "--hidden", 256, "--inter", 256, "--tokens", 4,
                       "--ranks", n, check=False)
        no_sanitizer_report(p)
        assert p.returncode != 0 and "--ranks" in p.stderr, p.stderr


def test_fifo_refused_without_blocking(setup):
    tmp, tensors, _, inp = setup
    mr.st_save(tmp / "good.safetensors", tensors)
    fifo = tmp / "fifo.safetensors"
    os.mkfifo(fifo)
    folder = tmp / "ck"
    folder.mkdir()
    os.mkfifo(folder / "model.safetensors.index.json")
    runs = [("inspect", fifo), ("inspect", folder),
            ("run", "--checkpoint", fifo, "--input", inp, "--output", tmp / "y.safetensors"),
            ("run", "--checkpoint", folder, "--input", inp, "--output", tmp / "y.safetensors"),
            ("run", "--checkpoint", tmp / "good.safetensors", "--input", fifo, "--output", tmp / "y.safetensors"),
            ("quantize", fifo, tmp / "q.safetensors")]
    for args in runs:
        p = mr.run_cli(*args, check=False, timeout=20)  # a FIFO opened for reading would block forever
        no_sanitizer_report(p)
        assert p.returncode != 0 and "not a regular file" in p.stderr, (args, p.stderr)
    assert not (tmp / "y.safetensors").exists() and not (tmp / "q.safetensors").exists()


def test_input_dimension_not_truncated(setup):
    tmp, tensors, _, inp = setup
    mr.st_save(tmp / "good.safetensors", tensors)
    path = tmp / "wide.safetensors"
    big = 2**32 + 2  # (int)big == 2
    mr.st_save(path, {"hidden_states": np.zeros((0, H), mr.BF16), "topk_ids": np.zeros((0, big), np.int32),
                      "topk_weights": np.zeros((0, 2), np.float32)})
    p = mr.run_cli("run", "--checkpoint", tmp / "good.safetensors", "--input", path, "--output",
                   tmp / "y.safetensors", check=False)
    no_sanitizer_report(p)
    assert p.returncode != 0 and "topk_ids" in p.stderr and str(big) in p.stderr, p.stderr
    assert not (tmp / "y.safetensors").exists()


def test_output_never_replaces_an_input(setup):
    tmp, tensors, _, inp = setup
    ck = tmp / "good.safetensors"
    mr.st_save(ck, tensors)
    os.link(inp, tmp / "inp_link.safetensors")
    before = {f: f.read_bytes() for f in (ck, inp)}
    for out in (ck, inp, tmp / "inp_link.safetensors", tmp / "." / "good.safetensors"):
        p = mr.run_cli("run", "--checkpoint", ck, "--input", inp, "--output", out, check=False)
        no_sanitizer_report(p)
        assert p.returncode != 0 and "--output" in p.stderr and "would replace" in p.stderr, p.stderr
    assert all(f.read_bytes() == b for f, b in before.items())
    # A sharded checkpoint: neither its index nor a shard.
    mr.st_save_sharded(tmp / "sharded", tensors, 2)
    index = tmp / "sharded" / "model.safetensors.index.json"
    shard = sorted((tmp / "sharded").glob("*.safetensors"))[1]
    before = {f: f.read_bytes() for f in (index, shard)}
    for ck_arg, out in ((index, index), (index, shard), (tmp / "sharded", shard)):
        p = mr.run_cli("run", "--checkpoint", ck_arg, "--input", inp, "--output", out, check=False)
        assert p.returncode != 0 and "would replace" in p.stderr, p.stderr
    assert all(f.read_bytes() == b for f, b in before.items())


def test_bad_expert_ids_write_nothing_and_say_so(setup):
    tmp, tensors, (x, ids, w, pad), _ = setup
    mr.st_save(tmp / "good.safetensors", tensors)
    bad = ids.copy()
    bad[5, 1] = E + 3
    mr.write_inputs(tmp / "bad.safetensors", x, bad, w, pad)
    p = mr.run_cli("run", "--checkpoint", tmp / "good.safetensors", "--input", tmp / "bad.safetensors",
                   "--output", tmp / "y.safetensors", check=False)
    assert p.returncode == 1 and "token 5 slot 1" in p.stderr, p.stderr
    assert "was written" not in p.stderr and "not written" in p.stderr, p.stderr
    assert not (tmp / "y.safetensors").exists()


@pytest.mark.parametrize("value", [np.nan, np.inf, -np.inf])
def test_non_finite_topk_weights_refused(setup, value):
    tmp, tensors, (x, ids, w, pad), _ = setup
    mr.st_save(tmp / "good.safetensors", tensors)
    bad = w.copy()
    bad[8, 1] = value
    mr.write_inputs(tmp / "bad.safetensors", x, ids, bad, pad)
    p = mr.run_cli("run", "--checkpoint", tmp / "good.safetensors", "--input", tmp / "bad.safetensors",
                   "--output", tmp / "y.safetensors", check=False)
    no_sanitizer_report(p)
    assert p.returncode == 1 and "topk_weights" in p.stderr and "token 8 slot 1" in p.stderr, p.stderr
    assert "finite" in p.stderr and not (tmp / "y.safetensors").exists()


def test_overflowing_y_is_reported(setup):
    tmp, tensors, (x, ids, w, pad), _ = setup
    mr.st_save(tmp / "good.safetensors", tensors)
    big = w.copy()
    big[9, :] = 3e38  # finite, but the weighted sum overflows
    mr.write_inputs(tmp / "big.safetensors", x, ids, big, pad)
    p = mr.run_cli("run", "--checkpoint", tmp / "good.safetensors", "--input", tmp / "big.safetensors",
                   "--output", tmp / "y.safetensors", check=False)
    no_sanitizer_report(p)
    y = mr.st_load(tmp / "y.safetensors")["y"].astype(np.float32)
    assert not np.isfinite(y[9]).all()
    assert "warning" in p.stderr and "1 token" in p.stderr and "token 9" in p.stderr, p.stderr


def test_overflowing_global_scale_refused_at_load(setup):
    tmp, tensors, _, inp = setup
    for name in ("layer.experts.6.gate_proj.weight_scale_2", "layer.experts.3.down_proj.input_scale"):
        t = dict(tensors)
        t[name] = np.float32(3e38)
        run_expect_fail(tmp, t, inp, name, "expert", "6 x 448", extra=())


@pytest.mark.parametrize("value", [np.nan, np.inf])
@pytest.mark.parametrize("style", ["stacked", "per_expert"])
def test_non_finite_bf16_weight_refused_at_load(tmp_path, style, value):
    bf = mr.random_model("bf16", E, H, I, seed=23)
    x, ids, w, pad = mr.random_inputs(T, K, H, E, seed=24)
    mr.write_inputs(tmp_path / "in.safetensors", x, ids, w, pad)
    t = mr.checkpoint_tensors(bf, "layer", style)
    if style == "stacked":
        a = t["layer.w2_weight"].copy()
        a[5, 7, 9] = value
        t["layer.w2_weight"] = a
        needles = ("layer.w2_weight", "expert 5", "not finite")
    else:
        a = t["layer.experts.5.up_proj.weight"].copy()
        a[7, 9] = value
        t["layer.experts.5.up_proj.weight"] = a
        needles = ("experts.5.up_proj.weight", "expert 5", "not finite")
    run_expect_fail(tmp_path, t, tmp_path / "in.safetensors", *needles)


def test_bench_cpu_progress_and_rate():
    p = mr.run_cli("bench", "--experts", 8, "--top-k", 2, "--hidden", 256, "--inter", 256, "--tokens", "4,16",
                   "--iters", 3, "--format", "bf16", "--threads", 2)
    rates = [float(v) for v in re.findall(r"([0-9.eE+-]+) TFLOP/s", p.stdout)]
    assert len(rates) == 2 and all(r > 0 for r in rates), p.stdout
    assert "bench T=4" in p.stderr and "bench T=16" in p.stderr, p.stderr  # progress


def test_bench_json(tmp_path):
    out = tmp_path / "bench.jsonl"
    mr.run_cli("bench", "--experts", 8, "--top-k", 2, "--hidden", 256, "--inter", 256, "--tokens", "1,8",
               "--iters", 3, "--threads", 2, "--json", out)
    lines = out.read_text().splitlines()
    assert len(lines) == 2
    keys = ["shape", "format", "activations", "T", "median_ms", "min_ms", "max_ms", "tflops", "weight_gbps",
            "pct_copy", "commit", "gpu", "date", "source"]
    for line, T_ in zip(lines, (1, 8)):
        r = json.loads(line)
        assert sorted(r) == sorted(keys), r
        assert r["source"] == "megamoe"  # the records' schema (bench/records.py): who computed it
        assert r["T"] == T_ and r["format"] == "nvfp4" and r["gpu"] == "cpu" and r["activations"] in ("bf16", "nvfp4")
        assert r["shape"] == "E=8 K=2 H=256 I=256"
        assert 0 < r["min_ms"] <= r["median_ms"] <= r["max_ms"] and r["tflops"] > 0 and r["weight_gbps"] > 0
        assert r["pct_copy"] is None  # no copy bandwidth on the CPU
        assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ", r["date"]) and r["commit"]
    # Appends, so a history file grows by one record per point; a BF16 layer has no activations setting.
    mr.run_cli("bench", "--experts", 8, "--top-k", 2, "--hidden", 256, "--inter", 256, "--tokens", "4",
               "--iters", 1, "--threads", 2, "--format", "bf16", "--json", out)
    lines = out.read_text().splitlines()
    assert len(lines) == 3 and json.loads(lines[2])["activations"] is None and json.loads(lines[2])["format"] == "bf16"
    # The records feed the side-by-side table as they are (bench/side_by_side.py; it once failed on them).
    import subprocess
    import sys

    repo = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..")
    p = subprocess.run([sys.executable, os.path.join(repo, "bench", "side_by_side.py"), str(out)],
                       capture_output=True, text=True)
    assert p.returncode == 0, p.stderr
    rows = {line.split("|")[1].strip(): line for line in p.stdout.splitlines() if line.startswith("| megamoe")}
    act = json.loads(lines[0])["activations"]
    assert set(rows) == {f"megamoe NVFP4, activations {act}", "megamoe BF16"}, p.stdout
    assert "T=1 | T=4 | T=8" in p.stdout and "- megamoe " in p.stdout, p.stdout
