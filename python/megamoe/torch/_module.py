"""MegaMoEExperts: the experts module inference engines expect (the interface of the PyTorch module
megamoe grew from), backed by a megamoe.Layer."""
import atexit
import math
import threading
import types
import weakref
from typing import Iterable, Optional, Tuple

import torch
from torch import nn

import megamoe
from . import _dist, _op

# One megamoe.Group per (backend, device, process group): the C library shares one communication
# buffer per group and layer shape, so layers of one shape share it here too (SPEC §7).
_groups = {}
_groups_lock = threading.Lock()


def _device(device, what="device"):
    if isinstance(device, torch.device):
        return device
    if not isinstance(device, (str, int)) or isinstance(device, bool):
        raise megamoe.ArgumentTypeError(f"{what}: expected a torch.device, str or int, got {type(device).__name__}", 1)
    try:
        return torch.device(device)
    except (RuntimeError, ValueError) as e:
        raise megamoe.InvalidArgumentError(f"{what}={device!r}: {e}", 1) from None


def group_for(device, process_group=None, num_threads=0):
    """The shared megamoe.Group of a torch device (and, for expert parallelism, a process group).
    num_threads: the CPU backend's threads (0: one per core); CPU groups of other counts are others."""
    device = _device(device)
    if process_group is not None:
        if device.type != "cuda":
            raise megamoe.InvalidArgumentError(f"expert parallelism over a process group needs CUDA, got {device}", 1)
        index = torch.cuda.current_device() if device.index is None else device.index
        key = ("nccl", index, process_group)
    elif device.type == "cuda":
        index = torch.cuda.current_device() if device.index is None else device.index
        key = ("cuda", index, None)
    elif device.type == "cpu":
        key = ("cpu", 0, num_threads)
    else:
        raise megamoe.InvalidArgumentError(f"device {device}: megamoe runs on cpu or cuda", 1)
    with _groups_lock:
        g = _groups.get(key)
        if g is None or g.closed:
            if key[0] == "nccl":
                with torch.cuda.device(key[1]):
                    comm = _dist.nccl_comm_from_process_group(process_group)
                g = megamoe.Group("nccl", num_ranks=1, device=key[1], nccl_comm=comm)
            elif key[0] == "cpu":
                g = megamoe.Group("cpu", num_ranks=1, num_threads=num_threads)
            else:
                g = megamoe.Group(key[0], num_ranks=1, device=key[1])
            _groups[key] = g
        return g


def close_groups():
    """Closes every shared group (and so every layer): at exit, before the NCCL communicators."""
    with _groups_lock:
        for g in _groups.values():
            g.close()
        _groups.clear()


atexit.register(close_groups)  # registered after _dist's, so it runs first

_experts, _kernel, _plain_eager = torch.ops.megamoe.experts.default, _op.experts_kernel, _op.plain_eager
_not_tensors = _op.not_tensors

# Checkpoint-layout parameters whose absence the C library judges (SPEC §6: weight-only exports carry
# no input scales; a layer with BF16 activations does not read them): handed over only when loaded.
_OPTIONAL_PARAMS = ("w13_input_scale", "w2_input_scale")

_ST_DTYPES = {"BOOL": torch.bool, "U8": torch.uint8, "I8": torch.int8, "I16": torch.int16, "F16": torch.float16,
              "BF16": torch.bfloat16, "I32": torch.int32, "F32": torch.float32, "F64": torch.float64,
              "I64": torch.int64, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2}


def _default_device():
    get = getattr(torch, "get_default_device", None)
    return get() if get else torch.device("cpu")


def _dtype_name(dt):
    return str(dt).replace("torch.", "")


class _Norm:
    """The post-expert norm's settings as the layer takes them (SPEC §5): eps, zero-centered gain and its
    center, and where the gain's weight comes from at finalize."""

    def __init__(self, eps, zero_centered, gain_center, weight_of, source):
        self.eps, self.zero_centered, self.gain_center = eps, zero_centered, gain_center
        self.weight_of = weight_of  # () -> [H] tensor, or None where the checkpoint brings it
        self.source = source        # the object it was read from, for messages


def _norm_settings(norm, H, prefix):
    """Reads the post-expert RMSNorm of `norm` as what it is, or refuses it (docs/PYTHON.md):
    - None: no norm;
    - an nn.Module: epsilon from `variance_epsilon` (transformers' RMSNorm classes) or `eps`
      (torch.nn.RMSNorm; None = torch.finfo(torch.float32).eps, torch's default for the float32 expert
      outputs the norm sees here), the gain from `weight` [H] (None = no affine gain: 1); then the
      module is called on float32 probes, and its output must be x * (mean(x^2) + eps)^-1/2 * gamma with
      gamma = weight (or weight + gain_center where it says zero_centered_gamma, or weight + 1 where it
      computes that: Gemma-style norms), else it is refused;
    - another object (the seed module's settings): `variance_epsilon`, optional `zero_centered_gamma`,
      `gain_center` and `weight` (None: the checkpoint's, from_checkpoint).
    Anything else raises ArgumentTypeError naming what is missing."""
    if norm is None:
        return None
    where = f"{prefix}: post_expert_norm ({type(norm).__name__})"
    declared_zc = getattr(norm, "zero_centered_gamma", None)
    center = getattr(norm, "gain_center", 1.0)
    if hasattr(norm, "variance_epsilon"):
        eps = norm.variance_epsilon
    elif isinstance(norm, nn.Module) and hasattr(norm, "eps"):
        eps = norm.eps if norm.eps is not None else torch.finfo(torch.float32).eps
    else:
        raise megamoe.ArgumentTypeError(
            f"{where}: has no epsilon (variance_epsilon, or eps of a torch.nn.RMSNorm): megamoe cannot tell what it "
            "computes", 1)
    eps = megamoe._float(eps, f"{where}: epsilon")
    center = megamoe._float(center, f"{where}: gain_center")
    weight = getattr(norm, "weight", None)
    if weight is not None and (not isinstance(weight, torch.Tensor) or tuple(weight.shape) != (H,)):
        got = tuple(weight.shape) if isinstance(weight, torch.Tensor) else type(weight).__name__
        raise megamoe.InvalidArgumentError(f"{where}: weight {got}, expected [{H}] (hidden_size)", 1)
    if not isinstance(norm, nn.Module):
        zc = megamoe._bool(declared_zc if declared_zc is not None else False, f"{where}: zero_centered_gamma")
        return _Norm(eps, zc, center, (lambda: norm.weight) if weight is not None or hasattr(norm, "weight") else None,
                     norm)
    # A module: what it computes decides.
    if declared_zc is not None:
        candidates = [(megamoe._bool(declared_zc, f"{where}: zero_centered_gamma"), center)]
    else:
        candidates = [(False, 1.0), (True, 1.0)]
    found = _probe_norm(norm, H, eps, candidates, weight is not None, where)
    if found is None:
        raise megamoe.ArgumentTypeError(
            f"{where}: does not compute x * (mean(x^2) + eps)^-1/2 * gamma with eps={eps:g} and gamma = weight"
            f"{'' if weight is None else ' or weight + 1'}: megamoe cannot run it as the post-expert RMSNorm", 1)
    zc, center = found
    ones = torch.ones(H)
    return _Norm(eps, zc, center, (lambda: norm.weight if norm.weight is not None else ones)
                 if weight is not None else (lambda: ones), norm)


def _probe_norm(norm, H, eps, candidates, has_weight, where):
    """(zero_centered, center) of the first candidate whose RMSNorm formula matches what `norm` returns
    on float32 probes (rms 1 and rms sqrt(eps), where eps matters), or None."""
    g = torch.Generator().manual_seed(0)
    w = torch.rand(H, generator=g) + 0.5
    checks = []
    for scale in (1.0, max(math.sqrt(eps), 1e-4)):
        x = torch.randn(4, H, generator=g) * scale
        try:
            with torch.no_grad():
                if has_weight and isinstance(getattr(norm, "weight", None), nn.Parameter):
                    y = torch.func.functional_call(norm, {"weight": w}, (x,))
                else:
                    y = norm(x)
        except Exception as e:  # a norm that needs other arguments, or fails on a CPU float32 input
            raise megamoe.ArgumentTypeError(f"{where}: calling it on a [4, {H}] float32 probe failed: {e}", 1) from None
        if not isinstance(y, torch.Tensor) or tuple(y.shape) != (4, H):
            return None
        checks.append((x.double(), y.detach().double()))
    gain = w.double() if has_weight and isinstance(getattr(norm, "weight", None), nn.Parameter) else None
    if gain is None and has_weight:
        gain = norm.weight.detach().double().cpu()
    for zc, center in candidates:
        gamma = torch.ones(H, dtype=torch.float64) if gain is None else (gain + center if zc else gain)
        if gain is None and zc:
            continue
        if all(torch.allclose(y, x * torch.rsqrt((x * x).mean(-1, keepdim=True) + eps) * gamma, rtol=1e-4, atol=1e-6)
               for x, y in checks):
            return zc, center
    return None


def _read(ck, name):
    """A checkpoint tensor as a torch tensor (a copy)."""
    dtype, shape, data = ck.read(name)
    t = torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else torch.empty(0, dtype=torch.uint8)
    return t.view(_ST_DTYPES[dtype]).reshape(shape)


_PROJ_NAMES = (("gate_proj", "up_proj", "down_proj"), ("w1", "w3", "w2"))
_FIELD_NAMES = (("weight", "weight_scale", "weight_scale_2", "input_scale"),
                ("weight_packed", "weight_scale", "weight_global_scale", "input_global_scale"))
_STACKED = ("w13_weight", "w13_weight_scale", "w13_weight_scale_2", "w13_input_scale",
            "w2_weight", "w2_weight_scale", "w2_weight_scale_2", "w2_input_scale")
_STACKED_PACKED = ("w13_weight_packed", "w13_weight_scale", "w13_weight_global_scale", "w13_input_global_scale",
                   "w2_weight_packed", "w2_weight_scale", "w2_weight_global_scale", "w2_input_global_scale")


def _stacked_tensors(ck, prefix, nvfp4, e0, e1):
    """[(name, tensor)] of the layer `prefix` of a checkpoint in SPEC §3's stacked layout (the module's
    parameters), experts [e0, e1): read from any naming style of SPEC §6 (stacked or per expert,
    ModelOpt or compressed-tensors names, whose reciprocal global scales are inverted as the C loader
    inverts them, in float32). Input scales a weight-only export lacks are left out."""
    names = set(ck.names())
    lead = prefix + "." if prefix else ""
    packed = lead + "w13_weight_packed" in names or any(
        lead + f"experts.{e0}.{p}.weight_packed" in names for p in ("gate_proj", "w1"))
    fields = _FIELD_NAMES[packed]
    wanted = range(8) if nvfp4 else (0, 4)
    out = []
    if lead + ("w13_weight_packed" if packed else "w13_weight") in names:  # stacked
        for i in wanted:
            name = lead + (_STACKED_PACKED if packed else _STACKED)[i]
            if name not in names:
                continue
            t = _read(ck, name)[e0:e1]
            if packed and i in (2, 3, 6, 7):
                t = torch.ones((), dtype=torch.float32) / t
            out.append((_STACKED[i], t.contiguous()))
        return out
    pstyle = 1 if lead + f"experts.{e0}.w1.{fields[0]}" in names else 0
    proj = _PROJ_NAMES[pstyle]

    def field(e, p, f):
        name = f"{lead}experts.{e}.{proj[p]}.{fields[f]}"
        if name not in names:
            return None
        t = _read(ck, name)
        if packed and f >= 2:
            t = torch.ones((), dtype=torch.float32) / t
        return t.reshape(()) if f >= 2 else t

    for i in wanted:
        f = i % 4
        per = []
        for e in range(e0, e1):
            if i < 4:
                g, u = field(e, 0, f), field(e, 1, f)
                per.append(None if g is None or u is None else torch.stack([g, u]) if f >= 2 else torch.cat([g, u]))
            else:
                per.append(field(e, 2, f))
        if all(t is not None for t in per):
            out.append((_STACKED[i], torch.stack(per).contiguous()))
    return out


class MegaMoEExperts(nn.Module):
    """The experts of one MoE layer: dispatch, gate/up GEMM, SwiGLU, down GEMM, optional post-expert
    RMSNorm, weighted combine (docs/SPEC.md), NVFP4 or BF16 weights.

    Life cycle (as in the engine module it mirrors): construct -> weight_loader / load_weights fill the
    checkpoint-layout parameters (host memory) -> finalize_weights() hands them to the C library,
    which repacks them for its kernels and the parameters are set to None -> forward(...).

    device: where the layer runs (default: torch's default device): "cpu" runs the CPU backend,
    "cuda[:i]" the CUDA backend; with process_group (a torch.distributed group, one process per GPU),
    the NCCL backend over that group, with num_local_experts = num_experts / world size and
    experts_start_idx = rank * num_local_experts.
    """

    def __init__(self, *, num_experts: int, num_local_experts: int, experts_start_idx: int, top_k: int,
                 hidden_size: int, intermediate_size: int, post_expert_norm=None, num_max_tokens_per_rank: int,
                 is_nvfp4: bool = True, prefix: str = "", activations: Optional[str] = None,
                 process_group=None, device=None, activation_clamp: float = 0.0, _allocate: bool = True):
        super().__init__()
        self.prefix = prefix
        megamoe._str(prefix, "prefix")
        self.num_experts = megamoe._int(num_experts, "num_experts")
        self.num_local_experts = megamoe._int(num_local_experts, "num_local_experts")
        self.experts_start_idx = megamoe._int(experts_start_idx, "experts_start_idx")
        self.experts_end_idx = self.experts_start_idx + self.num_local_experts
        self.top_k = megamoe._int(top_k, "top_k")
        self.hidden_size = megamoe._int(hidden_size, "hidden_size")
        self.intermediate_size = megamoe._int(intermediate_size, "intermediate_size")
        self.max_num_tokens = megamoe._int(num_max_tokens_per_rank, "num_max_tokens_per_rank")
        self.post_expert_norm = post_expert_norm
        self.is_nvfp4 = megamoe._bool(is_nvfp4, "is_nvfp4")
        self.process_group = process_group
        self.run_device = _device(device) if device is not None else _default_device()
        if self.run_device.type == "cuda" and self.run_device.index is None:
            self.run_device = torch.device("cuda", torch.cuda.current_device())
        norm = _norm_settings(post_expert_norm, self.hidden_size, prefix)
        self._norm = norm
        self._loaded = set()   # parameters a loader has filled (weight_loader, load_weights, load_state_dict)
        self._source = None    # where a finalized module's state_dict reads its weights from (see state_dict)
        self._state_norm_weight = None  # post_expert_norm.weight from load_state_dict, for a norm without one

        group = group_for(self.run_device, process_group)
        world, rank = group.world_size, group.rank(0)
        if self.num_local_experts * world != self.num_experts or self.experts_start_idx != rank * self.num_local_experts:
            raise megamoe.InvalidArgumentError(
                f"{prefix}: num_local_experts={num_local_experts}, experts_start_idx={experts_start_idx} do not "
                f"match rank {rank} of {world} owning experts [{rank} * E/R, ...) of num_experts={num_experts}", 1)
        fmt = "nvfp4" if self.is_nvfp4 else "bf16"
        if _allocate and self.hidden_size > 0 and self.intermediate_size > 0 and self.num_local_experts > 0:
            # the parameters and the C library's copy of them, before either is allocated
            megamoe._check_host_memory(
                2 * megamoe._weight_bytes(fmt, self.num_local_experts, self.hidden_size, self.intermediate_size),
                f"{prefix or 'MegaMoEExperts'}: the checkpoint-layout weights of {self.num_local_experts} experts")
        self._layer = megamoe.Layer(
            group, name=prefix, num_experts=num_experts, top_k=top_k, hidden_size=hidden_size,
            intermediate_size=intermediate_size, max_tokens=num_max_tokens_per_rank, format=fmt,
            norm_eps=norm.eps if norm else 1e-6, norm_zero_centered=norm.zero_centered if norm else False,
            norm_gain_center=norm.gain_center if norm else 1.0,
            activation_clamp=activation_clamp, activations=activations)
        self.activations = self._layer.activations
        self._layer_id = _op.register(self._layer)
        weakref.finalize(self, _op.unregister, self._layer_id)

        self._param_names = ()
        if _allocate:
            self._make_params()

    # ---- parameters (checkpoint layout, host memory until finalize_weights) ----------------------

    def _make_params(self):
        E, H, I = self.num_local_experts, self.hidden_size, self.intermediate_size

        def param(*shape, dtype):  # uninitialized: finalize_weights refuses any parameter never loaded
            p = nn.Parameter(torch.empty(shape, dtype=dtype, device="cpu"), requires_grad=False)
            p.weight_loader = self.weight_loader
            return p

        if self.is_nvfp4:
            e4m3 = torch.float8_e4m3fn
            self.w13_weight = param(E, 2 * I, H // 2, dtype=torch.uint8)
            self.w13_weight_scale = param(E, 2 * I, H // 16, dtype=e4m3)
            self.w13_weight_scale_2 = param(E, 2, dtype=torch.float32)
            self.w13_input_scale = param(E, 2, dtype=torch.float32)
            self.w2_weight = param(E, H, I // 2, dtype=torch.uint8)
            self.w2_weight_scale = param(E, H, I // 16, dtype=e4m3)
            self.w2_weight_scale_2 = param(E, dtype=torch.float32)
            self.w2_input_scale = param(E, dtype=torch.float32)
            self._param_names = ("w13_weight", "w13_weight_scale", "w13_weight_scale_2", "w13_input_scale",
                                 "w2_weight", "w2_weight_scale", "w2_weight_scale_2", "w2_input_scale")
        else:
            self.w13_weight = param(E, 2 * I, H, dtype=torch.bfloat16)
            self.w2_weight = param(E, H, I, dtype=torch.bfloat16)
            self._param_names = ("w13_weight", "w2_weight")

    def _param_name(self, param, weight_name):
        if isinstance(weight_name, str) and weight_name in self._param_names and getattr(self, weight_name) is param:
            return weight_name
        for n in self._param_names:
            if getattr(self, n) is param:
                return n
        raise megamoe.InvalidArgumentError(
            f"{self.prefix}: weight_loader: param is not one of this module's parameters {list(self._param_names)} "
            f"(weight_name={weight_name!r})", 1)

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor, weight_name: str, **kwargs) -> None:
        """Copies this rank's experts [experts_start_idx, experts_end_idx) of the all-expert tensor. The
        dtype must be the parameter's (SPEC §5: nothing is converted)."""
        if param is None or self._layer.finalized:
            raise megamoe.InvalidArgumentError(
                f"{self.prefix}: expert weight {weight_name!r} loaded after finalize_weights()", 1)
        name = self._param_name(param, weight_name)
        if not isinstance(loaded_weight, torch.Tensor):
            raise megamoe.ArgumentTypeError(
                f"{self.prefix}: expert weight {name!r}: expected a tensor, got {type(loaded_weight).__name__}", 1)
        if loaded_weight.dim() == 0 or loaded_weight.shape[0] != self.num_experts:
            raise megamoe.BadWeightError(
                f"{self.prefix}: expert weight {name!r} of shape {tuple(loaded_weight.shape)} does not hold "
                f"all {self.num_experts} experts in its first dimension", 3)
        if loaded_weight.dtype != param.dtype:
            hint = (" (E4M3 bit patterns held as uint8: pass .view(torch.float8_e4m3fn))"
                    if param.dtype == torch.float8_e4m3fn and loaded_weight.dtype == torch.uint8 else "")
            raise megamoe.BadWeightError(
                f"{self.prefix}: expert weight {name!r}: dtype {_dtype_name(loaded_weight.dtype)}, expected "
                f"{_dtype_name(param.dtype)}{hint}", 3)
        shard = loaded_weight[self.experts_start_idx:self.experts_end_idx]
        if shard.shape != param.data.shape and shard.dim() == param.dim() + 1 and shard.shape[-1] == 1:
            shard = shard.squeeze(-1)  # per-expert scalars stored as [E, 1] (SPEC §6)
        if shard.shape != param.data.shape:
            raise megamoe.BadWeightError(
                f"{self.prefix}: expert weight {name!r} shard {tuple(shard.shape)} does not fit parameter "
                f"{tuple(param.data.shape)}", 3)
        param.data.copy_(shard)
        self._loaded.add(name)

    def load_weights(self, weights: Iterable[Tuple[str, torch.Tensor]]) -> Iterable[str]:
        """Loads (name, all-expert tensor) pairs; yields each name. Names may carry the module's prefix."""
        for item in weights:
            if not isinstance(item, (tuple, list)) or len(item) != 2:
                raise megamoe.ArgumentTypeError(f"{self.prefix}: load_weights: expected (name, tensor) pairs, got "
                                                f"{type(item).__name__}", 1)
            name, tensor = item
            if not isinstance(name, str):
                raise megamoe.ArgumentTypeError(f"{self.prefix}: load_weights: a weight name must be a str, got "
                                                f"{type(name).__name__}", 1)
            if not self._param_names:
                raise megamoe.InvalidArgumentError(
                    f"{self.prefix}: load_weights({name!r}): this module was built by from_checkpoint, which loads "
                    "and finalizes its weights itself: it has no parameters to load into", 1)
            if self._layer.finalized:
                raise megamoe.InvalidArgumentError(
                    f"{self.prefix}: expert weight {name!r} loaded after finalize_weights()", 1)
            short = name[len(self.prefix) + 1:] if self.prefix and name.startswith(self.prefix + ".") else name
            if short not in self._param_names:
                raise megamoe.BadWeightError(
                    f"{self.prefix}: unexpected expert weight {name!r} (expected one of {list(self._param_names)})", 3)
            self.weight_loader(getattr(self, short), tensor, short)
            yield name

    def finalize_weights(self) -> None:
        """Hands the weights to the C library (which repacks them into its kernel layout and validates
        the scales, SPEC §5) and frees the checkpoint parameters (set to None). Refuses a parameter
        never loaded (the input scales excepted: the C library judges those, SPEC §6). Idempotent."""
        if self._layer.finalized:
            return
        missing = [n for n in self._param_names if n not in self._loaded and n not in _OPTIONAL_PARAMS]
        if missing:
            raise megamoe.NotFinalizedError(
                f"{self.prefix}: cannot finalize: {', '.join(missing)} never loaded (weight_loader, load_weights or "
                "load_state_dict)", 4)
        norm = self._norm
        weight = norm.weight_of() if norm is not None and norm.weight_of is not None else None
        if norm is not None and weight is None:
            weight = self._state_norm_weight
        if norm is not None and weight is None and self._source is None:
            raise megamoe.NotFinalizedError(
                f"{self.prefix}: cannot finalize: post_expert_norm ({type(norm.source).__name__}) has no weight", 4)
        if self._param_names:
            self._hand_weights()
        if weight is not None:
            self._layer.load_norm_weight(weight.detach().float().cpu().contiguous())
        self._layer.finalize()
        for name in self._param_names:
            setattr(self, name, None)

    def _hand_weights(self):
        layer, I = self._layer, self.intermediate_size
        host = {n: getattr(self, n).detach().cpu().contiguous() for n in self._param_names}
        for e in range(self.num_local_experts):
            g = self.experts_start_idx + e
            w13, w2 = host["w13_weight"][e], host["w2_weight"][e]
            layer.load_expert_weight(g, "gate", "weight", w13[:I])
            layer.load_expert_weight(g, "up", "weight", w13[I:])
            layer.load_expert_weight(g, "down", "weight", w2)
            if self.is_nvfp4:
                s13, s2 = host["w13_weight_scale"][e], host["w2_weight_scale"][e]
                layer.load_expert_weight(g, "gate", "weight_scale", s13[:I])
                layer.load_expert_weight(g, "up", "weight_scale", s13[I:])
                layer.load_expert_weight(g, "down", "weight_scale", s2)
                for proj, j in (("gate", 0), ("up", 1)):
                    layer.load_expert_weight(g, proj, "weight_scale_2", host["w13_weight_scale_2"][e, j])
                    if "w13_input_scale" in self._loaded:
                        layer.load_expert_weight(g, proj, "input_scale", host["w13_input_scale"][e, j])
                layer.load_expert_weight(g, "down", "weight_scale_2", host["w2_weight_scale_2"][e])
                if "w2_input_scale" in self._loaded:
                    layer.load_expert_weight(g, "down", "input_scale", host["w2_input_scale"][e])

    # ---- state_dict: what a finalized module can write --------------------------------------------

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        """Before finalize_weights(): the checkpoint-layout parameters. After it, the C library holds the
        weights in its kernel layout, which cannot be read back: a module built by from_checkpoint writes
        the same parameters (w13_weight, ... of its local experts, SPEC §3's stacked layout, and the norm's
        weight where the checkpoint has it), read again from that checkpoint in whichever naming style it
        has; load_state_dict takes them into a new module, and a file of them under a prefix loads with
        from_checkpoint. Any other finalized module raises UnsupportedError (save before
        finalize_weights(), or keep the checkpoint)."""
        if not self._layer.finalized:
            return super()._save_to_state_dict(destination, prefix, keep_vars)
        for name, tensor in self._finalized_state():
            destination[prefix + name] = tensor

    def _finalized_state(self):
        src = self._source
        if src is None:
            raise megamoe.UnsupportedError(
                f"{self.prefix or type(self).__name__}: state_dict() of a finalized module: its weights live in the C "
                "library's kernel layout, which cannot be read back. Save the state_dict before finalize_weights(), or "
                "build the module with MegaMoEExperts.from_checkpoint (whose state_dict re-reads its checkpoint)", 8)
        kind, *rest = src
        if kind == "tensors":
            return list(rest[0].items())
        path, ck_prefix = rest
        try:
            with megamoe.Checkpoint(path) as ck:
                out = _stacked_tensors(ck, ck_prefix, self.is_nvfp4, self.experts_start_idx, self.experts_end_idx)
                norm = (ck_prefix + "." if ck_prefix else "") + "post_expert_norm.weight"
                if not isinstance(self.post_expert_norm, nn.Module) and norm in ck.names():
                    out.append(("post_expert_norm.weight", _read(ck, norm)))
        except megamoe.Error as e:
            raise megamoe.UnsupportedError(
                f"{self.prefix}: state_dict() re-reads the checkpoint this finalized module was loaded from "
                f"({path}, layer {ck_prefix!r}), and that failed: {e}", 8) from None
        return out

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                              error_msgs):
        if self._layer.finalized:
            if any(k.startswith(prefix) and k[len(prefix):] in self._state_names() for k in state_dict):
                error_msgs.append(f"{self.prefix}: load_state_dict into a finalized module: its weights are in the C "
                                  "library; build a new module and load it before finalize_weights()")
            return
        for name in self._param_names:
            t = state_dict.get(prefix + name)
            if isinstance(t, torch.Tensor) and t.dtype != getattr(self, name).dtype:
                error_msgs.append(f"{self.prefix}: {prefix + name}: dtype {_dtype_name(t.dtype)}, expected "
                                  f"{_dtype_name(getattr(self, name).dtype)} (SPEC §5: nothing is converted)")
                return
        before = len(error_msgs)
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                                      error_msgs)
        if len(error_msgs) == before:
            self._loaded.update(n for n in self._param_names if prefix + n in state_dict)
            # input scales are optional (SPEC §6): a state_dict of a weight-only export has none
            missing_keys[:] = [k for k in missing_keys if k not in {prefix + n for n in _OPTIONAL_PARAMS}]
        norm_key = prefix + "post_expert_norm.weight"
        if norm_key in state_dict and not isinstance(self.post_expert_norm, nn.Module):
            self._state_norm_weight = state_dict[norm_key]
            unexpected_keys[:] = [k for k in unexpected_keys if k != norm_key]

    def _state_names(self):
        return set(self._param_names) | {"post_expert_norm.weight"}

    def __getstate__(self):
        megamoe._no_pickle(self)

    def __reduce_ex__(self, protocol):
        megamoe._no_pickle(self)

    @property
    def finalized(self) -> bool:
        return self._layer.finalized

    def memory(self) -> dict:
        """The C layer's bytes (megamoe_layer_memory): weight_bytes (resident kernel-layout weights),
        checkpoint_bytes, finalize_peak_bytes, buffer_bytes (shared per shape), workspace_bytes."""
        return self._layer.memory()

    @property
    def resident_bytes(self) -> int:
        return self.memory()["weight_bytes"]

    @property
    def peak_bytes(self) -> int:
        return self.memory()["finalize_peak_bytes"]

    # ---- forward ---------------------------------------------------------------------------------

    def input_buffer(self, num_tokens: int):
        """Checks a forward of num_tokens fits the communication buffer and returns the C layer, which
        owns the view of the buffer shared by the layers of this shape."""
        if num_tokens > self.max_num_tokens:
            raise megamoe.BadInputError(
                f"{self.prefix}: MegaMoE got {num_tokens} tokens, but the buffer was sized for {self.max_num_tokens} "
                "(num_max_tokens_per_rank)", 5)
        if not self._layer.finalized:
            raise megamoe.NotFinalizedError(f"{self.prefix}: forward before finalize_weights()", 4)
        return self._layer

    def forward(self, hidden_states: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                is_padding: Optional[torch.Tensor] = None) -> torch.Tensor:
        """y [T, H] bf16. hidden_states [T, H] bf16; topk_weights [T, K] (float32, or bf16/f16: converted);
        topk_ids [T, K] (int32, or another integer dtype: range-checked, converted) global expert ids,
        -1 = empty slot; is_padding [T] bool. On CUDA, ids outside [-1, E) are reported by check() (no
        host sync here)."""
        # Plain tensors in eager mode go to the op's kernel directly, past PyTorch's dispatcher (as the
        # op does, _op.plain_eager); tracing, tensor subclasses, modes and inputs that require grad take
        # the op, whose fake implementation refuses what the kernel would (no Python raise is traced).
        if _plain_eager(hidden_states, topk_weights, topk_ids) or _not_tensors(
                (hidden_states, topk_weights, topk_ids, is_padding)):
            try:
                return _kernel(self._layer_id, hidden_states, topk_weights, topk_ids, is_padding)
            except (megamoe.BadInputError, megamoe.NotFinalizedError):  # with the module's message for these
                self.input_buffer(hidden_states.shape[0])
                raise
        return _experts(self._layer_id, hidden_states, topk_weights, topk_ids, is_padding)

    def check(self) -> None:
        """Waits for the last forward and raises megamoe.BadInputError if its ids were out of range."""
        self._layer.check()

    def extra_repr(self) -> str:
        return (f"prefix={self.prefix!r}, E={self.num_experts}, E_local={self.num_local_experts}, K={self.top_k}, "
                f"H={self.hidden_size}, I={self.intermediate_size}, T_max={self.max_num_tokens}, "
                f"{'nvfp4' if self.is_nvfp4 else 'bf16'}, activations={self.activations}, device={self.run_device}")

    # ---- from a checkpoint -----------------------------------------------------------------------

    @classmethod
    def from_checkpoint(cls, path, prefix: str = "", *, top_k: int, num_max_tokens_per_rank: int,
                        post_expert_norm=None, norm_eps: float = 1e-6, norm_zero_centered: bool = False,
                        norm_gain_center: float = 1.0, activations: Optional[str] = None, process_group=None,
                        device=None, activation_clamp: float = 0.0) -> "MegaMoEExperts":
        """Loads the layer `prefix` of a safetensors file or sharded folder through the C loader
        (every naming style of SPEC §6) and finalizes it. The norm's epsilon and zero-centered gain come
        from post_expert_norm (read as MegaMoEExperts reads it) or the norm_* arguments; its weight from
        the checkpoint, if it has one (else post_expert_norm's). The module's state_dict re-reads the
        layer's tensors from `path`."""
        with megamoe.Checkpoint(path) as ck:
            info = ck.describe(prefix)
            if post_expert_norm is None and info["has_norm"]:
                post_expert_norm = types.SimpleNamespace(weight=None, variance_epsilon=norm_eps,
                                                         zero_centered_gamma=norm_zero_centered,
                                                         gain_center=norm_gain_center)
            dev = _device(device) if device is not None else _default_device()
            g = group_for(dev, process_group)
            world, rank = g.world_size, g.rank(0)
            E = info["num_experts"]
            E_local = E // world if E % world == 0 else E
            m = cls(num_experts=E, num_local_experts=E_local, experts_start_idx=rank * E_local, top_k=top_k,
                    hidden_size=info["hidden_size"], intermediate_size=info["intermediate_size"],
                    post_expert_norm=post_expert_norm, num_max_tokens_per_rank=num_max_tokens_per_rank,
                    is_nvfp4=info["format"] == "nvfp4", prefix=info["prefix"], activations=activations,
                    process_group=process_group, device=dev, activation_clamp=activation_clamp, _allocate=False)
            m._layer.load_checkpoint(ck, info["prefix"])
            m._source = ("checkpoint", ck.path, info["prefix"])
        norm = m._norm
        if norm is not None and not info["has_norm"]:
            weight = norm.weight_of() if norm.weight_of is not None else None
            if weight is None:
                raise megamoe.NotFinalizedError(
                    f"{info['prefix']}: post_expert_norm has no weight and the checkpoint has no "
                    f"{info['prefix']}.post_expert_norm.weight", 4)
            m._layer.load_norm_weight(weight.detach().float().cpu().contiguous())
        m._layer.finalize()
        return m
