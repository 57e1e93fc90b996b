"""The ctypes binding of include/megamoe.h (python/megamoe, issue 22), without torch: version, one
exception class per status carrying the handle's message, groups, layers, checkpoints, a forward on
numpy arrays bitwise equal to `megamoe run`, and the package importing with torch absent."""
import ctypes
import os
import re
import subprocess
import sys

import numpy as np
import pytest

import mmref as mr
import torchutil  # noqa: F401  (puts python/ on the path when MEGAMOE_LIBRARY is set)

import megamoe
from megamoe import _capi

ROOT = os.path.join(os.path.dirname(__file__), "..", "..")


def test_version_is_the_c_librarys():
    assert megamoe.__version__ == _capi.lib.megamoe_version_string().decode()
    with open(os.path.join(ROOT, "CMakeLists.txt")) as f:
        assert re.search(r"project\(megamoe VERSION ([0-9.]+)", f.read()).group(1) == megamoe.__version__


def test_one_class_per_status():
    classes = {c.status: c for c in megamoe.Error.__subclasses__() if c.status is not None}
    for status in range(1, 13):
        cls = classes[status]
        assert issubclass(cls, megamoe.Error)
        assert cls.__name__.replace("_", "").lower().startswith(_capi.STATUS_NAMES[status].replace("_", "").lower()[:4])
    assert megamoe.status_string(3) == "bad weight"


def test_group_and_layer_errors_carry_messages():
    with pytest.raises(megamoe.InvalidArgumentError, match="num_ranks R=0 must be in 1..72"):
        megamoe.Group("cpu", num_ranks=0)
    with pytest.raises(megamoe.InvalidArgumentError, match="backend='tpu'"):
        megamoe.Group("tpu")
    g = megamoe.Group("cpu", num_ranks=2)
    assert g.world_size == 2 and g.local_ranks == 2 and g.rank(1) == 1
    with pytest.raises(megamoe.InvalidArgumentError, match="hidden_size|multiple of 256") as e:
        megamoe.Layer(g, num_experts=8, top_k=2, hidden_size=300, intermediate_size=256, max_tokens=4, format="bf16")
    assert e.value.status == 1
    with pytest.raises(megamoe.InvalidArgumentError, match="E % R|divisible|7"):
        megamoe.Layer(g, num_experts=7, top_k=2, hidden_size=256, intermediate_size=256, max_tokens=4, format="bf16")
    layer = megamoe.Layer(g, num_experts=8, top_k=2, hidden_size=256, intermediate_size=256, max_tokens=4,
                          format="bf16", name="lay")
    with pytest.raises(megamoe.BadWeightError, match="w13_weight") as e:
        layer.load_weight("w13_weight", np.zeros((8, 512, 128), dtype=mr.BF16))
    assert "lay" in str(e.value)
    with pytest.raises(megamoe.BadWeightError, match="w7_weight"):
        layer.load_weight("w7_weight", np.zeros((8, 2), dtype=np.float32))
    with pytest.raises(megamoe.NotFinalizedError):
        layer.finalize()  # weights missing
    with pytest.raises(megamoe.InvalidArgumentError, match="C-contiguous"):
        layer.load_weight("w2_weight", np.zeros((8, 256, 512), dtype=mr.BF16)[:, :, ::2])
    with pytest.raises(megamoe.InvalidArgumentError, match="dtype complex64"):
        layer.load_weight("w2_weight", np.zeros((8, 256, 256), dtype=np.complex64))
    with pytest.raises(megamoe.IOError_, match="no_such_file"):
        megamoe.Checkpoint("no_such_file.safetensors")


def test_forward_on_numpy_equals_cli(tmp_path):
    E, K, H, I, T = 8, 4, 256, 256, 24
    model = mr.random_model("nvfp4", E, H, I, seed=3)
    x, ids, w, pad = mr.random_inputs(T, K, H, E, seed=4)
    mr.calibrate_a2(model, x, ids, pad)
    ck = tmp_path / "m.safetensors"
    mr.st_save(ck, mr.checkpoint_tensors(model, "blk", "per_expert"))
    with megamoe.Checkpoint(ck) as c:
        (info,) = c.layers()
        assert info == c.describe("blk")
        assert (info["prefix"], info["format"], info["naming"], info["num_experts"], info["hidden_size"],
                info["intermediate_size"], info["has_norm"]) == ("blk", "nvfp4", "per_expert", E, H, I, True)
        for R in (1, 2):
            g = megamoe.Group("cpu", num_ranks=R)
            layer = megamoe.Layer(g, num_experts=E, top_k=K, hidden_size=H, intermediate_size=I, max_tokens=T,
                                  format="nvfp4", name="blk", **torchutil.spec3_activations("nvfp4"))
            layer.load_checkpoint(c, "blk")
            layer.finalize()
            mem = layer.memory()
            assert mem["checkpoint_bytes"] == 0 and mem["weight_bytes"] > 0
            xs, ys = np.array_split(np.ascontiguousarray(x), R), [None] * R
            parts = []
            for r, (a, b) in enumerate(zip(np.array_split(np.arange(T), R), xs)):
                sl = slice(a[0], a[-1] + 1)
                p = (np.ascontiguousarray(x[sl]), np.ascontiguousarray(ids[sl]), np.ascontiguousarray(w[sl]),
                     np.ascontiguousarray(pad[sl]).astype(np.uint8))
                ys[r] = np.zeros((len(a), H), dtype=mr.BF16)
                parts.append(p)
            layer.forward_ptrs([(len(p[0]), p[0].ctypes.data, p[1].ctypes.data, p[2].ctypes.data, p[3].ctypes.data,
                                 y.ctypes.data) for p, y in zip(parts, ys)])
            layer.check()
            y = np.concatenate(ys)
            inp, out = tmp_path / "in.safetensors", tmp_path / "out.safetensors"
            mr.write_inputs(inp, x, ids, w, pad)
            mr.run_cli("run", "--checkpoint", ck, "--input", inp, "--output", out, "--prefix", "blk",
                       *torchutil.cli_activations("nvfp4"))
            assert y.view(np.uint16).tobytes() == mr.st_load(out)["y"].view(np.uint16).tobytes()
            g.close()
            assert layer.closed


def test_bad_ids_raise_and_layer_keeps_working():
    E, K, H, I, T = 8, 2, 256, 256, 4
    model = mr.random_model("bf16", E, H, I, seed=8, with_norm=False)
    g = megamoe.Group("cpu")
    layer = megamoe.Layer(g, num_experts=E, top_k=K, hidden_size=H, intermediate_size=I, max_tokens=T, format="bf16")
    layer.load_weight("w13_weight", model["w13"])
    layer.load_weight("w2_weight", model["w2"])
    layer.finalize()
    x = np.ones((T, H), dtype=mr.BF16)
    w = np.ones((T, K), dtype=np.float32)
    y = np.zeros((T, H), dtype=mr.BF16)

    def run(ids):
        layer.forward_ptrs([(T, x.ctypes.data, ids.ctypes.data, w.ctypes.data, 0, y.ctypes.data)])
        return y.copy()

    good = np.zeros((T, K), dtype=np.int32)
    y0 = run(good)
    with pytest.raises(megamoe.BadInputError, match="99"):
        run(np.full((T, K), 99, dtype=np.int32))
    assert run(good).tobytes() == y0.tobytes()


def test_save_and_quantize(tmp_path):
    E, H, I = 4, 256, 256
    rng = np.random.default_rng(0)
    w13 = (rng.standard_normal((E, 2 * I, H)) / 16).astype(mr.BF16)
    w2 = (rng.standard_normal((E, H, I)) / 16).astype(mr.BF16)
    megamoe.save_safetensors(tmp_path / "b.safetensors", {"m.w13_weight": w13, "m.w2_weight": w2})
    assert set(mr.st_load(tmp_path / "b.safetensors")) == {"m.w13_weight", "m.w2_weight"}
    megamoe.quantize_checkpoint(tmp_path / "b.safetensors", tmp_path / "q.safetensors")
    with megamoe.Checkpoint(tmp_path / "q.safetensors") as c:
        info = c.describe("m")
    assert (info["format"], info["naming"], info["num_experts"]) == ("nvfp4", "per_expert", E)
    # the same bytes as the CLI's quantizer
    mr.run_cli("quantize", tmp_path / "b.safetensors", tmp_path / "q_cli.safetensors")
    a, b = mr.st_load(tmp_path / "q.safetensors"), mr.st_load(tmp_path / "q_cli.safetensors")
    assert sorted(a) == sorted(b) and all(a[k].tobytes() == b[k].tobytes() for k in a)
    with pytest.raises(megamoe.Error, match="nothing_here"):
        megamoe.quantize_checkpoint(tmp_path / "nothing_here", tmp_path / "x")


def test_import_without_torch():
    code = ("import sys; sys.modules['torch'] = None\n"
            "import megamoe; print(megamoe.__version__)\n"
            "try:\n    import megamoe.torch\nexcept ImportError as e:\n    print('needs torch:', e)\n")
    env = dict(os.environ)
    if env.get("MEGAMOE_LIBRARY"):
        env["PYTHONPATH"] = os.path.join(ROOT, "python") + os.pathsep + env.get("PYTHONPATH", "")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert p.returncode == 0, p.stderr
    assert p.stdout.splitlines()[0] == megamoe.__version__
    assert "needs torch: megamoe.torch needs PyTorch" in p.stdout


def test_structs_match_the_header():
    """The ctypes mirrors have the header's sizes (a field added to the header must be added here)."""
    hdr = open(os.path.join(ROOT, "include", "megamoe.h")).read()

    def fields(struct):
        body = re.search(r"typedef struct " + struct + r" \{(.*?)\} " + struct + ";", hdr, re.S).group(1)
        body = re.sub(r"/\*.*?\*/", "", body, flags=re.S)
        return [re.split(r"[\s\*]+", d.strip().split("[")[0])[-1] for d in body.split(";") if d.strip()]

    for struct, cls in (("megamoe_group_config", _capi.GroupConfig), ("megamoe_layer_config", _capi.LayerConfig),
                        ("megamoe_forward_args", _capi.ForwardArgs), ("megamoe_memory_info", _capi.MemoryInfo),
                        ("megamoe_layer_info", _capi.LayerInfo), ("megamoe_tensor", _capi.Tensor),
                        ("megamoe_quantize_options", _capi.QuantizeOptions)):
        assert fields(struct) == [f[0] for f in cls._fields_], struct
    assert ctypes.sizeof(_capi.Tensor) == 4 + 4 + 8 * 8 + 8
