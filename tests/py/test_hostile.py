"""The Python surface against a hostile caller (issue 39), on the CPU: no call crashes the interpreter
or returns a silently wrong or mixed result; every misuse raises a clear exception naming the
argument, and the module keeps working. One parametrized case per misuse; calls that crashed the
interpreter before their fix run in a child process, so that a crash is a failed case.

  threads      what may run concurrently (docs/PYTHON.md "Threads") runs correctly; an NCCL group
               refuses a second thread's call
  wrong        ids of every integer dtype range-checked with their real value; weights never loaded,
               a wrong dtype, a norm misread: refused
  state        a finalized module's state_dict: its checkpoint's tensors, or a clear refusal
  crash        communicators, raw-pointer forwards, memory that cannot be had
  args         every public function's non-tensor arguments; pickling; meta tensors; the fake
               implementation; the NCCL version check
  cli          every bad option value names the option; extra arguments and unknown options refused
  newcomer     the README's install lines, install-deps.sh's modes, the build's progress, the
               transformers example's figure
"""
import copy
import ctypes
import os
import pathlib
import pickle
import re
import shutil
import subprocess
import sys
import textwrap
import types

import numpy as np
import pytest

import mmref as mr
import torchutil as tu

torch = pytest.importorskip("torch")

import megamoe  # noqa: E402
from megamoe import _capi  # noqa: E402
from megamoe.torch import MegaMoEExperts  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parents[2]
E, K, H, I, T = 8, 2, 256, 256, 16


def module(fmt="bf16", norm=None, prefix="hx", seed=5, t_max=T, **kw):
    """A finalized module of an mmref model (no norm unless given)."""
    model = mr.random_model(fmt, E, H, I, seed=seed, with_norm=False)
    m = MegaMoEExperts(num_experts=E, num_local_experts=E, experts_start_idx=0, top_k=K, hidden_size=H,
                       intermediate_size=I, post_expert_norm=norm, num_max_tokens_per_rank=t_max,
                       is_nvfp4=fmt == "nvfp4", prefix=prefix, device="cpu", **kw)
    list(m.load_weights(tu.module_weights(model)))
    m.finalize_weights()
    return m


def inputs(n=T, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(n, H, generator=g) / 4).bfloat16()
    w = torch.rand(n, K, generator=g).bfloat16().float()  # bf16 values: the same as bf16 or float32 weights
    ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(n)]).int()
    return x, w, ids


def same(a, b):
    return a.shape == b.shape and torch.equal(a.view(torch.int16), b.view(torch.int16))


def child(code, timeout=600):
    """Runs `code` in a fresh interpreter with this test's package and library; (returncode, output)."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "python"), str(ROOT / "tests" / "py"), env.get("PYTHONPATH", "")])
    p = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, env=env,
                       timeout=timeout)
    return p.returncode, p.stdout + p.stderr


@pytest.fixture(scope="module")
def ref():
    """A module, its inputs and its y: each misuse below must leave it computing this y."""
    m = module()
    x, w, ids = inputs()
    return m, (x, w, ids), m(x, w, ids)


def still_works(ref):
    m, args, y = ref
    assert same(m(*args), y), "the module's y changed after a refused call"


# ---- threads ------------------------------------------------------------------------------------

THREADS = r"""
import random, threading, torch, megamoe, sys
import test_hostile as th
mods = [th.module(seed=5), th.module(seed=6), th.module(seed=7, t_max=32)]
cases = [(i, th.inputs(n, seed=n)) for n in (1, 3, 16) for i in (0, 1)] + [(2, th.inputs(32, seed=32))]
want = [mods[i](*a) for i, a in cases]
mode = sys.argv[1] if len(sys.argv) > 1 else "{mode}"
only = [c for c, (i, _) in enumerate(cases) if i == 0] if mode == "one_module" else list(range(len(cases)))
wrong, errors = [0], []
def work(seed):
    r = random.Random(seed)
    for _ in range(60):
        c = r.choice(only)
        i, (x, w, ids) = cases[c]
        try:
            y = torch.ops.megamoe.experts(mods[i]._layer_id, x, w, ids) if mode == "op" and r.random() < .5 \
                else mods[i](x, w.bfloat16() if mode == "op" else w, ids.long() if mode == "op" else ids)
        except Exception as e:
            errors.append(repr(e)); continue
        if not torch.equal(y.view(torch.int16), want[c].view(torch.int16)):
            wrong[0] += 1
ts = [threading.Thread(target=work, args=(s,)) for s in range(4)]
[t.start() for t in ts]; [t.join() for t in ts]
print("wrong", wrong[0], "errors", errors[:3])
"""


@pytest.mark.parametrize("mode", ["one_module", "same_shape", "op"])
def test_threads_share_modules_and_buffer(mode):
    """4 threads x 60 forwards, mixed T: one module, modules of one shape (one buffer, SPEC §7) and one of
    another, the op with int64 ids and bf16 weights: every y is the one a lone call gives."""
    rc, out = child(THREADS.replace("{mode}", mode))
    assert rc == 0, f"the interpreter died (returncode {rc}):\n{out[-3000:]}"
    assert "wrong 0 errors []" in out, out[-3000:]


def test_thread_closing_a_module_while_others_run():
    """A module closed while other threads call it: each call gives the right y or raises ClosedError."""
    rc, out = child(r"""
        import threading, time, torch, megamoe
        from megamoe.torch import _op
        import test_hostile as th
        m = th.module(); x, w, ids = th.inputs(16); want = m(x, w, ids)
        bad = []
        def work():
            for _ in range(200):
                try:
                    y = m(x, w, ids)
                    if not torch.equal(y.view(torch.int16), want.view(torch.int16)): bad.append("wrong y")
                except megamoe.ClosedError:
                    pass
                except Exception as e:
                    bad.append(repr(e))
        ts = [threading.Thread(target=work) for _ in range(3)]
        [t.start() for t in ts]; time.sleep(0.05); _op.unregister(m._layer_id); [t.join() for t in ts]
        print("bad", bad[:3])
    """)
    assert rc == 0, f"the interpreter died (returncode {rc}):\n{out[-3000:]}"
    assert "bad []" in out, out[-3000:]


def test_nccl_group_refuses_a_second_threads_call(ref):
    """An NCCL group's forwards are collective: a call that finds another thread's call running on the
    group raises instead of taking a turn that other ranks would take in another order. (The policy,
    on a CPU group marked as one: no NCCL here.)"""
    import threading

    m, args, y = ref
    g = m._layer.group
    held, release = threading.Event(), threading.Event()

    def hold():
        with g._lock:
            held.set()
            release.wait(10)

    t = threading.Thread(target=hold)
    t.start()
    held.wait(10)
    g._exclusive = True
    try:
        with pytest.raises(megamoe.InvalidArgumentError, match="another thread is running a call on this NCCL group"):
            m(*args)
    finally:
        g._exclusive = False
        release.set()
        t.join()
    still_works(ref)


# ---- silent wrong answers -----------------------------------------------------------------------

BAD_IDS = [("int64", 2**32 + 1), ("int64", 2**31), ("int64", -2**31 - 1), ("int64", -2**40), ("int64", E),
           ("int64", -2), ("int32", E), ("int16", 300), ("int16", -5), ("int8", 100), ("uint8", 200)] + \
          [(d, 70000) for d in ("uint32",) if hasattr(torch, d)]


@pytest.mark.parametrize("dtype,value", BAD_IDS, ids=[f"{d}_{v}" for d, v in BAD_IDS])
@pytest.mark.parametrize("via", ["module", "op"])
def test_bad_ids_of_any_integer_dtype_named_with_their_value(ref, via, dtype, value):
    m, (x, w, ids), y = ref
    bad = ids.long().clone()
    bad[3, 1] = value
    bad = bad.to(getattr(torch, dtype))
    call = m if via == "module" else (lambda *a: torch.ops.megamoe.experts(m._layer_id, *a))
    with pytest.raises(megamoe.BadInputError, match=rf"expert id {value} is outside \[-1, {E}\)"):
        call(x, w, bad)
    still_works(ref)


GOOD_ID_DTYPES = ["int64", "int16", "int8", "uint8"] + [d for d in ("uint16", "uint32") if hasattr(torch, d)]


@pytest.mark.parametrize("dtype", GOOD_ID_DTYPES)
@pytest.mark.parametrize("wdtype", ["float32", "bfloat16", "float16"])
def test_ids_and_weights_of_other_dtypes_give_the_same_y(ref, dtype, wdtype):
    m, (x, w, ids), y = ref
    w2 = w.to(getattr(torch, wdtype))
    want = m(x, w2.float(), ids)
    for call in (m, lambda *a: torch.ops.megamoe.experts(m._layer_id, *a),
                 lambda *a: torch.ops.megamoe.experts.default(m._layer_id, *a)):
        assert same(call(x, w2, ids.long().to(getattr(torch, dtype))), want)


def test_uint64_ids_refused_and_padding_ids_not_read(ref):
    m, (x, w, ids), y = ref
    with pytest.raises(megamoe.InvalidArgumentError, match="topk_ids: dtype uint64, expected int32 or"):
        m(x, w, ids.long().to(torch.uint64))
    pad = torch.zeros(T, dtype=torch.bool)
    pad[3] = True
    bad = ids.long()
    bad[3, 0] = 2**40  # a padding token's ids are not read (SPEC §1)
    yp = m(x, w, bad, pad)
    assert same(yp[3], torch.zeros(H, dtype=torch.bfloat16)) and same(yp[:3], y[:3])


NVFP4_PARAMS = ["w13_weight", "w13_weight_scale", "w13_weight_scale_2", "w2_weight", "w2_weight_scale",
                "w2_weight_scale_2"]


@pytest.mark.parametrize("fmt,missing", [("bf16", "w13_weight"), ("bf16", "w2_weight")] +
                         [("nvfp4", n) for n in NVFP4_PARAMS])
def test_finalize_refuses_a_weight_never_loaded(fmt, missing):
    model = mr.random_model(fmt, E, H, I, seed=1, with_norm=False)
    m = MegaMoEExperts(num_experts=E, num_local_experts=E, experts_start_idx=0, top_k=K, hidden_size=H,
                       intermediate_size=I, num_max_tokens_per_rank=T, is_nvfp4=fmt == "nvfp4", prefix="fz",
                       device="cpu")
    list(m.load_weights([(n, t) for n, t in tu.module_weights(model) if n != missing]))
    with pytest.raises(megamoe.NotFinalizedError, match=rf"fz: cannot finalize: {missing} never loaded"):
        m.finalize_weights()
    assert not m.finalized and getattr(m, missing) is not None  # still loadable
    list(m.load_weights([(n, t) for n, t in tu.module_weights(model) if n == missing]))
    m.finalize_weights()
    assert m(*inputs()).shape == (T, H)


WRONG_DTYPES = [("bf16", "w13_weight", torch.int64), ("bf16", "w13_weight", torch.float32),
                ("bf16", "w2_weight", torch.float16), ("nvfp4", "w13_weight", torch.float32),
                ("nvfp4", "w2_weight", torch.int8), ("nvfp4", "w13_weight_scale", torch.uint8),
                ("nvfp4", "w2_weight_scale", torch.float32), ("nvfp4", "w13_weight_scale_2", torch.float64),
                ("nvfp4", "w2_input_scale", torch.bfloat16)]


@pytest.mark.parametrize("fmt,name,dtype", WRONG_DTYPES, ids=[f"{f}-{n}-{str(d)[6:]}" for f, n, d in WRONG_DTYPES])
@pytest.mark.parametrize("via", ["weight_loader", "load_weights", "load_state_dict"])
def test_wrong_weight_dtype_refused_naming_both(fmt, name, dtype, via):
    model = mr.random_model(fmt, E, H, I, seed=1, with_norm=False)
    m = MegaMoEExperts(num_experts=E, num_local_experts=E, experts_start_idx=0, top_k=K, hidden_size=H,
                       intermediate_size=I, num_max_tokens_per_rank=T, is_nvfp4=fmt == "nvfp4", prefix="wd",
                       device="cpu")
    good = dict(tu.module_weights(model))
    expected = str(good[name].dtype).replace("torch.", "")
    given = str(dtype).replace("torch.", "")
    wrong = good[name].view(torch.uint8).to(dtype) if good[name].dtype == torch.float8_e4m3fn else good[name].to(dtype)
    msg = rf"{name}.*dtype {given}, expected {expected}"
    if via == "weight_loader":
        with pytest.raises(megamoe.BadWeightError, match=msg):
            m.weight_loader(getattr(m, name), wrong, name)
    elif via == "load_weights":
        with pytest.raises(megamoe.BadWeightError, match=msg):
            list(m.load_weights([(name, wrong)]))
    else:
        with pytest.raises(RuntimeError, match=msg):
            m.load_state_dict({**good, name: wrong})
    list(m.load_weights(good.items()))
    m.finalize_weights()


def _rmsnorm(eps, affine=True):
    n = torch.nn.RMSNorm(H, eps=eps, elementwise_affine=affine)
    if affine:
        with torch.no_grad():
            n.weight.copy_(torch.rand(H, generator=torch.Generator().manual_seed(3)) + 0.5)
    return n


def _hf_norm(cls_path, eps, fill):
    import importlib

    mod, cls = cls_path.rsplit(".", 1)
    n = getattr(importlib.import_module(mod), cls)(H, eps=eps)
    with torch.no_grad():
        n.weight.copy_(torch.rand(H, generator=torch.Generator().manual_seed(3)) + fill)
    return n


def _seed(weight, eps, zc=False, center=1.0):
    return types.SimpleNamespace(weight=weight, variance_epsilon=eps, zero_centered_gamma=zc, gain_center=center)


NORMS = {  # norm -> the seed-style settings it must run as
    "torch_rmsnorm_eps": (lambda: _rmsnorm(0.5), lambda n: _seed(n.weight, 0.5)),
    "torch_rmsnorm_eps_none": (lambda: _rmsnorm(None), lambda n: _seed(n.weight, torch.finfo(torch.float32).eps)),
    "torch_rmsnorm_no_affine": (lambda: _rmsnorm(1e-3, affine=False), lambda n: _seed(torch.ones(H), 1e-3)),
    "transformers_rmsnorm": (lambda: _hf_norm("transformers.models.mixtral.modeling_mixtral.MixtralRMSNorm", 0.25, .5),
                             lambda n: _seed(n.weight, 0.25)),
    "transformers_zero_centered": (lambda: _hf_norm("transformers.models.gemma.modeling_gemma.GemmaRMSNorm", 1e-2, -.5),
                                   lambda n: _seed(n.weight, 1e-2, True, 1.0)),
}


@pytest.mark.parametrize("kind", sorted(NORMS))
def test_norm_settings_read_from_what_the_module_is(kind):
    if kind.startswith("transformers"):
        pytest.importorskip("transformers")
    make, as_seed = NORMS[kind]
    n = make()
    args = inputs()
    y = module(norm=n)(*args)
    assert same(y, module(norm=as_seed(n))(*args)), f"{kind} did not run with its own eps / gain"


class _NotRMS(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(H))
        self.variance_epsilon = 1e-6

    def forward(self, x):
        return x * self.weight  # no normalization


REFUSED_NORMS = {
    "layernorm": (lambda: torch.nn.LayerNorm(H), "does not compute"),
    "not_rms": (lambda: _NotRMS(), "does not compute"),
    "linear": (lambda: torch.nn.Linear(H, H), "has no epsilon"),
    "object_without_eps": (lambda: types.SimpleNamespace(weight=torch.ones(H)), "has no epsilon"),
    "wrong_width": (lambda: torch.nn.RMSNorm(128), r"weight \(128,\), expected \[256\]"),
    "seed_without_weight": (lambda: types.SimpleNamespace(weight=None, variance_epsilon=1e-6), "has no weight"),
}


@pytest.mark.parametrize("kind", sorted(REFUSED_NORMS))
def test_norm_that_cannot_be_read_is_refused(kind):
    make, msg = REFUSED_NORMS[kind]
    with pytest.raises(megamoe.Error, match=msg):
        module(norm=make())


# ---- no silent data loss ------------------------------------------------------------------------

def test_state_dict_before_finalize_round_trips_and_after_raises():
    model = mr.random_model("nvfp4", E, H, I, seed=2, with_norm=False)
    m = MegaMoEExperts(num_experts=E, num_local_experts=E, experts_start_idx=0, top_k=K, hidden_size=H,
                       intermediate_size=I, num_max_tokens_per_rank=T, is_nvfp4=True, prefix="sd", device="cpu")
    list(m.load_weights(tu.module_weights(model)))
    sd = {k: v.clone() for k, v in m.state_dict().items()}
    assert sorted(sd) == sorted(n for n, _ in tu.module_weights(model))
    m.finalize_weights()
    with pytest.raises(megamoe.UnsupportedError, match="sd: state_dict.. of a finalized module.*from_checkpoint"):
        m.state_dict()
    m2 = MegaMoEExperts(num_experts=E, num_local_experts=E, experts_start_idx=0, top_k=K, hidden_size=H,
                        intermediate_size=I, num_max_tokens_per_rank=T, is_nvfp4=True, prefix="sd2", device="cpu")
    m2.load_state_dict(sd)
    m2.finalize_weights()
    args = inputs()
    assert same(m(*args), m2(*args))


@pytest.mark.parametrize("style", ["stacked", "per_expert"])
def test_from_checkpoint_state_dict_rereads_the_checkpoint(tmp_path, style):
    model = mr.random_model("nvfp4", E, H, I, seed=4)
    ck = tmp_path / "m.safetensors"
    mr.st_save(ck, mr.checkpoint_tensors(model, "blk", style))
    m = MegaMoEExperts.from_checkpoint(ck, "blk", top_k=K, num_max_tokens_per_rank=T)
    sd = m.state_dict()
    assert sorted(sd) == sorted(["post_expert_norm.weight"] + [n for n, _ in tu.module_weights(model)]), sorted(sd)
    args = inputs()
    out = tmp_path / "again.safetensors"  # a file of it under a prefix loads with from_checkpoint
    megamoe.save_safetensors(out, {f"layer.{k}": v.contiguous() for k, v in sd.items()})
    m2 = MegaMoEExperts.from_checkpoint(out, "layer", top_k=K, num_max_tokens_per_rank=T)
    assert same(m(*args), m2(*args))
    m3 = MegaMoEExperts(num_experts=E, num_local_experts=E, experts_start_idx=0, top_k=K, hidden_size=H,
                        intermediate_size=I, num_max_tokens_per_rank=T, prefix="m3", device="cpu",
                        post_expert_norm=_seed(None, 1e-6))  # and load_state_dict into a new module
    m3.load_state_dict(sd)
    m3.finalize_weights()
    assert same(m(*args), m3(*args))
    os.remove(ck)
    with pytest.raises(megamoe.UnsupportedError, match="re-reads the checkpoint"):
        m.state_dict()


def test_load_weights_into_a_from_checkpoint_module_says_why(tmp_path):
    model = mr.random_model("bf16", E, H, I, seed=4, with_norm=False)
    ck = tmp_path / "m.safetensors"
    mr.st_save(ck, mr.checkpoint_tensors(model, "blk", "stacked"))
    m = MegaMoEExperts.from_checkpoint(ck, "blk", top_k=K, num_max_tokens_per_rank=T)
    with pytest.raises(megamoe.InvalidArgumentError, match="built by from_checkpoint.*no parameters"):
        list(m.load_weights([("w13_weight", torch.zeros(1))]))


# ---- no crash -----------------------------------------------------------------------------------

NCCL_COMMS = {"int": "12345", "zero": "0", "none": "None", "str": "'0x10'", "c_void_p": "ctypes.c_void_p(77)"}


@pytest.mark.parametrize("kind", sorted(NCCL_COMMS))
def test_nccl_comm_is_never_a_bare_address(kind):
    rc, out = child(f"""
        import ctypes, megamoe
        try:
            megamoe.Group("nccl", nccl_comm={NCCL_COMMS[kind]})
        except megamoe.ArgumentTypeError as e:
            print("refused:", e)
    """)
    assert rc == 0, f"the interpreter died (returncode {rc}):\n{out[-2000:]}"
    assert "refused: nccl_comm: the 'nccl' backend needs a megamoe.NcclComm" in out, out


def test_nccl_comm_wrappers():
    with pytest.raises(megamoe.ArgumentTypeError, match="nccl_comm_from_process_group"):
        megamoe.NcclComm(5)
    with pytest.raises(megamoe.InvalidArgumentError, match="address=0 is outside"):
        megamoe.NcclComm.unsafe_from_address(0)
    assert megamoe.NcclComm.unsafe_from_address(ctypes.c_void_p(0x10)).address == 0x10
    with pytest.raises(megamoe.InvalidArgumentError, match="only the 'nccl' backend takes a communicator"):
        megamoe.Group("cpu", nccl_comm=megamoe.NcclComm.unsafe_from_address(16))


FORWARD_PTRS = {"empty": "[]", "two_for_one_rank": "[(0, 0, 0, 0, 0, 0)] * 2", "short_tuple": "[(1, 2)]",
                "not_a_list": "'abc'", "none": "None", "negative_T": "[(-1, 0, 0, 0, 0, 0)]",
                "float_address": "[(0, 1.5, 0, 0, 0, 0)]"}


@pytest.mark.parametrize("kind", sorted(FORWARD_PTRS))
def test_forward_ptrs_checks_what_it_can(kind):
    rc, out = child(f"""
        import megamoe
        g = megamoe.Group("cpu")
        layer = megamoe.Layer(g, num_experts=8, top_k=2, hidden_size=256, intermediate_size=256, max_tokens=4,
                              format="bf16", name="fp")
        try:
            layer.forward_ptrs({FORWARD_PTRS[kind]})
        except (megamoe.InvalidArgumentError, TypeError) as e:
            print("refused:", type(e).__name__, e)
    """)
    assert rc == 0, f"the interpreter died (returncode {rc}):\n{out[-2000:]}"
    assert "refused:" in out and "fp" in out, out


def test_layer_forward_on_host_arrays_checks_every_array():
    model = mr.random_model("bf16", E, H, I, seed=8, with_norm=False)
    g = megamoe.Group("cpu")
    layer = megamoe.Layer(g, num_experts=E, top_k=K, hidden_size=H, intermediate_size=I, max_tokens=T, format="bf16",
                          name="hf")
    layer.load_weight("w13_weight", model["w13"])
    layer.load_weight("w2_weight", model["w2"])
    layer.finalize()
    x, w, ids = inputs()
    y = np.zeros((T, H), dtype=mr.BF16)
    xn, wn, idn = tu.numpy_of(x), w.numpy(), ids.numpy()
    layer.forward([(xn, idn, wn, None, y)])
    bad = [([(xn, idn.astype(np.int64), wn, None, y)], "topk_ids: I64"), ([(xn, idn, wn, None, y[:4])], r"y: BF16 \[4"),
           ([(xn, idn, wn, None, np.zeros((T, H), dtype=np.float32))], "y: F32"),
           ([(xn, idn, wn)], "expected a tuple of 5"), ([], "0 entries"), ([(xn, idn, wn, None, "y")], "numpy array")]
    for args, msg in bad:
        with pytest.raises(megamoe.InvalidArgumentError, match=msg):
            layer.forward(args)
    y2 = np.zeros((T, H), dtype=mr.BF16)
    layer.forward([(xn, idn, wn, None, y2)])
    assert y.tobytes() == y2.tobytes()


def test_host_memory_that_cannot_be_had_raises_before_allocation(monkeypatch):
    with pytest.raises(megamoe.OutOfMemoryError, match="GiB of host memory"):  # ~6.6 TB of parameters
        MegaMoEExperts(num_experts=1024, num_local_experts=1024, experts_start_idx=0, top_k=2, hidden_size=32768,
                       intermediate_size=32768, num_max_tokens_per_rank=4, is_nvfp4=False, device="cpu")
    monkeypatch.setattr(megamoe, "_host_memory_available", lambda: 1 << 20)
    with pytest.raises(megamoe.OutOfMemoryError, match="needs 0.0[0-9] GiB of host memory, 0.00 GiB is available"):
        MegaMoEExperts(num_experts=E, num_local_experts=E, experts_start_idx=0, top_k=K, hidden_size=H,
                       intermediate_size=I, num_max_tokens_per_rank=T, is_nvfp4=False, device="cpu")
    with pytest.raises(megamoe.OutOfMemoryError, match="layer 'big'"):
        megamoe.Layer(megamoe.Group("cpu"), num_experts=E, top_k=K, hidden_size=H, intermediate_size=I, max_tokens=T,
                      format="bf16", name="big")
    assert isinstance(megamoe.OutOfMemoryError("x"), MemoryError)


# ---- clear exceptions for non-tensor arguments --------------------------------------------------

def _layer(**kw):
    args = dict(num_experts=E, top_k=K, hidden_size=H, intermediate_size=I, max_tokens=4, format="bf16")
    args.update(kw)
    return megamoe.Layer(megamoe.Group("cpu"), **args)


def _experts(**kw):
    args = dict(num_experts=E, num_local_experts=E, experts_start_idx=0, top_k=K, hidden_size=H, intermediate_size=I,
                num_max_tokens_per_rank=4, is_nvfp4=False, device="cpu")
    args.update(kw)
    return MegaMoEExperts(**args)


_W13 = np.zeros((E, 2 * I, H), dtype=mr.BF16)
TE, VE = megamoe.ArgumentTypeError, megamoe.InvalidArgumentError
ARGS = [  # (id, call(ref module), exception, message)
    ("group_backend_none", lambda m: megamoe.Group(None), TE, "backend: expected one of"),
    ("group_backend_int", lambda m: megamoe.Group(3), TE, "backend"),
    ("group_backend_unknown", lambda m: megamoe.Group("tpu"), VE, "backend='tpu'"),
    ("group_ranks_str", lambda m: megamoe.Group("cpu", num_ranks="2"), TE, "num_ranks: expected an integer, got str"),
    ("group_ranks_float", lambda m: megamoe.Group("cpu", num_ranks=2.5), TE, "num_ranks: expected an integer"),
    ("group_ranks_2_31", lambda m: megamoe.Group("cpu", num_ranks=2**31), VE, "num_ranks=2147483648 is outside"),
    ("group_device_none", lambda m: megamoe.Group("cpu", device=None), TE, "device: expected an integer"),
    ("group_threads_list", lambda m: megamoe.Group("cpu", num_threads=[1]), TE, "num_threads"),
    ("group_rank_out_of_range", lambda m: megamoe.Group("cpu").rank(5), VE, r"local_rank=5 is outside \[0, 1\)"),
    ("layer_group_none", lambda m: megamoe.Layer(None, num_experts=E, top_k=K, hidden_size=H, intermediate_size=I,
                                                 max_tokens=4), TE, "group: expected a megamoe.Group"),
    ("layer_experts_float", lambda m: _layer(num_experts=16.7), TE, "num_experts: expected an integer, got float 16.7"),
    ("layer_hidden_2_31", lambda m: _layer(hidden_size=2**31), VE, "hidden_size=2147483648 is outside"),
    ("layer_top_k_none", lambda m: _layer(top_k=None), TE, "top_k"),
    ("layer_max_tokens_bool", lambda m: _layer(max_tokens=True), TE, "max_tokens"),
    ("layer_name_none", lambda m: _layer(name=None), TE, "name: expected a str"),
    ("layer_name_nul", lambda m: _layer(name="a\0b"), VE, "name='a.x00b' holds a NUL"),
    ("layer_format_none", lambda m: _layer(format=None), TE, "format"),
    ("layer_activations_int", lambda m: _layer(activations=5), TE, "activations"),
    ("layer_eps_str", lambda m: _layer(norm_eps="x"), TE, "norm_eps: expected a number"),
    ("layer_zero_centered_str", lambda m: _layer(norm_zero_centered="yes"), TE, "norm_zero_centered"),
    ("layer_timeout_float", lambda m: _layer(timeout_ms=1.5), TE, "timeout_ms"),
    ("load_weight_name_none", lambda m: _layer().load_weight(None, _W13), TE, "name: expected a str"),
    ("load_weight_tensor_none", lambda m: _layer().load_weight("w13_weight", None), TE, "numpy array or a CPU torch"),
    ("load_weight_list", lambda m: _layer().load_weight("w13_weight", [1, 2]), TE, "got list"),
    ("load_weight_dtype_name", lambda m: _layer().load_weight("w13_weight", _W13, dtype="XX"), VE, "dtype='XX'"),
    ("expert_str", lambda m: _layer().load_expert_weight("0", "gate", "weight", _W13[0, :I]), TE, "expert"),
    ("expert_2_40", lambda m: _layer().load_expert_weight(2**40, "gate", "weight", _W13[0, :I]), VE,
     "expert=1099511627776 is outside"),
    ("proj_none", lambda m: _layer().load_expert_weight(0, None, "weight", _W13[0, :I]), TE, "proj"),
    ("load_checkpoint_none", lambda m: _layer().load_checkpoint(None), TE, "checkpoint: expected a path"),
    ("load_checkpoint_prefix_int", lambda m: _layer().load_checkpoint("x.safetensors", prefix=5), TE, "prefix"),
    ("forward_ptrs_stream_str", lambda m: _layer().forward_ptrs([(0, 0, 0, 0, 0, 0)], stream="s"), TE, "stream"),
    ("checkpoint_none", lambda m: megamoe.Checkpoint(None), TE, "path: expected a path"),
    ("checkpoint_int", lambda m: megamoe.Checkpoint(5), TE, "path"),
    ("checkpoint_nul", lambda m: megamoe.Checkpoint("a\0b.safetensors"), VE, "holds a NUL"),
    ("checkpoint_empty", lambda m: megamoe.Checkpoint(""), VE, "path: the path is empty"),
    ("checkpoint_bytes_missing", lambda m: megamoe.Checkpoint(b"no_such.safetensors"), megamoe.IOError_, "no_such"),
    ("checkpoint_pathlike_missing", lambda m: megamoe.Checkpoint(pathlib.Path("nope.safetensors")), megamoe.IOError_,
     "nope"),
    ("save_path_none", lambda m: megamoe.save_safetensors(None, {}), TE, "path"),
    ("save_path_nul", lambda m: megamoe.save_safetensors("a\0", {}), VE, "NUL"),
    ("save_tensors_list", lambda m: megamoe.save_safetensors("x.safetensors", [_W13]), TE, "tensors: expected a mapping"),
    ("save_name_int", lambda m: megamoe.save_safetensors("x.safetensors", {1: _W13}), TE, "tensor name"),
    ("quantize_tokens_float", lambda m: megamoe.quantize_checkpoint("a", "b", calib_tokens=1.5), TE, "calib_tokens"),
    ("quantize_tokens_zero", lambda m: megamoe.quantize_checkpoint("a", "b", calib_tokens=0), VE, "calib_tokens=0"),
    ("quantize_seed_negative", lambda m: megamoe.quantize_checkpoint("a", "b", calib_seed=-1), VE, "calib_seed=-1"),
    ("quantize_clamp_str", lambda m: megamoe.quantize_checkpoint("a", "b", activation_clamp="x"), TE,
     "activation_clamp"),
    ("quantize_in_none", lambda m: megamoe.quantize_checkpoint(None, "b"), TE, "in_path"),
    ("status_string_str", lambda m: megamoe.status_string("x"), TE, "status"),
    ("backend_available_none", lambda m: megamoe.backend_available(None), TE, "backend"),
    ("experts_num_str", lambda m: _experts(num_experts="8"), TE, "num_experts: expected an integer"),
    ("experts_top_k_float", lambda m: _experts(top_k=2.5), TE, "top_k"),
    ("experts_hidden_none", lambda m: _experts(hidden_size=None), TE, "hidden_size"),
    ("experts_prefix_int", lambda m: _experts(prefix=5), TE, "prefix: expected a str"),
    ("experts_is_nvfp4_str", lambda m: _experts(is_nvfp4="yes"), TE, "is_nvfp4"),
    ("experts_device_tpu", lambda m: _experts(device="tpu"), VE, "device='tpu'"),
    ("experts_device_float", lambda m: _experts(device=3.5), TE, "device: expected"),
    ("experts_activations_int", lambda m: _experts(activations=5), TE, "activations"),
    ("experts_norm_int", lambda m: _experts(post_expert_norm=5), TE, "post_expert_norm"),
    ("from_checkpoint_path_none", lambda m: MegaMoEExperts.from_checkpoint(None, top_k=2, num_max_tokens_per_rank=4),
     TE, "path"),
    ("weight_loader_foreign_param", lambda m: _experts().weight_loader(torch.nn.Parameter(torch.zeros(1)),
                                                                      torch.zeros(1), "w13_weight"),
     VE, "param is not one of this module's parameters"),
    ("weight_loader_list", lambda m: (lambda e: e.weight_loader(e.w13_weight, [1], "w13_weight"))(_experts()), TE,
     "w13_weight': expected a tensor, got list"),
    ("load_weights_not_pairs", lambda m: list(_experts().load_weights(["w13_weight"])), TE, r"\(name, tensor\) pairs"),
    ("op_layer_id_str", lambda m: torch.ops.megamoe.experts("a", *inputs(2)), TE, "layer_id: expected the int key"),
    ("op_layer_id_float", lambda m: torch.ops.megamoe.experts(float(m._layer_id), *inputs(2)), TE, "layer_id"),
    ("op_layer_id_none", lambda m: torch.ops.megamoe.experts(None, *inputs(2)), TE, "layer_id"),
    ("op_layer_id_bool", lambda m: torch.ops.megamoe.experts(True, *inputs(2)), TE, "layer_id"),
    ("op_layer_id_huge", lambda m: torch.ops.megamoe.experts(2**70, *inputs(2)), megamoe.ClosedError, "no layer"),
    ("op_hidden_none", lambda m: torch.ops.megamoe.experts(m._layer_id, None, *inputs(2)[1:]), TE, "hidden_states"),
    ("op_ids_list", lambda m: torch.ops.megamoe.experts(m._layer_id, *inputs(2)[:2], [[0, 1], [2, 3]]), TE,
     "topk_ids: expected a tensor, got list"),
    ("module_weights_numpy", lambda m: m(inputs(2)[0], np.ones((2, K), np.float32), inputs(2)[2]), TE,
     "topk_weights: expected a tensor, got ndarray"),
    ("module_hidden_none", lambda m: m(None, *inputs(2)[1:]), TE, "hidden_states"),
    ("replace_experts_max_tokens_str", lambda m: __import__("megamoe.torch.hf").torch.hf.replace_experts(
        torch.nn.Module(), max_tokens="16"), TE, "max_tokens"),
    ("replace_experts_model_none", lambda m: __import__("megamoe.torch.hf").torch.hf.replace_experts(
        None, max_tokens=16), TE, "model: expected a torch.nn.Module"),
    ("moe_blocks_str", lambda m: __import__("megamoe.torch.hf").torch.hf.moe_blocks("model"), TE, "model"),
    ("nccl_comm_pg_int", lambda m: __import__("megamoe.torch").torch.nccl_comm_from_process_group(5), TE,
     "pg: expected a torch.distributed.ProcessGroup"),
    ("pickle_module", lambda m: pickle.dumps(m), TypeError, "cannot pickle .*MegaMoEExperts: it holds native state"),
    ("deepcopy_module", lambda m: copy.deepcopy(m), TypeError, "holds native state"),
    ("pickle_layer", lambda m: pickle.dumps(m._layer), TypeError, "cannot pickle megamoe.Layer"),
    ("pickle_group", lambda m: pickle.dumps(m._layer.group), TypeError, "cannot pickle megamoe.Group"),
]


@pytest.mark.parametrize("call,exc,msg", [a[1:] for a in ARGS], ids=[a[0] for a in ARGS])
def test_bad_arguments_raise_naming_them(ref, call, exc, msg):
    with pytest.raises(exc, match=msg):
        call(ref[0])
    still_works(ref)


def test_pickling_a_checkpoint_explains(tmp_path):
    model = mr.random_model("bf16", E, H, I, seed=4, with_norm=False)
    mr.st_save(tmp_path / "m.safetensors", mr.checkpoint_tensors(model, "blk", "stacked"))
    with megamoe.Checkpoint(tmp_path / "m.safetensors") as ck:
        with pytest.raises(TypeError, match="cannot pickle megamoe.Checkpoint: it holds native state"):
            pickle.dumps(ck)
    with megamoe.Checkpoint(os.fsencode(tmp_path / "m.safetensors")) as ck:  # bytes paths open
        assert [info["prefix"] for info in ck.layers()] == ["blk"]


@pytest.mark.parametrize("n", [0, 5])
def test_meta_tensors_give_a_meta_y(ref, n):
    m = ref[0]
    x = torch.empty(n, H, dtype=torch.bfloat16, device="meta")
    w, ids = torch.empty(n, K, device="meta"), torch.empty(n, K, dtype=torch.int64, device="meta")
    for call in (m, lambda *a: torch.ops.megamoe.experts(m._layer_id, *a),
                 lambda *a: torch.ops.megamoe.experts.default(m._layer_id, *a)):
        y = call(x, w, ids)
        assert y.is_meta and tuple(y.shape) == (n, H) and y.dtype == torch.bfloat16
    with pytest.raises(megamoe.BadInputError, match="17 tokens.* 16"):
        m(torch.empty(17, H, dtype=torch.bfloat16, device="meta"), torch.empty(17, K, device="meta"),
          torch.empty(17, K, dtype=torch.int32, device="meta"))


FAKE_BAD = {  # what the kernel refuses, from tensor metadata alone
    "too_many_tokens": (lambda x, w, i: (torch.zeros(T + 1, H, dtype=torch.bfloat16), torch.zeros(T + 1, K),
                                         torch.zeros(T + 1, K, dtype=torch.int32)), megamoe.BadInputError,
                        "17 tokens, more than the 16"),
    "hidden_width": (lambda x, w, i: (x[:, :128], w, i), VE, r"hidden_states: shape \(16, 128\), expected \(16, 256\)"),
    "ids_float": (lambda x, w, i: (x, w, i.float()), VE, "topk_ids: dtype float32"),
    "weights_double": (lambda x, w, i: (x, w.double(), i), VE, "topk_weights: dtype float64"),
    "top_k": (lambda x, w, i: (x, w[:, :1], i[:, :1]), VE, r"topk_weights: shape \(16, 1\), expected \(16, 2\)"),
    "hidden_float": (lambda x, w, i: (x.float(), w, i), VE, "hidden_states: dtype float32"),
}


@pytest.mark.parametrize("kind", sorted(FAKE_BAD))
def test_fake_implementation_refuses_what_the_kernel_refuses(ref, kind):
    from torch._subclasses.fake_tensor import FakeTensorMode

    m, (x, w, ids), _ = ref
    make, exc, msg = FAKE_BAD[kind]
    bad = make(x, w, ids)
    with pytest.raises(exc, match=msg):  # the kernel
        torch.ops.megamoe.experts.default(m._layer_id, *bad)
    with FakeTensorMode() as mode:
        fake = [mode.from_tensor(t) for t in bad]
        with pytest.raises(exc, match=msg):
            torch.ops.megamoe.experts.default(m._layer_id, *fake)
    with pytest.raises(megamoe.ClosedError, match="no layer with id 999999"):
        with FakeTensorMode() as mode:
            torch.ops.megamoe.experts.default(999999, *[mode.from_tensor(t) for t in (x, w, ids)])


def test_compile_reports_too_many_tokens_as_bad_input(ref):
    m = ref[0]
    f = torch.compile(m, fullgraph=True)
    x, w, ids = inputs(T + 4)
    with pytest.raises(Exception) as e:
        f(x, w, ids)
    text = f"{type(e.value).__name__}: {e.value}"
    assert "BadInputError" in text and "20 tokens, more than the 16" in text and "Unsupported" not in text, text
    still_works(ref)


NCCL_STUB = r"""
int ncclGetVersion(int *version) { *version = 23007; return 0; }
"""


def test_nccl_version_mismatch_named_at_load(tmp_path):
    assert _capi.nccl_mismatch("2.28.9", "2.28.3") is None
    msg = _capi.nccl_mismatch("2.28.9", "2.30.7")
    assert "built against NCCL 2.28.9" in msg and "loaded NCCL 2.30.7" in msg
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.skip("no C compiler to build a stand-in libnccl: the load-time check not run")
    (tmp_path / "stub.c").write_text(NCCL_STUB)
    stub = tmp_path / "libnccl_stub.so"
    subprocess.run([cc, "-shared", "-fPIC", "-o", str(stub), str(tmp_path / "stub.c")], check=True)
    lib = tmp_path / "lib"
    lib.mkdir()
    shutil.copy(_capi.library_path(), lib / "libmegamoe.so")
    (lib / "megamoe_build.json").write_text('{"nccl": "2.28.9"}\n')
    env = dict(os.environ, MEGAMOE_LIBRARY=str(lib / "libmegamoe.so"), MEGAMOE_NCCL_LIBRARY=str(stub),
               PYTHONPATH=str(ROOT / "python"))
    p = subprocess.run([sys.executable, "-W", "always", "-c", textwrap.dedent("""
        import megamoe
        try:
            megamoe.Group("nccl", nccl_comm=megamoe.NcclComm.unsafe_from_address(1))
        except megamoe.NcclError as e:
            print("refused:", e)
    """)], capture_output=True, text=True, env=env, timeout=120)
    assert p.returncode == 0, p.stderr
    assert "RuntimeWarning" in p.stderr and "built against NCCL 2.28.9" in p.stderr and "2.30.7" in p.stderr, p.stderr
    assert "refused: megamoe: libmegamoe.so's NCCL backend was built against NCCL 2.28.9, but this process loaded " \
           "NCCL 2.30.7" in p.stdout, p.stdout


# ---- the CLI ------------------------------------------------------------------------------------

def cli(*args):
    p = subprocess.run([os.environ["MEGAMOE_CLI"], *map(str, args)], capture_output=True, text=True, timeout=120)
    return p.returncode, p.stdout + p.stderr


CLI_BAD_VALUES = [  # (command line, option or argument the message must name)
    (["run", "--threads", "abc"], "--threads"), (["run", "--max-tokens", "99999999999"], "--max-tokens"),
    (["run", "--ranks", "1.5"], "--ranks"), (["run", "--gpus", "0"], "--gpus"), (["run", "--norm-eps", "x"], "--norm-eps"),
    (["run", "--clamp", "nan?"], "--clamp"), (["run", "--activations", "fp8"], "--activations"),
    (["run", "--backend", "tpu"], "--backend"), (["run", "--norm-gain-center", ""], "--norm-gain-center"),
    (["demo", "--tokens", "-5"], "--tokens"), (["demo", "--tokens", "abc"], "--tokens"),
    (["quantize", "--calib-tokens", "0", "a", "b"], "--calib-tokens"),
    (["quantize", "--seed", "-1", "a", "b"], "--seed"), (["quantize", "--clamp", "x", "a", "b"], "--clamp"),
    (["bench", "--tokens", "x"], "--tokens"), (["bench", "--experts", "-1"], "--experts"),
    (["bench", "--top-k", "9999999999"], "--top-k"), (["bench", "--format", "int8"], "--format"),
    (["bench", "--gemm", "fast"], "--gemm"), (["bench", "--iters", "0"], "--iters"),
]


@pytest.mark.parametrize("args,name", CLI_BAD_VALUES, ids=[" ".join(a) for a, _ in CLI_BAD_VALUES])
def test_cli_bad_option_value_names_the_option(args, name):
    rc, out = cli(*args)
    assert rc != 0 and f"{name} {args[args.index(name) + 1]}" in out, out


CLI_EXTRA = [(["inspect", "PATH", "extra"], "extra"), (["quantize", "a", "b", "c"], "'c'"),
             (["run", "--checkpoint", "a", "--input", "b", "--output", "c", "stray"], "stray"),
             (["demo", "stray"], "stray"), (["bench", "stray"], "stray"), (["version", "stray"], "stray")]


@pytest.mark.parametrize("args,name", CLI_EXTRA, ids=[" ".join(a) for a, _ in CLI_EXTRA])
def test_cli_extra_arguments_named(args, name):
    rc, out = cli(*args)
    assert rc == 2 and "unexpected argument" in out and name in out, out


@pytest.mark.parametrize("command", ["run", "demo", "bench", "inspect", "quantize", "version"])
def test_cli_unknown_options_refused_everywhere(command):
    rc, out = cli(command, "--frob")
    assert rc == 2 and "--frob" in out, out
    rc, out = cli(command, "--help")
    assert rc == 0 and "usage: megamoe" in out, out


# ---- the newcomer's path ------------------------------------------------------------------------

def readme_section(title):
    text = (ROOT / "README.md").read_text()
    return text.split(f"## {title}", 1)[1].split("\n## ", 1)[0]


def test_readme_python_section_installs_what_its_example_needs():
    section = readme_section("Python")
    install = [line for line in section.splitlines() if "pip install" in line]
    assert install and re.search(r"pip install [^\n]*\.\[torch\]", install[0]), install
    assert "MEGAMOE_CUDA=OFF" in section and re.search(r"\d+ min", section), section[:2000]
    assert "import torch" in section


def test_readme_demo_command_installs_only_what_the_demo_needs():
    two = readme_section("Two commands")
    assert "scripts/install-deps.sh demo && make demo" in two and "scripts/install-deps.sh && make test" in two
    script = ROOT / "scripts" / "install-deps.sh"
    demo = subprocess.run([str(script), "--list", "demo"], capture_output=True, text=True, check=True).stdout
    full = subprocess.run([str(script), "--list"], capture_output=True, text=True, check=True).stdout
    for pkg in ("torch", "transformers", "numpy", "venv"):
        assert pkg not in demo, demo
    for pkg in ("cmake", "libjansson-dev", "gcc"):
        assert pkg in demo and pkg in full
    for pkg in ("requirements.txt", "requirements-torch.txt", "libcmocka-dev", "clang"):
        assert pkg in full, full
    p = subprocess.run([str(script), "frob"], capture_output=True, text=True)
    assert p.returncode == 2 and "frob" in p.stderr


def test_build_progress_lines(tmp_path):
    """The compiler launcher `pip install .` builds the CUDA files through prints one line per file,
    with the time since the build started (pip shows it with -v; on a terminal also without)."""
    launcher = ROOT / "python" / "build_progress.sh"
    p = subprocess.run([str(launcher), str(tmp_path / "start"), "true", "-c", "src/cuda/sm90_expert_ws.cu",
                        "-o", "x.o"], capture_output=True, text=True)
    assert p.returncode == 0 and re.match(r"megamoe build \+\d+:\d\d: compiling sm90_expert_ws\.cu", p.stderr), p.stderr
    p = subprocess.run([str(launcher), str(tmp_path / "start"), "false", "-c", "a.cu"], capture_output=True, text=True)
    assert p.returncode != 0
    cm = (ROOT / "python" / "CMakeLists.txt").read_text()
    assert "build_progress.sh" in cm and "CUDA_COMPILER_LAUNCHER" in cm


def test_transformers_example_reports_a_comparable_figure():
    pytest.importorskip("transformers")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT / "python"), os.environ.get("PYTHONPATH", "")]))
    p = subprocess.run([sys.executable, str(ROOT / "examples" / "transformers_swap.py"), "--device", "cpu"],
                       capture_output=True, text=True, env=env, timeout=900)
    assert p.returncode == 0, p.stderr[-3000:]
    m = re.search(r"routers replayed.*transformers bf16 ([0-9.e-]+), megamoe bf16 ([0-9.e-]+)", p.stdout)
    assert m, p.stdout
    theirs, ours = float(m.group(1)), float(m.group(2))
    assert ours <= 1.5 * theirs + 1e-3, p.stdout  # docs/PYTHON.md's table: the same order as transformers' own
