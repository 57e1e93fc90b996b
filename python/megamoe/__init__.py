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
import numbers
import operator
import os
import threading
import warnings

from . import _capi
from ._capi import lib as _lib

__all__ = [
    "__version__", "Error", "InvalidArgumentError", "OutOfMemoryError", "BadWeightError", "NotFinalizedError",
    "BadInputError", "IOError_", "FormatError", "UnsupportedError", "TimeoutError_", "CudaError", "NcclError",
    "InternalError", "ClosedError", "ArgumentTypeError", "Group", "Layer", "Checkpoint", "NcclComm",
    "backend_available", "status_string", "save_safetensors", "quantize_checkpoint",
]

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


class ArgumentTypeError(InvalidArgumentError, TypeError):
    """An argument of the wrong type (a TypeError as well as an InvalidArgumentError)."""


_ERRORS = {c.status: c for c in (InvalidArgumentError, OutOfMemoryError, BadWeightError, NotFinalizedError,
                                  BadInputError, IOError_, FormatError, UnsupportedError, TimeoutError_,
                                  CudaError, NcclError, InternalError)}


def status_string(status):
    return _lib.megamoe_status_string(_int(status, "status")).decode()


def _raise(status, message):
    cls = _ERRORS.get(status, Error)
    raise cls(f"{message} [{status_string(status)}]", status)


# ---- Arguments: every public function checks its non-tensor arguments before C sees them ------------

_INT_MIN, _INT_MAX = -2**31, 2**31 - 1


def _int(value, name, lo=_INT_MIN, hi=_INT_MAX):
    """An integer argument (int, numpy integer, anything with __index__; not bool, not float) in [lo, hi]
    (by default a C int's range), else ArgumentTypeError / InvalidArgumentError naming it."""
    if isinstance(value, bool) or not hasattr(type(value), "__index__"):
        raise ArgumentTypeError(f"{name}: expected an integer, got {type(value).__name__} {value!r}", 1)
    v = operator.index(value)
    if not lo <= v <= hi:
        raise InvalidArgumentError(f"{name}={v} is outside [{lo}, {hi}]", 1)
    return v


def _float(value, name):
    """A real-number argument (int, float, numpy scalar; not bool), as a Python float."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ArgumentTypeError(f"{name}: expected a number, got {type(value).__name__} {value!r}", 1)
    return float(value)


def _bool(value, name):
    if isinstance(value, bool) or (hasattr(type(value), "__index__") and operator.index(value) in (0, 1)):
        return bool(value)
    raise ArgumentTypeError(f"{name}: expected a bool, got {type(value).__name__} {value!r}", 1)


def _str(value, name):
    """A text argument (str without NUL), encoded as the C library reads it (UTF-8)."""
    if not isinstance(value, str):
        raise ArgumentTypeError(f"{name}: expected a str, got {type(value).__name__} {value!r}", 1)
    if "\0" in value:
        raise InvalidArgumentError(f"{name}={value!r} holds a NUL character", 1)
    return value.encode()


def _choice(value, name, choices):
    if not isinstance(value, str):
        raise ArgumentTypeError(f"{name}: expected one of {list(choices)}, got {type(value).__name__} {value!r}", 1)
    if value not in choices:
        raise InvalidArgumentError(f"{name}={value!r}: expected one of {list(choices)}", 1)
    return value


def _path(value, name):
    """A file-system path (str, bytes or os.PathLike, without NUL) as bytes for the C library."""
    if not isinstance(value, (str, bytes, os.PathLike)):
        raise ArgumentTypeError(f"{name}: expected a path (str, bytes or os.PathLike), got {type(value).__name__}", 1)
    raw = os.fsencode(os.fspath(value))
    if b"\0" in raw:
        raise InvalidArgumentError(f"{name}={os.fsdecode(raw)!r} holds a NUL character", 1)
    if not raw:
        raise InvalidArgumentError(f"{name}: the path is empty", 1)
    return raw


def _host_memory_available():
    """Bytes this process may still allocate on the host: /proc/meminfo's MemAvailable, lowered to
    what the cgroup (v2 or v1) memory limit leaves; None where neither can be read (not Linux)."""
    avail = None
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    avail = int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    for limit_file, usage_file in (("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),
                                   ("/sys/fs/cgroup/memory/memory.limit_in_bytes",
                                    "/sys/fs/cgroup/memory/memory.usage_in_bytes")):
        try:
            with open(limit_file) as f:
                limit = f.read().strip()
            with open(usage_file) as f:
                usage = int(f.read().strip())
        except (OSError, ValueError):
            continue
        if limit.isdigit() and int(limit) < 2**60:
            left = max(int(limit) - usage, 0)
            avail = left if avail is None else min(avail, left)
        break
    return avail


def _check_host_memory(nbytes, what):
    """Raises OutOfMemoryError before an allocation of nbytes of host memory that cannot be had."""
    avail = _host_memory_available()
    if avail is not None and nbytes > avail:
        raise OutOfMemoryError(
            f"{what} needs {nbytes / 2**30:.2f} GiB of host memory, {avail / 2**30:.2f} GiB is available", 2)


def _no_pickle(obj):
    raise TypeError(
        f"cannot pickle {type(obj).__module__}.{type(obj).__qualname__}: it holds native state (a handle of the "
        "C library, its weights in the kernel layout and, on a GPU, device memory) that has no serialized form; "
        "save the weights or the checkpoint path instead and build a new one from them")


def backend_available(backend):
    """Whether this build and machine can create a group of that backend ("cpu", "cuda", "nccl")."""
    return bool(_lib.megamoe_backend_available(_backend_code(backend)))


def _backend_code(backend):
    return _capi.BACKEND[_choice(backend, "backend", _capi.BACKEND)]


# ---- Host tensors: numpy arrays and CPU torch tensors, without importing either -------------------

_NUMPY_DTYPES = {
    "bool": "BOOL", "uint8": "U8", "int8": "I8", "int16": "I16", "uint16": "U16", "float16": "F16",
    "bfloat16": "BF16", "int32": "I32", "uint32": "U32", "float32": "F32", "float64": "F64", "int64": "I64",
    "uint64": "U64", "float8_e4m3fn": "F8_E4M3", "float8_e5m2": "F8_E5M2",
}


def _c_tensor(obj, what, dtype=None, writable=False):
    """A megamoe_tensor viewing obj's host memory; obj must stay alive while the view is used.
    dtype (a safetensors name) overrides the element type, e.g. "BF16" for uint16 bf16 patterns."""
    if dtype is not None and dtype not in _capi.DTYPE:
        raise InvalidArgumentError(f"{what}: dtype={dtype!r}: expected one of {sorted(_capi.DTYPE)}", 1)
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
        if writable and ai["data"][1]:
            raise InvalidArgumentError(f"{what}: the array is read-only", 1)
        name = getattr(getattr(obj, "dtype", None), "name", None) or ai["typestr"]
        shape, ptr = tuple(ai["shape"]), ai["data"][0]
    else:
        raise ArgumentTypeError(f"{what}: expected a numpy array or a CPU torch tensor, got {type(obj).__name__}", 1)
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


# ---- NCCL communicators ------------------------------------------------------------------------------


_PRIVATE = object()


class NcclComm:
    """An ncclComm_t for Group("nccl", nccl_comm=...). megamoe.torch.nccl_comm_from_process_group makes
    one (the package then owns the communicator). A communicator made elsewhere (vLLM's PyNccl, a
    C++ extension) is wrapped with NcclComm.unsafe_from_address(address): nothing can check an address,
    and one that is not a live communicator crashes the process in the first NCCL call. A bare int is
    not accepted anywhere, so that no wrong number reaches NCCL by accident."""

    __slots__ = ("address", "__weakref__")

    def __init__(self, address, _token=None):
        if _token is not _PRIVATE:
            raise ArgumentTypeError(
                "megamoe.NcclComm: made by megamoe.torch.nccl_comm_from_process_group(), or wrap a communicator "
                "you own with megamoe.NcclComm.unsafe_from_address(address)", 1)
        self.address = address

    @classmethod
    def unsafe_from_address(cls, address):
        """Wraps the address of a live ncclComm_t (an int, or a ctypes c_void_p). The caller vouches for
        it: megamoe cannot check it, and a wrong one crashes the process."""
        if isinstance(address, ctypes.c_void_p):
            address = address.value or 0
        return cls(_int(address, "address", 1, 2**64 - 1), _PRIVATE)

    def __repr__(self):
        return f"megamoe.NcclComm({self.address:#x})"

    def __reduce__(self):
        _no_pickle(self)


# ---- Group ---------------------------------------------------------------------------------------


class Group:
    """An expert-parallel group (megamoe_group). backend: "cpu" (num_ranks ranks in this process, on
    the host), "cuda" (num_ranks ranks sharing one GPU, `device`), "nccl" (this process is one rank of
    the communicator `nccl_comm`, a megamoe.NcclComm). Layers of one shape in a group share one
    communication buffer. close() (or garbage collection) closes the group's layers first.

    Threads (docs/PYTHON.md): every C call on the group or one of its layers holds the group's lock,
    so calls from several threads run one at a time and each gets its own result (its layers share
    the buffer, SPEC §7). An "nccl" group's forwards are collective, and the order in which two
    threads would take the lock is not the same on every rank: a forward that finds another thread's
    forward running on the same NCCL group raises InvalidArgumentError instead of waiting."""

    def __init__(self, backend="cpu", num_ranks=1, device=0, nccl_comm=None, num_threads=0):
        code = _backend_code(backend)
        cfg = _capi.GroupConfig()
        _lib.megamoe_group_config_init(ctypes.byref(cfg))
        cfg.backend = code
        cfg.num_ranks = _int(num_ranks, "num_ranks")
        cfg.device = _int(device, "device")
        cfg.num_threads = _int(num_threads, "num_threads")
        if backend == "nccl":
            if not isinstance(nccl_comm, NcclComm):
                raise ArgumentTypeError(
                    f"nccl_comm: the 'nccl' backend needs a megamoe.NcclComm (megamoe.torch.nccl_comm_from_process_group"
                    f"(), or megamoe.NcclComm.unsafe_from_address(address) for a communicator you own), got "
                    f"{type(nccl_comm).__name__}: a bare address cannot be checked, and a wrong one crashes the process", 1)
            _capi.check_nccl_version()
            cfg.nccl_comm = nccl_comm.address
        elif nccl_comm is not None:
            raise InvalidArgumentError(f"nccl_comm: only the 'nccl' backend takes a communicator, not {backend!r}", 1)
        self.backend = backend
        self.device = cfg.device
        self._comm = nccl_comm  # the communicator outlives the group
        self._handle = None
        # Each open layer's handle, in a one-element list the layer shares: the group destroys the
        # layers it still has before itself, in whatever order garbage collection finalizes them.
        self._layer_cells = {}
        # Held around every C call on the group and its layers (see the class docstring). Reentrant:
        # a layer finalized by garbage collection inside a locked region closes without deadlock.
        self._lock = threading.RLock()
        self._exclusive = backend == "nccl"
        self._deferred = []  # handles whose destroy found the lock taken (closed at the next locked call)
        # megamoe.torch: the CUDA stream of the group's last forward, and whether it was capturing a graph
        self._last_stream, self._last_stream_obj, self._last_capturing = None, None, False
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

    def _acquire(self, what):
        """Takes the group's lock for a C call (see the class docstring)."""
        if not self._lock.acquire(not self._exclusive):
            raise InvalidArgumentError(
                f"{what}: another thread is running a call on this NCCL group; its forwards are collective, so "
                "one thread per rank must make them, in the same order on every rank", 1)

    def _release(self):
        deferred, self._deferred = self._deferred, []
        for h in deferred:
            _lib.megamoe_layer_destroy(h)
        self._lock.release()

    @property
    def world_size(self):
        return _lib.megamoe_group_world_size(self._h())

    @property
    def local_ranks(self):
        return _lib.megamoe_group_local_ranks(self._h())

    def rank(self, local_rank=0):
        local_rank = _int(local_rank, "local_rank")
        if not 0 <= local_rank < self.local_ranks:
            raise InvalidArgumentError(f"local_rank={local_rank} is outside [0, {self.local_ranks})", 1)
        return _lib.megamoe_group_rank(self._h(), local_rank)

    def buffer_bytes(self, num_experts, max_tokens, top_k, hidden_size, intermediate_size):
        args = [_int(v, n) for v, n in ((num_experts, "num_experts"), (max_tokens, "max_tokens"), (top_k, "top_k"),
                                        (hidden_size, "hidden_size"), (intermediate_size, "intermediate_size"))]
        out = ctypes.c_uint64()
        self._acquire("buffer_bytes")
        try:
            st = _lib.megamoe_group_buffer_bytes(self._h(), *args, ctypes.byref(out))
            msg = _lib.megamoe_group_last_error(self._handle).decode() if st else ""
        finally:
            self._release()
        if st != _capi.OK:
            _raise(st, msg)
        return out.value

    def close(self):
        """Closes every layer of the group, then the group. Idempotent."""
        if self._handle is None:
            return
        with self._lock:
            if self._handle is None:
                return
            cells = list(self._layer_cells.values())
            self._layer_cells.clear()
            for cell in cells:
                if cell[0] is not None:
                    _lib.megamoe_layer_destroy(cell[0])
                    cell[0] = None
            for h in self._deferred:
                _lib.megamoe_layer_destroy(h)
            self._deferred = []
            _lib.megamoe_group_destroy(self._handle)
            self._handle = None

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass

    def __reduce__(self):
        _no_pickle(self)

    def __repr__(self):
        state = "closed" if self.closed else f"world_size={self.world_size}, local_ranks={self.local_ranks}"
        return f"megamoe.Group({self.backend!r}, device={self.device}, {state})"


# ---- Layer ---------------------------------------------------------------------------------------


def _weight_bytes(fmt, experts, hidden_size, intermediate_size):
    """Host bytes of the checkpoint-layout weights of `experts` experts (what the C library holds until
    finalize, and the torch module's parameters)."""
    H, I = hidden_size, intermediate_size
    if fmt == "bf16":
        return experts * 3 * H * I * 2
    return experts * (3 * H * I // 2 + 3 * H * I // 16 + 6 * 4)


class Layer:
    """One MoE experts layer (megamoe_layer) of a Group. Holds its group, so the group outlives it
    unless closed explicitly (then the layer raises ClosedError). Sizes follow SPEC §1: E % R == 0,
    H multiple of 256, I multiple of 64, 1 <= K <= 32, 1 <= max_tokens. A failing call raises and
    leaves the layer as it was (SPEC §5)."""

    def __init__(self, group, *, num_experts, top_k, hidden_size, intermediate_size, max_tokens, format="nvfp4",
                 name="", norm_eps=1e-6, norm_zero_centered=False, norm_gain_center=1.0, activation_clamp=0.0,
                 timeout_ms=None, gemm_kernel=0, activations=None):
        if not isinstance(group, Group):
            raise ArgumentTypeError(f"group: expected a megamoe.Group, got {type(group).__name__}", 1)
        format = _choice(format, "format", _capi.FORMAT)
        self._name_bytes = _str(name, "name")
        cfg = _capi.LayerConfig()
        _lib.megamoe_layer_config_init(ctypes.byref(cfg))
        if activations is not None:
            cfg.activations = _capi.ACTIVATIONS[_choice(activations, "activations", _capi.ACTIVATIONS)]
        self.activations = {v: k for k, v in _capi.ACTIVATIONS.items()}[cfg.activations]
        cfg.name = self._name_bytes
        cfg.num_experts = _int(num_experts, "num_experts")
        cfg.top_k = _int(top_k, "top_k")
        cfg.hidden_size = _int(hidden_size, "hidden_size")
        cfg.intermediate_size = _int(intermediate_size, "intermediate_size")
        cfg.max_tokens = _int(max_tokens, "max_tokens")
        cfg.format = _capi.FORMAT[format]
        cfg.norm_eps = _float(norm_eps, "norm_eps")
        cfg.norm_zero_centered = int(_bool(norm_zero_centered, "norm_zero_centered"))
        cfg.norm_gain_center = _float(norm_gain_center, "norm_gain_center")
        cfg.activation_clamp = _float(activation_clamp, "activation_clamp")
        if timeout_ms is not None:
            cfg.timeout_ms = _int(timeout_ms, "timeout_ms")
        cfg.gemm_kernel = _int(gemm_kernel, "gemm_kernel")
        self.group = group
        self.name = name
        self.format = format
        self.num_experts, self.top_k = cfg.num_experts, cfg.top_k
        self.hidden_size, self.intermediate_size, self.max_tokens = cfg.hidden_size, cfg.intermediate_size, cfg.max_tokens
        self.norm_eps, self.norm_zero_centered, self.norm_gain_center = cfg.norm_eps, bool(cfg.norm_zero_centered), \
            cfg.norm_gain_center
        self._cell = [None]
        self._finalized = False
        self._bad_ids_hint = None  # megamoe.torch: explains ids that check() finds out of range
        self._check_memory(group, cfg)
        h = ctypes.c_void_p()
        group._acquire(f"layer {name!r}")
        try:
            st = _lib.megamoe_layer_create(group._h(), ctypes.byref(cfg), ctypes.byref(h))
            if st != _capi.OK:
                msg = _lib.megamoe_layer_last_error(h).decode() if h.value else "out of memory"
                _lib.megamoe_layer_destroy(h)
            else:
                self._cell[0] = h
                group._layer_cells[id(self._cell)] = self._cell
        finally:
            group._release()
        if st != _capi.OK:
            _raise(st, msg)

    def _check_memory(self, group, cfg):
        """Host memory the layer will need, where its sizes are valid (the C library names the rule
        otherwise): the checkpoint-layout weights of its local experts and, on the CPU, the buffer."""
        try:
            world, local = group.world_size, group.local_ranks
            ok = (world > 0 and cfg.num_experts % world == 0 and cfg.hidden_size > 0 and cfg.intermediate_size > 0
                  and cfg.max_tokens > 0 and 0 < cfg.top_k <= 32)
            if not ok:
                return
            need = _weight_bytes(self.format, cfg.num_experts // world * local, cfg.hidden_size,
                                 cfg.intermediate_size)
            if group.backend == "cpu":
                need += group.buffer_bytes(cfg.num_experts, cfg.max_tokens, cfg.top_k, cfg.hidden_size,
                                           cfg.intermediate_size)
        except InvalidArgumentError:
            return
        _check_host_memory(need, f"layer {self.name!r} (E={cfg.num_experts}, H={cfg.hidden_size}, "
                                 f"I={cfg.intermediate_size}, T_max={cfg.max_tokens}, {self.format})")

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

    def _call(self, fn, *args):
        """fn(handle, *args) under the group's lock; raises the status's class with the layer's message
        (read under the same lock, so another thread's call cannot replace it)."""
        g = self.group
        g._acquire(f"layer {self.name!r}")
        try:
            st = fn(self._h(), *args)
            msg = _lib.megamoe_layer_last_error(self._handle).decode() if st else ""
        finally:
            g._release()
        if st != _capi.OK:
            _raise(st, msg)

    def _check(self, st):
        if st != _capi.OK:
            _raise(st, self.last_error())

    def last_error(self):
        with self.group._lock:
            return _lib.megamoe_layer_last_error(self._h()).decode()

    # -- weights
    def load_weight(self, name, tensor, dtype=None):
        """One stacked weight of all E experts ([E, ...], host memory); see megamoe_layer_load_weight."""
        name_b = _str(name, "name")
        t = _c_tensor(tensor, f"{self.name}: {name}", dtype)
        self._call(_lib.megamoe_layer_load_weight, name_b, ctypes.byref(t))

    def load_expert_weight(self, expert, proj, field, tensor, dtype=None):
        """One field ("weight", "weight_scale", "weight_scale_2", "input_scale") of one projection
        ("gate", "up", "down") of one global expert."""
        expert = _int(expert, "expert")
        proj = _choice(proj, "proj", _capi.PROJ)
        field = _choice(field, "field", _capi.FIELD)
        t = _c_tensor(tensor, f"{self.name}: expert {expert} {proj} {field}", dtype)
        self._call(_lib.megamoe_layer_load_expert_weight, expert, _capi.PROJ[proj], _capi.FIELD[field],
                   ctypes.byref(t))

    def load_norm_weight(self, tensor, dtype=None):
        t = _c_tensor(tensor, f"{self.name}: post_expert_norm.weight", dtype)
        self._call(_lib.megamoe_layer_load_norm_weight, ctypes.byref(t))

    def load_checkpoint(self, checkpoint, prefix=""):
        """Every expert weight (and the norm weight, if any) of `prefix` from a Checkpoint or a path."""
        prefix_b = _str(prefix, "prefix")
        own = not isinstance(checkpoint, Checkpoint)
        ck = Checkpoint(checkpoint, _what="checkpoint") if own else checkpoint
        try:
            with ck._lock:  # the checkpoint's own message is written by the loader too
                self._call(_lib.megamoe_layer_load_checkpoint, ck._h(), prefix_b, _capi.ProgressFn(), None)
        finally:
            if own:
                ck.close()

    def finalize(self):
        """Repacks the weights into the kernel layout and frees the checkpoint-layout copies. Idempotent."""
        self._call(_lib.megamoe_layer_finalize)
        self._finalized = True

    def memory(self):
        """Bytes: weight (resident), checkpoint (still held), finalize_peak, buffer (per rank), workspace."""
        info = _capi.MemoryInfo()
        self._call(_lib.megamoe_layer_memory, ctypes.byref(info))
        return {"weight_bytes": info.weight_bytes, "checkpoint_bytes": info.checkpoint_bytes,
                "finalize_peak_bytes": info.finalize_peak_bytes, "buffer_bytes": info.buffer_bytes,
                "workspace_bytes": info.workspace_bytes}

    # -- forward
    def forward(self, inputs):
        """A forward on host arrays (numpy, or CPU torch tensors) of a host backend ("cpu"): `inputs`
        holds one (x [T, H] bf16, topk_ids [T, K] int32, topk_weights [T, K] float32, is_padding [T]
        bool/uint8 or None, y [T, H] bf16, written) per local rank. Every array is checked (dtype,
        shape, contiguity, y writable) before the C library reads it."""
        if self.group.backend != "cpu":
            raise UnsupportedError(f"layer {self.name!r}: Layer.forward takes host arrays, a {self.group.backend!r} "
                                   "layer runs on a GPU: use megamoe.torch", 8)
        rows = self._forward_rows(inputs, 5)
        H, K = self.hidden_size, self.top_k
        args, keep = [], []
        for r, (x, ids, w, pad, y) in enumerate(rows):
            tx = _c_tensor(x, f"inputs[{r}] x")
            T = tx.shape[0] if tx.ndim else -1
            want = [(tx, "x", "BF16", (T, H)), (_c_tensor(ids, f"inputs[{r}] topk_ids"), "topk_ids", "I32", (T, K)),
                    (_c_tensor(w, f"inputs[{r}] topk_weights"), "topk_weights", "F32", (T, K)),
                    (_c_tensor(y, f"inputs[{r}] y", writable=True), "y", "BF16", (T, H))]
            if pad is not None:
                want.append((_c_tensor(pad, f"inputs[{r}] is_padding"), "is_padding", ("BOOL", "U8"), (T,)))
            for t, what, dt, shape in want:
                dts = (dt,) if isinstance(dt, str) else dt
                got = tuple(t.shape[i] for i in range(t.ndim))
                if _capi.DTYPE_NAME[t.dtype] not in dts or got != shape or T < 0:
                    raise InvalidArgumentError(
                        f"layer {self.name!r}: inputs[{r}] {what}: {_capi.DTYPE_NAME[t.dtype]} {list(got)}, expected "
                        f"{' or '.join(dts)} {list(shape)}", 1)
            _int(T, f"inputs[{r}] T", 0)
            keep.append((x, ids, w, pad, y))
            args.append((T, tx.data, want[1][0].data, want[2][0].data, want[4][0].data if pad is not None else 0,
                         want[3][0].data))
        self._forward_args(args, None)

    def _forward_rows(self, rows, width):
        if isinstance(rows, (str, bytes)) or not hasattr(rows, "__len__"):
            raise ArgumentTypeError(f"layer {self.name!r}: expected a list of one tuple per local rank, got "
                                    f"{type(rows).__name__}", 1)
        n = self.group.local_ranks
        if len(rows) != n:
            raise InvalidArgumentError(f"layer {self.name!r}: {len(rows)} entries, expected one per local rank ({n})", 1)
        out = []
        for r, row in enumerate(rows):
            if not isinstance(row, (tuple, list)) or len(row) != width:
                raise ArgumentTypeError(f"layer {self.name!r}: entry {r}: expected a tuple of {width}, got {row!r}", 1)
            out.append(tuple(row))
        return out

    def forward_ptrs(self, args, stream=0):
        """Runs megamoe_layer_forward on raw addresses: `args` holds one (num_tokens, x, topk_ids,
        topk_weights, is_padding or 0, y) tuple of integers per local rank; `stream` a cudaStream_t
        address (0: the default stream). The count and the integers are checked; the addresses cannot
        be: like ctypes, a wrong one crashes the process. Layer.forward (host arrays) and megamoe.torch
        (tensors) check what they pass."""
        rows = self._forward_rows(args, 6)
        where = f"layer {self.name!r}: args"
        checked = [(_int(a[0], f"{where}[{r}] num_tokens", 0),) + tuple(
            _int(v, f"{where}[{r}][{i + 1}]", 0, 2**64 - 1) for i, v in enumerate(a[1:])) for r, a in enumerate(rows)]
        self._forward_args(checked, _int(stream, f"layer {self.name!r}: stream", 0, 2**64 - 1) or None)

    def _forward_args(self, rows, stream):
        arr = (_capi.ForwardArgs * len(rows))()
        for i, a in enumerate(rows):
            arr[i].num_tokens, arr[i].x, arr[i].topk_ids, arr[i].topk_weights, arr[i].is_padding, arr[i].y = a
        self._call(_lib.megamoe_layer_forward, arr, stream)

    def check(self):
        """Waits for the last forward and raises BadInputError if its device kernels found expert ids
        outside [-1, E) (the CPU backend raises those from the forward itself)."""
        try:
            self._call(_lib.megamoe_layer_check)
        except BadInputError as e:
            try:
                hint = self._bad_ids_hint() if self._bad_ids_hint is not None else None
            except Exception:  # (the hint is an explanation; the error stands without it)
                hint = None
            if hint:
                raise BadInputError(f"{e} ({hint})", 5) from None
            raise

    def close(self):
        cell = getattr(self, "_cell", None)
        if cell is None:
            return
        g = self.group
        if not g._lock.acquire(False):  # another thread's call: destroyed when it releases the lock
            h, cell[0] = cell[0], None
            g._layer_cells.pop(id(cell), None)
            if h is not None:
                g._deferred.append(h)
            return
        try:
            g._layer_cells.pop(id(cell), None)
            h, cell[0] = cell[0], None
            if h is not None:
                _lib.megamoe_layer_destroy(h)
        finally:
            g._lock.release()

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass

    def __reduce__(self):
        _no_pickle(self)

    def __repr__(self):
        return (f"megamoe.Layer({self.name!r}, E={self.num_experts}, K={self.top_k}, H={self.hidden_size}, "
                f"I={self.intermediate_size}, T_max={self.max_tokens}, {self.format}, activations={self.activations}"
                f"{', closed' if self.closed else ''})")


# ---- Checkpoint ----------------------------------------------------------------------------------


class Checkpoint:
    """A safetensors file, or a folder with model.safetensors.index.json, memory-mapped. path: str,
    bytes or os.PathLike. Its calls hold its own lock (its message is per handle)."""

    def __init__(self, path, _what="path"):
        raw = _path(path, _what)
        self.path = os.fsdecode(raw)
        self._handle = None
        self._lock = threading.RLock()
        h = ctypes.c_void_p()
        st = _lib.megamoe_checkpoint_open(raw, ctypes.byref(h))
        if st != _capi.OK:
            msg = _lib.megamoe_checkpoint_last_error(h).decode() if h.value else "out of memory"
            _lib.megamoe_checkpoint_close(h)
            _raise(st, msg)
        self._handle = h

    def _h(self):
        if self._handle is None:
            raise ClosedError(f"checkpoint {self.path!r} is closed", 1)
        return self._handle

    def _fail(self, st):
        _raise(st, _lib.megamoe_checkpoint_last_error(self._handle).decode())

    def layers(self):
        """The MoE layers the checkpoint holds: a list of dicts (prefix, format, naming, num_experts,
        hidden_size, intermediate_size, has_norm, bytes)."""
        with self._lock:
            n = ctypes.c_int()
            st = _lib.megamoe_checkpoint_find_layers(self._h(), None, 0, ctypes.byref(n))
            if st != _capi.OK:
                self._fail(st)
            infos = (_capi.LayerInfo * max(n.value, 1))()
            st = _lib.megamoe_checkpoint_find_layers(self._h(), infos, n.value, ctypes.byref(n))
            if st != _capi.OK:
                self._fail(st)
            return [_layer_info(infos[i]) for i in range(n.value)]

    def describe(self, prefix=""):
        prefix_b = _str(prefix, "prefix")
        info = _capi.LayerInfo()
        with self._lock:
            st = _lib.megamoe_checkpoint_describe_layer(self._h(), prefix_b, ctypes.byref(info))
            if st != _capi.OK:
                self._fail(st)
        return _layer_info(info)

    def names(self):
        """Every tensor's name, sorted."""
        with self._lock:
            h = self._h()
            out, name = [], ctypes.c_char_p()
            for i in range(_lib.megamoe_checkpoint_num_tensors(h)):
                t = _capi.Tensor()
                st = _lib.megamoe_checkpoint_tensor(h, i, ctypes.byref(name), ctypes.byref(t))
                if st != _capi.OK:
                    self._fail(st)
                out.append(name.value.decode())
            return out

    def read(self, name):
        """(dtype name as safetensors spells it, shape, bytes) of one tensor, copied out of the mapping."""
        name_b = _str(name, "name")
        t = _capi.Tensor()
        with self._lock:
            st = _lib.megamoe_checkpoint_find(self._h(), name_b, ctypes.byref(t))
            if st != _capi.OK:
                self._fail(st)
            shape = tuple(t.shape[i] for i in range(t.ndim))
            n = _lib.megamoe_dtype_size(t.dtype)
            for d in shape:
                n *= d
            data = ctypes.string_at(t.data, n) if n else b""
        return _capi.DTYPE_NAME[t.dtype], shape, data

    def close(self):
        with self._lock:
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

    def __reduce__(self):
        _no_pickle(self)


def _layer_info(i):
    return {"prefix": i.prefix.decode(), "format": "nvfp4" if i.format == 0 else "bf16",
            "naming": _capi.NAMING.get(i.naming, str(i.naming)), "num_experts": i.num_experts,
            "hidden_size": i.hidden_size, "intermediate_size": i.intermediate_size, "has_norm": bool(i.has_norm),
            "bytes": i.bytes}


# ---- Files ---------------------------------------------------------------------------------------


def save_safetensors(path, tensors):
    """Writes {name: numpy array or CPU torch tensor} to a safetensors file (megamoe_safetensors_write)."""
    raw = _path(path, "path")
    if not hasattr(tensors, "items"):
        raise ArgumentTypeError(f"tensors: expected a mapping of name to array, got {type(tensors).__name__}", 1)
    items = list(tensors.items())
    arr = (_capi.NamedTensor * max(len(items), 1))()
    keep = []
    for i, (name, t) in enumerate(items):
        keep.append(_str(name, "tensor name"))
        arr[i].name = keep[-1]
        arr[i].tensor = _c_tensor(t, name)
        keep.append(t)
    err = ctypes.create_string_buffer(512)
    st = _lib.megamoe_safetensors_write(raw, arr, len(items), err, len(err))
    if st != _capi.OK:
        _raise(st, err.value.decode())


def quantize_checkpoint(in_path, out_path, calib_tokens=None, calib_seed=None, activation_clamp=None):
    """BF16 expert weights of a checkpoint -> NVFP4 in the per-expert naming (what `megamoe quantize`
    does; megamoe_quantize_checkpoint): a file in, a file out; a folder in, a folder out."""
    in_raw, out_raw = _path(in_path, "in_path"), _path(out_path, "out_path")
    opt = _capi.QuantizeOptions()
    _lib.megamoe_quantize_options_init(ctypes.byref(opt))
    if calib_tokens is not None:
        opt.calib_tokens = _int(calib_tokens, "calib_tokens", 1)
    if calib_seed is not None:
        opt.calib_seed = _int(calib_seed, "calib_seed", 0, 2**64 - 1)
    if activation_clamp is not None:
        opt.activation_clamp = _float(activation_clamp, "activation_clamp")
    err = ctypes.create_string_buffer(512)
    st = _lib.megamoe_quantize_checkpoint(in_raw, out_raw, ctypes.byref(opt), err, len(err))
    if st != _capi.OK:
        _raise(st, err.value.decode())
