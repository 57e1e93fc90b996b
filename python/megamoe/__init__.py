"""megamoe: the experts of a Mixture-of-Experts layer (NVFP4 and BF16 weights, expert-parallel).

This package binds the C library's public header (include/megamoe.h) with ctypes: it needs no
compiler, no CPython or libtorch ABI, and no dependency beyond the standard library. `megamoe.torch`
adds the PyTorch op and module (and needs torch).

    g = megamoe.Group("cpu")                       # or "cuda" (R ranks on one GPU) or "nccl"
    layer = megamoe.Layer(g, num_experts=8, top_k=2, hidden_size=256, intermediate_size=256,
                          max_tokens=64, format="bf16")
    layer.load_weight("w13_weight", w13)           # numpy arrays or CPU torch tensors, [E, ...]
    layer.load_weight("w2_weight", w2)
    layer.finalize()
"""
import ctypes
import os
import threading

from . import _capi
from ._capi import lib as _lib

__all__ = [
    "__version__", "Error", "InvalidArgumentError", "OutOfMemoryError", "BadWeightError", "NotFinalizedError",
    "BadInputError", "IOError_", "FormatError", "UnsupportedError", "TimeoutError_", "CudaError", "NcclError",
    "InternalError", "ClosedError", "Group", "Layer", "Checkpoint", "backend_available", "status_string",
    "save_safetensors", "quantize_checkpoint", "HAS_ACTIVATIONS",
]

# Whether the C library has SPEC §3b's `activations` setting (NVFP4 weights with BF16 activations).
HAS_ACTIVATIONS = _capi.HAS_ACTIVATIONS

__version__ = _lib.megamoe_version_string().decode()


# ---- Errors: one class per megamoe_status, all subclasses of Error --------------------------------


class Error(Exception):
    """A megamoe call failed. `status` is the megamoe_status code, the message the handle's detail."""

    status = None

    def __init__(self, message, status=None):
        super().__init__(message)
        if status is not None:
            self.status = status


class InvalidArgumentError(Error, ValueError):
    status = 1


class OutOfMemoryError(Error, MemoryError):
    status = 2


class BadWeightError(Error, ValueError):
    status = 3


class NotFinalizedError(Error, RuntimeError):
    status = 4


class BadInputError(Error, ValueError):
    status = 5


class IOError_(Error, OSError):
    status = 6


class FormatError(Error, ValueError):
    status = 7


class UnsupportedError(Error, RuntimeError):
    status = 8


class TimeoutError_(Error, TimeoutError):
    status = 9


class CudaError(Error, RuntimeError):
    status = 10


class NcclError(Error, RuntimeError):
    status = 11


class InternalError(Error, RuntimeError):
    status = 12


class ClosedError(InvalidArgumentError):
    """A layer or group used after close(), or a layer whose group was closed."""


_ERRORS = {c.status: c for c in (InvalidArgumentError, OutOfMemoryError, BadWeightError, NotFinalizedError,
                                  BadInputError, IOError_, FormatError, UnsupportedError, TimeoutError_,
                                  CudaError, NcclError, InternalError)}


def status_string(status):
    return _lib.megamoe_status_string(int(status)).decode()


def _raise(status, message):
    cls = _ERRORS.get(status, Error)
    raise cls(f"{message} [{status_string(status)}]", status)


def backend_available(backend):
    """Whether this build and machine can create a group of that backend ("cpu", "cuda", "nccl")."""
    return bool(_lib.megamoe_backend_available(_backend_code(backend)))


def _backend_code(backend):
    try:
        return _capi.BACKEND[backend]
    except KeyError:
        raise InvalidArgumentError(f"backend={backend!r}: expected one of {sorted(_capi.BACKEND)}", 1) from None


# ---- Host tensors: numpy arrays and CPU torch tensors, without importing either -------------------

_NUMPY_DTYPES = {
    "bool": "BOOL", "uint8": "U8", "int8": "I8", "int16": "I16", "uint16": "U16", "float16": "F16",
    "bfloat16": "BF16", "int32": "I32", "uint32": "U32", "float32": "F32", "float64": "F64", "int64": "I64",
    "uint64": "U64", "float8_e4m3fn": "F8_E4M3", "float8_e5m2": "F8_E5M2",
}


def _c_tensor(obj, what, dtype=None):
    """A megamoe_tensor viewing obj's host memory; obj must stay alive while the view is used.
    dtype (a safetensors name) overrides the element type, e.g. "BF16" for uint16 bf16 patterns."""
    t = _capi.Tensor()
    if hasattr(obj, "data_ptr") and hasattr(obj, "is_contiguous"):  # a torch tensor
        if obj.device.type != "cpu":
            raise InvalidArgumentError(f"{what}: expected a CPU tensor (host memory), got device {obj.device}", 1)
        if not obj.is_contiguous():
            raise InvalidArgumentError(f"{what}: expected a contiguous tensor, got strides {tuple(obj.stride())}", 1)
        name = str(obj.dtype).replace("torch.", "")
        shape, ptr = tuple(obj.shape), obj.data_ptr()
    elif hasattr(obj, "__array_interface__"):  # a numpy array (or anything with the interface)
        ai = obj.__array_interface__
        if ai.get("strides") is not None:
            raise InvalidArgumentError(f"{what}: expected a C-contiguous array, got strides {ai['strides']}", 1)
        name = getattr(getattr(obj, "dtype", None), "name", None) or ai["typestr"]
        shape, ptr = tuple(ai["shape"]), ai["data"][0]
    else:
        raise InvalidArgumentError(f"{what}: expected a numpy array or a CPU torch tensor, got {type(obj).__name__}", 1)
    code = dtype or _NUMPY_DTYPES.get(name)
    if code is None:
        raise InvalidArgumentError(f"{what}: dtype {name} is not a megamoe dtype", 1)
    if len(shape) > _capi.MAX_DIMS:
        raise InvalidArgumentError(f"{what}: {len(shape)} dimensions, at most {_capi.MAX_DIMS}", 1)
    t.dtype = _capi.DTYPE[code]
    t.ndim = len(shape)
    for i, n in enumerate(shape):
        t.shape[i] = n
    t.data = ptr
    return t


# ---- Group ---------------------------------------------------------------------------------------


class Group:
    """An expert-parallel group (megamoe_group). backend: "cpu" (num_ranks ranks in this process, on
    the host), "cuda" (num_ranks ranks sharing one GPU, `device`), "nccl" (this process is one rank of
    the communicator `nccl_comm`, an ncclComm_t as an int). Layers of one shape in a group share one
    communication buffer. close() (or garbage collection) closes the group's layers first."""

    def __init__(self, backend="cpu", num_ranks=1, device=0, nccl_comm=None, num_threads=0):
        cfg = _capi.GroupConfig()
        _lib.megamoe_group_config_init(ctypes.byref(cfg))
        cfg.backend = _backend_code(backend)
        cfg.num_ranks = int(num_ranks)
        cfg.device = int(device)
        cfg.nccl_comm = nccl_comm
        cfg.num_threads = int(num_threads)
        self.backend = backend
        self.device = int(device)
        self._handle = None
        # Each open layer's handle, in a one-element list the layer shares: the group destroys the
        # layers it still has before itself, in whatever order garbage collection finalizes them.
        self._layer_cells = {}
        self._lock = threading.Lock()
        h = ctypes.c_void_p()
        st = _lib.megamoe_group_create(ctypes.byref(cfg), ctypes.byref(h))
        if st != _capi.OK:
            msg = _lib.megamoe_group_last_error(h).decode() if h.value else "out of memory"
            _lib.megamoe_group_destroy(h)
            _raise(st, f"megamoe.Group({backend!r}, num_ranks={num_ranks}, device={device}): {msg}")
        self._handle = h

    @property
    def closed(self):
        return self._handle is None

    def _h(self):
        if self._handle is None:
            raise ClosedError(f"megamoe.Group({self.backend!r}) is closed", 1)
        return self._handle

    @property
    def world_size(self):
        return _lib.megamoe_group_world_size(self._h())

    @property
    def local_ranks(self):
        return _lib.megamoe_group_local_ranks(self._h())

    def rank(self, local_rank=0):
        return _lib.megamoe_group_rank(self._h(), int(local_rank))

    def buffer_bytes(self, num_experts, max_tokens, top_k, hidden_size, intermediate_size):
        out = ctypes.c_uint64()
        st = _lib.megamoe_group_buffer_bytes(self._h(), num_experts, max_tokens, top_k, hidden_size,
                                             intermediate_size, ctypes.byref(out))
        if st != _capi.OK:
            _raise(st, _lib.megamoe_group_last_error(self._handle).decode())
        return out.value

    def close(self):
        """Closes every layer of the group, then the group. Idempotent."""
        if self._handle is None:
            return
        with self._lock:
            cells = list(self._layer_cells.values())
            self._layer_cells.clear()
        for cell in cells:
            if cell[0] is not None:
                _lib.megamoe_layer_destroy(cell[0])
                cell[0] = None
        _lib.megamoe_group_destroy(self._handle)
        self._handle = None

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass

    def __repr__(self):
        state = "closed" if self.closed else f"world_size={self.world_size}, local_ranks={self.local_ranks}"
        return f"megamoe.Group({self.backend!r}, device={self.device}, {state})"


# ---- Layer ---------------------------------------------------------------------------------------


class Layer:
    """One MoE experts layer (megamoe_layer) of a Group. Holds its group, so the group outlives it
    unless closed explicitly (then the layer raises ClosedError). Sizes follow SPEC §1: E % R == 0,
    H and I multiples of 256, 1 <= K <= 32, 1 <= max_tokens. A failing call raises and leaves the
    layer as it was (SPEC §5)."""

    def __init__(self, group, *, num_experts, top_k, hidden_size, intermediate_size, max_tokens, format="nvfp4",
                 name="", norm_eps=1e-6, norm_zero_centered=False, norm_gain_center=1.0, activation_clamp=0.0,
                 timeout_ms=None, gemm_kernel=0, activations=None):
        if format not in _capi.FORMAT:
            raise InvalidArgumentError(f"format={format!r}: expected 'nvfp4' or 'bf16'", 1)
        cfg = _capi.LayerConfigType()
        _lib.megamoe_layer_config_init(ctypes.byref(cfg))
        if activations is not None:
            if activations not in _capi.ACTIVATIONS:
                raise InvalidArgumentError(f"activations={activations!r}: expected 'bf16' or 'nvfp4'", 1)
            if _capi.HAS_ACTIVATIONS:
                cfg.activations = _capi.ACTIVATIONS[activations]
            elif activations != format:
                raise UnsupportedError(
                    f"activations={activations!r} with {format} weights: this build of the C library computes "
                    f"{format} layers with {format} activations only (no SPEC §3b setting)", 8)
        if _capi.HAS_ACTIVATIONS:
            self.activations = {v: k for k, v in _capi.ACTIVATIONS.items()}[cfg.activations]
        else:
            self.activations = format
        self._name_bytes = str(name).encode()
        cfg.name = self._name_bytes
        cfg.num_experts = int(num_experts)
        cfg.top_k = int(top_k)
        cfg.hidden_size = int(hidden_size)
        cfg.intermediate_size = int(intermediate_size)
        cfg.max_tokens = int(max_tokens)
        cfg.format = _capi.FORMAT[format]
        cfg.norm_eps = float(norm_eps)
        cfg.norm_zero_centered = int(bool(norm_zero_centered))
        cfg.norm_gain_center = float(norm_gain_center)
        cfg.activation_clamp = float(activation_clamp)
        if timeout_ms is not None:
            cfg.timeout_ms = int(timeout_ms)
        cfg.gemm_kernel = int(gemm_kernel)
        self.group = group
        self.name = str(name)
        self.format = format
        self.num_experts, self.top_k = cfg.num_experts, cfg.top_k
        self.hidden_size, self.intermediate_size, self.max_tokens = cfg.hidden_size, cfg.intermediate_size, cfg.max_tokens
        self._cell = [None]
        self._finalized = False
        h = ctypes.c_void_p()
        st = _lib.megamoe_layer_create(group._h(), ctypes.byref(cfg), ctypes.byref(h))
        if st != _capi.OK:
            msg = _lib.megamoe_layer_last_error(h).decode() if h.value else "out of memory"
            _lib.megamoe_layer_destroy(h)
            _raise(st, msg)
        self._cell[0] = h
        with group._lock:
            group._layer_cells[id(self._cell)] = self._cell

    # -- state
    @property
    def _handle(self):
        return self._cell[0]

    @property
    def closed(self):
        return self._cell[0] is None

    @property
    def finalized(self):
        return self._finalized

    def _h(self):
        if self._handle is None:
            why = " (its group was closed)" if self.group.closed else ""
            raise ClosedError(f"layer {self.name!r} is closed{why}", 1)
        return self._handle

    def _check(self, st):
        if st != _capi.OK:
            _raise(st, _lib.megamoe_layer_last_error(self._handle).decode())

    def last_error(self):
        return _lib.megamoe_layer_last_error(self._h()).decode()

    # -- weights
    def load_weight(self, name, tensor, dtype=None):
        """One stacked weight of all E experts ([E, ...], host memory); see megamoe_layer_load_weight."""
        t = _c_tensor(tensor, f"{self.name}: {name}", dtype)
        self._check(_lib.megamoe_layer_load_weight(self._h(), str(name).encode(), ctypes.byref(t)))

    def load_expert_weight(self, expert, proj, field, tensor, dtype=None):
        """One field ("weight", "weight_scale", "weight_scale_2", "input_scale") of one projection
        ("gate", "up", "down") of one global expert."""
        if proj not in _capi.PROJ:
            raise InvalidArgumentError(f"proj={proj!r}: expected one of {list(_capi.PROJ)}", 1)
        if field not in _capi.FIELD:
            raise InvalidArgumentError(f"field={field!r}: expected one of {list(_capi.FIELD)}", 1)
        t = _c_tensor(tensor, f"{self.name}: expert {expert} {proj} {field}", dtype)
        self._check(_lib.megamoe_layer_load_expert_weight(self._h(), int(expert), _capi.PROJ[proj],
                                                          _capi.FIELD[field], ctypes.byref(t)))

    def load_norm_weight(self, tensor, dtype=None):
        t = _c_tensor(tensor, f"{self.name}: post_expert_norm.weight", dtype)
        self._check(_lib.megamoe_layer_load_norm_weight(self._h(), ctypes.byref(t)))

    def load_checkpoint(self, checkpoint, prefix=""):
        """Every expert weight (and the norm weight, if any) of `prefix` from a Checkpoint or a path."""
        own = not isinstance(checkpoint, Checkpoint)
        ck = Checkpoint(checkpoint) if own else checkpoint
        try:
            self._check(_lib.megamoe_layer_load_checkpoint(self._h(), ck._h(), str(prefix).encode(),
                                                           _capi.ProgressFn(), None))
        finally:
            if own:
                ck.close()

    def finalize(self):
        """Repacks the weights into the kernel layout and frees the checkpoint-layout copies. Idempotent."""
        self._check(_lib.megamoe_layer_finalize(self._h()))
        self._finalized = True

    def memory(self):
        """Bytes: weight (resident), checkpoint (still held), finalize_peak, buffer (per rank), workspace."""
        info = _capi.MemoryInfo()
        self._check(_lib.megamoe_layer_memory(self._h(), ctypes.byref(info)))
        return {"weight_bytes": info.weight_bytes, "checkpoint_bytes": info.checkpoint_bytes,
                "finalize_peak_bytes": info.finalize_peak_bytes, "buffer_bytes": info.buffer_bytes,
                "workspace_bytes": info.workspace_bytes}

    # -- forward
    def forward_ptrs(self, args, stream=0):
        """Runs megamoe_layer_forward on raw pointers: `args` is a list of (num_tokens, x, topk_ids,
        topk_weights, is_padding or 0, y) tuples of addresses, one per local rank. Checks nothing: the
        caller (megamoe.torch) has validated the tensors behind them."""
        n = len(args)
        arr = (_capi.ForwardArgs * n)()
        for i, a in enumerate(args):
            arr[i].num_tokens, arr[i].x, arr[i].topk_ids, arr[i].topk_weights, arr[i].is_padding, arr[i].y = a
        self._check(_lib.megamoe_layer_forward(self._h(), arr, stream or None))

    def check(self):
        """Waits for the last forward and raises BadInputError if its device kernels found expert ids
        outside [-1, E) (the CPU backend raises those from the forward itself)."""
        self._check(_lib.megamoe_layer_check(self._h()))

    def close(self):
        cell = getattr(self, "_cell", None)
        if cell is None:
            return
        with self.group._lock:
            self.group._layer_cells.pop(id(cell), None)
            h, cell[0] = cell[0], None
        if h is not None:
            _lib.megamoe_layer_destroy(h)

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass

    def __repr__(self):
        return (f"megamoe.Layer({self.name!r}, E={self.num_experts}, K={self.top_k}, H={self.hidden_size}, "
                f"I={self.intermediate_size}, T_max={self.max_tokens}, {self.format}, activations={self.activations}"
                f"{', closed' if self.closed else ''})")


# ---- Checkpoint ----------------------------------------------------------------------------------


class Checkpoint:
    """A safetensors file, or a folder with model.safetensors.index.json, memory-mapped."""

    def __init__(self, path):
        self.path = os.fspath(path)
        self._handle = None
        h = ctypes.c_void_p()
        st = _lib.megamoe_checkpoint_open(self.path.encode(), ctypes.byref(h))
        if st != _capi.OK:
            msg = _lib.megamoe_checkpoint_last_error(h).decode() if h.value else "out of memory"
            _lib.megamoe_checkpoint_close(h)
            _raise(st, msg)
        self._handle = h

    def _h(self):
        if self._handle is None:
            raise ClosedError(f"checkpoint {self.path!r} is closed", 1)
        return self._handle

    def layers(self):
        """The MoE layers the checkpoint holds: a list of dicts (prefix, format, naming, num_experts,
        hidden_size, intermediate_size, has_norm, bytes)."""
        n = ctypes.c_int()
        st = _lib.megamoe_checkpoint_find_layers(self._h(), None, 0, ctypes.byref(n))
        if st != _capi.OK:
            _raise(st, _lib.megamoe_checkpoint_last_error(self._handle).decode())
        infos = (_capi.LayerInfo * max(n.value, 1))()
        st = _lib.megamoe_checkpoint_find_layers(self._h(), infos, n.value, ctypes.byref(n))
        if st != _capi.OK:
            _raise(st, _lib.megamoe_checkpoint_last_error(self._handle).decode())
        return [_layer_info(infos[i]) for i in range(n.value)]

    def describe(self, prefix=""):
        info = _capi.LayerInfo()
        st = _lib.megamoe_checkpoint_describe_layer(self._h(), str(prefix).encode(), ctypes.byref(info))
        if st != _capi.OK:
            _raise(st, _lib.megamoe_checkpoint_last_error(self._handle).decode())
        return _layer_info(info)

    def close(self):
        if self._handle is not None:
            _lib.megamoe_checkpoint_close(self._handle)
            self._handle = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass


def _layer_info(i):
    return {"prefix": i.prefix.decode(), "format": "nvfp4" if i.format == 0 else "bf16",
            "naming": _capi.NAMING.get(i.naming, str(i.naming)), "num_experts": i.num_experts,
            "hidden_size": i.hidden_size, "intermediate_size": i.intermediate_size, "has_norm": bool(i.has_norm),
            "bytes": i.bytes}


# ---- Files ---------------------------------------------------------------------------------------


def save_safetensors(path, tensors):
    """Writes {name: numpy array or CPU torch tensor} to a safetensors file (megamoe_safetensors_write)."""
    items = list(tensors.items())
    arr = (_capi.NamedTensor * max(len(items), 1))()
    keep = []
    for i, (name, t) in enumerate(items):
        keep.append(name.encode())
        arr[i].name = keep[-1]
        arr[i].tensor = _c_tensor(t, name)
    err = ctypes.create_string_buffer(512)
    st = _lib.megamoe_safetensors_write(os.fspath(path).encode(), arr, len(items), err, len(err))
    if st != _capi.OK:
        _raise(st, err.value.decode())


def quantize_checkpoint(in_path, out_path, calib_tokens=None, calib_seed=None, activation_clamp=None):
    """BF16 expert weights of a checkpoint -> NVFP4 in the per-expert naming (what `megamoe quantize`
    does; megamoe_quantize_checkpoint): a file in, a file out; a folder in, a folder out."""
    opt = _capi.QuantizeOptions()
    _lib.megamoe_quantize_options_init(ctypes.byref(opt))
    if calib_tokens is not None:
        opt.calib_tokens = int(calib_tokens)
    if calib_seed is not None:
        opt.calib_seed = int(calib_seed)
    if activation_clamp is not None:
        opt.activation_clamp = float(activation_clamp)
    err = ctypes.create_string_buffer(512)
    st = _lib.megamoe_quantize_checkpoint(os.fspath(in_path).encode(), os.fspath(out_path).encode(),
                                          ctypes.byref(opt), err, len(err))
    if st != _capi.OK:
        _raise(st, err.value.decode())
