"""The torch op `torch.ops.megamoe.experts(layer_id, hidden_states, topk_weights, topk_ids, is_padding)`.

The op finds its C layer through an integer key into a registry (torch ops take tensors and plain
values, not Python objects); MegaMoEExperts registers its layer and passes the key. CPU tensors run a
CPU-backend layer; CUDA tensors a CUDA- or NCCL-backend layer, enqueued on the current CUDA stream.
Every check is on tensor metadata (no host synchronization), so the op can be captured in a CUDA graph
and traced by torch.compile (the fake implementation gives the output's shape).

The op is defined with torch.library.Library and one Python kernel for the CPU and CUDA dispatch keys,
so a call through the dispatcher crosses into Python once (torch.library.custom_op wraps a kernel in
several Python layers, among them an autograd one, which cost more than the C forward's host time).
An eager call of torch.ops.megamoe.experts on plain tensors that nothing watches (plain_eager) runs the
kernel without the dispatcher at all, as MegaMoEExperts' forward does. The op is not differentiable:
it has no autograd formula, and PyTorch's fallback for such ops applies (backward through it warns and
gives the inputs no gradient).
"""
import ctypes
import itertools
import struct
import threading

import torch

import megamoe
from megamoe import _capi

_layers = {}  # key -> what the kernel needs of the layer (_kernel_state; the layer first)
_ids = itertools.count(1)
_lock = threading.Lock()


def register(layer):
    """Makes a megamoe.Layer of a one-rank group reachable from the op; returns its key."""
    if not isinstance(layer, megamoe.Layer):
        raise megamoe.ArgumentTypeError(f"layer: expected a megamoe.Layer, got {type(layer).__name__}", 1)
    if layer.group.local_ranks != 1:
        raise megamoe.InvalidArgumentError(
            f"megamoe layer {layer.name!r}: the torch op runs layers of one local rank, this group has "
            f"{layer.group.local_ranks}", 1)
    state = _kernel_state(layer)
    with _lock:
        key = next(_ids)
        _layers[key] = state
    return key


def unregister(key):
    """Drops the registry's reference (and closes the layer, which nothing else may use after this)."""
    with _lock:
        state = _layers.pop(key, None)
    if state is not None:
        state[0].close()


def lookup(key):
    """The megamoe.Layer of an op key; ArgumentTypeError for a key that is not an int, ClosedError for
    one that names no layer."""
    if type(key) is not int and not isinstance(key, torch.SymInt):
        if isinstance(key, bool) or not hasattr(type(key), "__index__"):
            raise megamoe.ArgumentTypeError(
                f"megamoe.experts: layer_id: expected the int key of a layer (MegaMoEExperts._layer_id), got "
                f"{type(key).__name__} {key!r}", 1)
        key = int(key)
    state = _layers.get(key) if type(key) is int else None
    if state is None:
        raise megamoe.ClosedError(f"megamoe.experts: no layer with id {key} (its module was deleted or closed)", 1)
    return state[0]


def _layer_device(layer):
    if layer.group.backend == "cpu":
        return torch.device("cpu")
    return torch.device("cuda", layer.group.device)


_BF16, _F32, _I32, _I64 = torch.bfloat16, torch.float32, torch.int32, torch.int64
_PAD_DTYPES = (torch.bool, torch.uint8)
_forward = _capi.lib.megamoe_layer_forward
_raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)

# megamoe_forward_args written in one call (num_tokens, then the five pointers, with the native sizes
# and alignment the C compiler lays the struct out with) instead of one ctypes assignment per member.
_ARGS = struct.Struct("@iPPPPP")
if _ARGS.size != ctypes.sizeof(_capi.ForwardArgs) or _capi.ForwardArgs.x.offset != _ARGS.size - 5 * ctypes.sizeof(
        ctypes.c_void_p):
    raise ImportError("megamoe.torch: megamoe_forward_args does not have the layout this package packs")
_pack = _ARGS.pack_into


def _dynamo_guards_function(name):
    """A function of torch._C._dynamo.guards (torch.compile's generated code calls these C functions on
    its hot path), or None where this torch lacks it."""
    return getattr(getattr(getattr(torch._C, "_dynamo", None), "guards", None), name, None)


def _python_size_stride(t, size, stride):
    """assert_size_stride for the contiguous strides of `size` (the only ones asked for here)."""
    if t.shape != size or not t.is_contiguous():
        raise AssertionError(f"expected size {size}, contiguous")
    return True


def _size_stride_check():
    """(tensor, size, stride) -> True, or AssertionError where the tensor has other sizes, or other
    strides in a dimension longer than 1 (contiguity, for contiguous strides). torch's C function (one
    call where the Python check reads shape and calls is_contiguous()) where it behaves so, this Python
    one otherwise. Tensors of no elements pass torch's whatever their sizes (the caller checks those)."""
    f = _dynamo_guards_function("assert_size_stride")
    t = torch.zeros(3, 2)
    try:
        good = f(t, (3, 2), (2, 1)) and f(t[:1], (1, 2), (2, 1)) and f(t[::3], (1, 2), (2, 1))
        for bad in ((t, (3, 3), (3, 1)), (t, (2, 3), (3, 1)), (t.t(), (2, 3), (3, 1)), (t.reshape(6), (3, 2), (2, 1)),
                    (t[:, :1], (3, 1), (1, 1))):
            try:
                f(*bad)
                good = False
            except AssertionError:
                pass
    except Exception:  # absent, or other arguments in this torch
        good = False
    return f if good else _python_size_stride


def _torch_empty_strided(device_type):
    device = torch.device(device_type)
    return lambda shape, strides, dtype: torch.empty_strided(shape, strides, dtype=dtype, device=device)


def _empty_strided(device_type):
    """The allocator of y: (shape, strides, dtype) -> an uninitialized tensor on the CPU or the current
    CUDA device. torch's C function (torch.empty_like and torch.empty_strided go through the dispatcher)
    where it gives what it should, torch.empty_strided otherwise."""
    f = _dynamo_guards_function(f"_empty_strided_{device_type}")
    try:
        t = f((3, 2), (2, 1), _BF16)
        good = t.shape == (3, 2) and t.stride() == (2, 1) and t.dtype is _BF16 and t.device.type == device_type
    except Exception:
        good = False
    return f if good else _torch_empty_strided(device_type)


_size_stride = _size_stride_check()
_allocators = {"cpu": _empty_strided("cpu")}  # "cuda" added with the first CUDA layer (CUDA initialized)


def _kernel_state(layer):
    """What the kernel reads of a layer per call, in one tuple: the layer, H, K, the device index (-1 on
    the CPU, as Tensor.get_device()), the cell of its handle (None once closed: the C call then
    refuses), a megamoe_forward_args the layer keeps and a reference to it (filled and read under the
    group's lock, like every C call of the group), y's allocator, y's strides, the ids' and weights'
    strides, the group and its lock (a call on an NCCL group does not wait for it: megamoe.Group)."""
    on_cuda = layer.group.backend != "cpu"
    if on_cuda and "cuda" not in _allocators:
        _allocators["cuda"] = _empty_strided("cuda")
    args = _capi.ForwardArgs()
    H, K, g = layer.hidden_size, layer.top_k, layer.group
    return (layer, H, K, g.device if on_cuda else -1, layer._cell, args, ctypes.byref(args),
            _allocators["cuda" if on_cuda else "cpu"], (H, 1), (K, 1), g, g._lock)


_last_error = _capi.lib.megamoe_layer_last_error


def experts_kernel(layer_id, hidden_states, topk_weights, topk_ids, is_padding=None):
    """y [T, H] bf16 = the experts of layer `layer_id` on hidden_states [T, H] bf16, topk_weights [T, K]
    (float32; bfloat16 and float16 converted), topk_ids [T, K] (int32; int64 and the other integer
    dtypes but uint64 range-checked and converted) global expert ids, -1 = empty slot, is_padding [T]
    bool/uint8 or None. The op's kernel, and MegaMoEExperts' eager path (called directly, past the
    dispatcher).

    The fast path (int32 ids, float32 weights) checks what the C library cannot see (dtype, device,
    shape, contiguity; one expression of tensor attributes, the messages built only on the slow path),
    allocates y (contiguous) and calls megamoe_layer_forward under the group's lock. The C library
    checks the rest (a finalized layer, T against the layer's maximum, ids and routing weights on the
    CPU, ids on the GPU through check(), 16-byte alignment of x and y on the GPU); when it refuses a
    forward, _refused raises naming the argument where the inputs show the cause, with the layer's
    message otherwise. Nothing synchronizes with the GPU."""
    x, w, ids, pad = hidden_states, topk_weights, topk_ids, is_padding
    try:
        layer, H, K, dev, cell, args, args_ref, empty, row, krow, group, glock = _layers[layer_id]
        if type(layer_id) is not int:
            raise KeyError(layer_id)
    except (KeyError, TypeError):
        lookup(layer_id)  # raises ArgumentTypeError or ClosedError
        raise  # (lookup found a layer for a key that is no int: never reached)
    try:
        T, h = x.shape
        TK = (T, K)
        ok = (x.dtype is _BF16 and w.dtype is _F32 and ids.dtype is _I32 and h == H
              and x.get_device() == w.get_device() == ids.get_device() == dev and (x.is_cuda if dev >= 0 else x.is_cpu)
              and x.is_contiguous()
              and _size_stride(w, TK, krow) and _size_stride(ids, TK, krow) and (T or w.shape == ids.shape == TK)
              and (pad is None or (pad.dtype in _PAD_DTYPES and pad.shape == (T,) and pad.get_device() == dev
                                   and pad.is_contiguous())))
    except (AttributeError, TypeError, ValueError, AssertionError):
        ok = False
    if not ok:
        # Routing as routers give it (int64 ids, half weights): converted, then the same fast check;
        # anything else takes the checks that name the argument.
        w2, ids2 = _convert_routing(layer, w, ids, pad)
        if (w2 is not w or ids2 is not ids) and _fast_ok(x, w2, ids2, pad, H, K, dev, krow):
            w, ids = w2, ids2
        elif _all_meta(x, w, ids, pad):  # shape inference on meta tensors: the fake implementation's y
            return _experts_fake(layer_id, x, w, ids, pad)
        else:
            w, ids = _validate_slow(layer, x, w, ids, pad)
        T = x.shape[0]
    y = empty((T, H), row, _BF16)
    if dev >= 0 and y.get_device() != dev:  # empty allocates on the current CUDA device
        y = torch.empty((T, H), dtype=_BF16, device=x.device)
    if not glock.acquire(not group._exclusive):
        group._acquire(f"layer {layer.name!r}")  # raises: another thread's call on an NCCL group
    try:
        stream = None
        if dev >= 0:
            stream = _raw_stream(dev)
            if stream != group._last_stream:
                _order_streams(group, stream, dev)
        _pack(args, 0, T, x.data_ptr(), ids.data_ptr(), w.data_ptr(), 0 if pad is None else pad.data_ptr(),
              y.data_ptr())
        st = _forward(cell[0], args_ref, stream)
        msg = _last_error(cell[0]).decode() if st and cell[0] else None
    finally:
        if group._deferred:
            group._release()
        else:
            glock.release()
    if st:
        _refused(layer, st, msg, x, w, ids, pad)
    return y


def _fast_ok(x, w, ids, pad, H, K, dev, krow):
    """experts_kernel's fast check, for routing it has just converted."""
    try:
        T, h = x.shape
        TK = (T, K)
        return (x.dtype is _BF16 and w.dtype is _F32 and ids.dtype is _I32 and h == H
                and x.get_device() == w.get_device() == ids.get_device() == dev
                and (x.is_cuda if dev >= 0 else x.is_cpu) and x.is_contiguous()
                and _size_stride(w, TK, krow) and _size_stride(ids, TK, krow) and (T or w.shape == ids.shape == TK)
                and (pad is None or (pad.dtype in _PAD_DTYPES and pad.shape == (T,) and pad.get_device() == dev
                                     and pad.is_contiguous())))
    except (AttributeError, TypeError, ValueError, AssertionError):
        return False


def _convert_routing(layer, w, ids, pad):
    """(topk_weights, topk_ids) as float32 and int32 where they are half-precision weights or integer
    ids of another dtype (the ids range-checked: _narrow_ids); otherwise as given."""
    try:
        if w.dtype in _HALF_DTYPES:
            w = w.float()
        if ids.dtype is not _I32 and ids.dtype in _ID_DTYPES and ids.dim() == 2:
            ids = _narrow_ids(layer, ids, pad)
    except (AttributeError, TypeError):
        pass
    return w, ids


def _order_streams(group, stream, dev):
    """Before a forward on `stream` where the group's last forward ran on another CUDA stream: the new
    stream waits for the old one (an event, no host synchronization), so that the two forwards, which
    share the group's buffer, never overlap on the GPU. Not while either stream captures a CUDA graph
    (a capture cannot wait on work outside it, and captured work does not run until a replay;
    torch.cuda.graph synchronizes the device before capturing)."""
    with torch.cuda.device(dev):
        cur = torch.cuda.current_stream()
        capturing = torch.cuda.is_current_stream_capturing()
    last = group._last_stream_obj
    if last is not None and not capturing and not group._last_capturing:
        cur.wait_stream(last)
    group._last_stream, group._last_stream_obj, group._last_capturing = stream, cur, capturing


def _all_meta(*tensors):
    return all(t is None or (isinstance(t, torch.Tensor) and t.is_meta) for t in tensors) and tensors[0] is not None


def _refused(layer, status, msg, x, w, ids, pad):
    """Raises for a forward the C library refused: ClosedError for a closed layer, the argument and
    value where the inputs show the cause (an unaligned hidden_states on the GPU), else the layer's
    message (read under the lock of the call that failed)."""
    _validate_slow(layer, x, w, ids, pad)
    megamoe._raise(status, msg if msg is not None else layer.last_error())


def _dtype_name(dt):
    return str(dt).replace("torch.", "")


def _check_tensor(layer, what, t, dtypes, shape, device):
    where = f"megamoe layer {layer.name!r}: {what}"
    if not isinstance(t, torch.Tensor):
        raise megamoe.ArgumentTypeError(f"{where}: expected a tensor, got {type(t).__name__}", 1)
    if t.dtype not in dtypes:
        names = " or ".join(_dtype_name(d) for d in dtypes)
        raise megamoe.InvalidArgumentError(f"{where}: dtype {_dtype_name(t.dtype)}, expected {names}", 1)
    if t.device != device:
        raise megamoe.InvalidArgumentError(f"{where}: on device {t.device}, the layer runs on {device}", 1)
    if tuple(t.shape) != shape:
        raise megamoe.InvalidArgumentError(f"{where}: shape {tuple(t.shape)}, expected {shape}", 1)
    if not t.is_contiguous():
        raise megamoe.InvalidArgumentError(
            f"{where}: not contiguous (strides {tuple(t.stride())}); pass .contiguous()", 1)


# Routing dtypes the op takes and converts (exactly: the ids after their range check). uint64 ids are
# refused: torch has no comparison for them, and their values past 2^63 have no int64 form.
_WEIGHT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_HALF_DTYPES = (torch.bfloat16, torch.float16)
_NARROW_ID_DTYPES = (torch.int8, torch.int16, torch.uint8)
_WIDE_ID_DTYPES = (torch.int64,) + tuple(getattr(torch, n) for n in ("uint16", "uint32") if hasattr(torch, n))
_ID_DTYPES = (torch.int32,) + _NARROW_ID_DTYPES + _WIDE_ID_DTYPES


def _check_inputs(layer, hidden_states, topk_weights, topk_ids, is_padding, device):
    """The checks of the kernel's slow path and of the fake implementation (on fake tensors): the
    argument and value named."""
    if not isinstance(hidden_states, torch.Tensor) or hidden_states.dim() != 2:
        got = tuple(hidden_states.shape) if isinstance(hidden_states, torch.Tensor) else type(hidden_states).__name__
        cls = megamoe.InvalidArgumentError if isinstance(hidden_states, torch.Tensor) else megamoe.ArgumentTypeError
        raise cls(f"megamoe layer {layer.name!r}: hidden_states {got}, expected [T, {layer.hidden_size}]", 1)
    T, H, K = hidden_states.shape[0], layer.hidden_size, layer.top_k
    _check_tensor(layer, "hidden_states", hidden_states, (torch.bfloat16,), (T, H), device)
    _check_tensor(layer, "topk_weights", topk_weights, _WEIGHT_DTYPES, (T, K), device)
    _check_tensor(layer, "topk_ids", topk_ids, _ID_DTYPES, (T, K), device)
    if is_padding is not None:
        _check_tensor(layer, "is_padding", is_padding, (torch.bool, torch.uint8), (T,), device)
    return T


def _tokens_message(layer, T):
    return (f"megamoe layer {layer.name!r}: {T} tokens, more than the {layer.max_tokens} the layer's buffer holds "
            "(max_tokens, num_max_tokens_per_rank)")


def _validate_slow(layer, hidden_states, topk_weights, topk_ids, is_padding):
    """Raises megamoe.InvalidArgumentError (or ClosedError, BadInputError) naming the argument and value
    that the fast check of experts_kernel refused; returns (topk_weights, topk_ids) converted to float32
    and int32, the ids range-checked first (on the CPU here; on the GPU by the C library's check())."""
    if layer.closed:
        layer._h()  # raises ClosedError with the reason
    device = _layer_device(layer)
    T = _check_inputs(layer, hidden_states, topk_weights, topk_ids, is_padding, device)
    if T > layer.max_tokens:
        raise megamoe.BadInputError(_tokens_message(layer, T), 5)
    if device.type == "cuda" and T > 0 and hidden_states.data_ptr() % 16:
        raise megamoe.InvalidArgumentError(
            f"megamoe layer {layer.name!r}: hidden_states at address {hidden_states.data_ptr():#x} is not 16-byte "
            "aligned", 1)
    if topk_weights.dtype is not _F32:
        topk_weights = topk_weights.float()
    if topk_ids.dtype is not _I32:
        topk_ids = _narrow_ids(layer, topk_ids, is_padding)
    return topk_weights, topk_ids


def _narrow_ids(layer, ids, pad):
    """topk_ids of another integer dtype as int32, without changing an id's meaning: on the CPU every
    id outside [-1, E) raises BadInputError here with its real value (padding tokens' ids are not
    read, SPEC §1); on the GPU (no host synchronization) ids are clamped to [-2, E], so that an id
    past int32 stays a bad id for the C library's device check, and check() names the real value
    from the ids kept here."""
    E, dt = layer.num_experts, ids.dtype
    if dt in _NARROW_ID_DTYPES:
        return ids.to(_I32)  # every value fits; the C library checks the range
    wide = ids if dt is _I64 else ids.to(_I64)
    if wide.is_cpu:
        if wide.numel():
            lo, hi = torch.aminmax(wide)
            if int(lo) < -1 or int(hi) >= E:  # the detailed look (padding tokens left out) only then
                msg = _bad_ids_message(layer, wide, pad)
                if msg:
                    raise megamoe.BadInputError(msg, 5)
        return wide.to(_I32)
    if wide.is_cuda:
        layer._bad_ids_hint = lambda: _bad_ids_message(layer, wide, pad, hint=True)  # for check()
    return wide.clamp(-2, E).to(_I32)


def _bad_ids_message(layer, wide, pad, hint=False):
    """The first id outside [-1, E) of int64 ids (padding tokens left out), named with its token, slot
    and real value; None when all are good."""
    E = layer.num_experts
    bad = (wide < -1) | (wide >= E)
    if pad is not None:
        bad &= ~pad.bool().view(-1, 1)
    if not bool(bad.any()):
        return None
    t, k = (int(v) for v in bad.nonzero()[0])
    n = int(bad.sum())
    where = "the int64 topk_ids last given to this layer" if hint else f"megamoe layer {layer.name!r}: topk_ids"
    return (f"{where}: token {t} slot {k}: expert id {int(wide[t, k])} is outside [-1, {E})"
            f"{f' ({n} bad slots)' if n > 1 else ''}")


# ---- eager calls past the dispatcher --------------------------------------------------------------

def _tls_check(name, sub=None):
    f = getattr(torch._C if sub is None else getattr(torch._C, sub, None), name, None)
    return f if f is not None else (lambda: True)  # a torch without it: never past the dispatcher


_Tensor, _grad_enabled, _is_compiling = torch.Tensor, torch.is_grad_enabled, torch.compiler.is_compiling
_dispatch_modes = _tls_check("_len_torch_dispatch_stack")  # TorchDispatchModes (FakeTensorMode, make_fx, ...)
_function_modes = _tls_check("_is_torch_function_mode_enabled")  # TorchFunctionModes
_functorch = _tls_check("_are_functorch_transforms_active")  # vmap, grad, functionalize
_profiling = _tls_check("_profiler_enabled", "_autograd")  # the profiler records ops in the dispatcher
_jit_tracing = getattr(torch._C, "_get_tracing_state", lambda: True)  # torch.jit.trace records them there


def plain_eager(hidden_states, topk_weights, topk_ids):
    """Whether a call on these tensors may run the kernel directly, past PyTorch's dispatcher (whose
    crossing into a Python kernel costs more host time than the kernel's own checks): plain tensors, no
    gradient to record, and nothing that watches the dispatcher's ops (torch.compile and export tracing,
    torch function and dispatch modes, functorch transforms, the profiler, torch.jit.trace). Everything
    else takes the op, so autograd, fake tensors and tracing see it as before."""
    return (not _is_compiling()  # first: dynamo, tracing this, takes it as a constant and reads no further
            and type(hidden_states) is _Tensor and type(topk_weights) is _Tensor and type(topk_ids) is _Tensor
            and not (_grad_enabled() and (hidden_states.requires_grad or topk_weights.requires_grad))
            and not _dispatch_modes() and not _function_modes() and not _functorch() and not _profiling()
            and _jit_tracing() is None)


def not_tensors(args):
    """Whether an argument that must be a tensor (or None, is_padding) is not one: such a call goes to
    the kernel, whose checks name the argument (the dispatcher would refuse it with its own words)."""
    return any(not isinstance(a, torch.Tensor) and (a is not None or i < 3) for i, a in enumerate(args))


# ---- the op --------------------------------------------------------------------------------------

_lib = torch.library.Library("megamoe", "DEF")
_lib.define("experts(SymInt layer_id, Tensor hidden_states, Tensor topk_weights, Tensor topk_ids, "
            "Tensor? is_padding=None) -> Tensor")
_lib.impl("experts", experts_kernel, "CPU")
_lib.impl("experts", experts_kernel, "CUDA")


@torch.library.register_fake("megamoe::experts", lib=_lib)
def _experts_fake(layer_id, hidden_states, topk_weights, topk_ids, is_padding=None):
    """y's shape and dtype, after the checks the kernel makes that tensor metadata decides (the layer,
    dtypes, shapes, devices, T against the layer's maximum), so that tracing refuses what a call would."""
    layer = lookup(layer_id)
    device = _layer_device(layer)
    if hidden_states.is_meta:  # meta tensors: shapes only, on no device
        device = hidden_states.device
    T = _check_inputs(layer, hidden_states, topk_weights, topk_ids, is_padding, device)
    if isinstance(T, int):
        if T > layer.max_tokens:
            raise megamoe.BadInputError(_tokens_message(layer, T), 5)
    else:
        torch._check_with(megamoe.BadInputError, T <= layer.max_tokens, lambda: _tokens_message(layer, T))
    return hidden_states.new_empty(hidden_states.shape, dtype=_BF16)  # contiguous [T, H], as the kernel's y


_packet_call = torch._ops.OpOverloadPacket.__call__


class _EagerPacket(torch._ops.OpOverloadPacket):
    """torch.ops.megamoe.experts: eager calls on plain tensors (plain_eager) run the op's kernel directly,
    with the same checks, C call and errors; every other call goes through PyTorch's dispatcher as an
    OpOverloadPacket's does (dynamo and export trace the op without calling this)."""

    def __call__(self, /, *args, **kwargs):
        if not kwargs and 4 <= len(args) <= 5 and (plain_eager(args[1], args[2], args[3]) or not_tensors(args[1:])):
            return experts_kernel(*args)  # (not_tensors: its checks name the argument that is no tensor)
        return _packet_call(self, *args, **kwargs)


if type(torch.ops.megamoe.experts) is torch._ops.OpOverloadPacket:
    try:
        torch.ops.megamoe.experts.__class__ = _EagerPacket
    except TypeError:  # a torch whose packet's layout forbids it: every call takes the dispatcher
        pass
experts = torch.ops.megamoe.experts
