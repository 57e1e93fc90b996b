"""The torch op `torch.ops.megamoe.experts(layer_id, hidden_states, topk_weights, topk_ids, is_padding)`.

The op finds its C layer through an integer key into a registry (torch ops take tensors and plain
values, not Python objects); MegaMoEExperts registers its layer and passes the key. CPU tensors run a
CPU-backend layer; CUDA tensors a CUDA- or NCCL-backend layer, enqueued on the current CUDA stream.
Every check is on tensor metadata (no host synchronization), so the op can be captured in a CUDA graph
and traced by torch.compile (the fake implementation gives the output's shape).

The op is defined with torch.library.Library and one Python kernel for the CPU and CUDA dispatch keys,
so an eager call crosses from the dispatcher into Python once (torch.library.custom_op wraps a kernel
in several Python layers, among them an autograd one, which cost more than the C forward's host
time). The op is not differentiable: it has no autograd formula, and PyTorch's fallback for such ops
applies (backward through it warns and gives the inputs no gradient).
"""
import ctypes
import itertools
import threading

import torch

import megamoe
from megamoe import _capi

_registry = {}  # key -> megamoe.Layer
_calls = {}  # key -> the layer's forward on validated tensors (_layer_call)
_ids = itertools.count(1)
_lock = threading.Lock()


def register(layer):
    """Makes a megamoe.Layer of a one-rank group reachable from the op; returns its key."""
    if layer.group.local_ranks != 1:
        raise megamoe.InvalidArgumentError(
            f"megamoe layer {layer.name!r}: the torch op runs layers of one local rank, this group has "
            f"{layer.group.local_ranks}", 1)
    call = _layer_call(layer)
    with _lock:
        key = next(_ids)
        _registry[key] = layer
        _calls[key] = call
    return key


def unregister(key):
    """Drops the registry's reference (and closes the layer, which nothing else may use after this)."""
    with _lock:
        layer = _registry.pop(key, None)
        _calls.pop(key, None)
    if layer is not None:
        layer.close()


def eager_call(key):
    """The op's kernel for layer `key` as a plain function (MegaMoEExperts' eager path): the same checks,
    the same C call, without the dispatcher."""
    return _calls[key]


def lookup(key):
    layer = _registry.get(int(key))
    if layer is None:
        raise megamoe.ClosedError(f"megamoe.experts: no layer with id {key} (its module was deleted or closed)", 1)
    return layer


def _layer_device(layer):
    if layer.group.backend == "cpu":
        return torch.device("cpu")
    return torch.device("cuda", layer.group.device)


_BF16, _F32, _I32 = torch.bfloat16, torch.float32, torch.int32
_PAD_DTYPES = (torch.bool, torch.uint8)
_forward = _capi.lib.megamoe_layer_forward


# The output y, shaped and strided as hidden_states (which the kernel requires contiguous: its strides
# differ from [H, 1] only where T <= 1, where they do not matter), by the kernel and the fake
# implementation alike, so that both give y the same strides.
_new_y = torch.empty_like


def _layer_call(layer):
    """The layer's forward on tensors: checks what the C library cannot see (dtype, device, shape,
    contiguity, alignment of hidden_states on the GPU; in one expression, the messages built only on
    the slow path), allocates y and calls megamoe_layer_forward on a ForwardArgs the layer keeps (not
    for concurrent use from several threads, like the C layer). The C library checks the rest (a
    finalized layer, T against the layer's maximum, ids and routing weights on the CPU) and its error
    raises with the layer's message."""
    H, K = layer.hidden_size, layer.top_k
    cell = layer._cell  # [handle]; None once the layer or its group is closed
    on_cuda = layer.group.backend != "cpu"
    dev_index = layer.group.device if on_cuda else -1  # Tensor.get_device(): -1 on the CPU
    align = 15 if on_cuda else 0
    args = _capi.ForwardArgs()
    args_ref = ctypes.byref(args)
    raw_stream = torch._C._cuda_getCurrentRawStream if on_cuda else None

    def call(x, w, ids, pad):
        xp = x.data_ptr()
        try:
            T, h = x.shape
            ok = (x.dtype is _BF16 and w.dtype is _F32 and ids.dtype is _I32 and h == H
                  and w.shape == ids.shape == (T, K)
                  and x.get_device() == w.get_device() == ids.get_device() == dev_index
                  and x.is_contiguous() and w.is_contiguous() and ids.is_contiguous()
                  and (T == 0 or not (xp & align))
                  and (pad is None or (pad.dtype in _PAD_DTYPES and pad.shape == (T,) and pad.get_device() == dev_index
                                       and pad.is_contiguous()))
                  and cell[0] is not None)
        except (AttributeError, TypeError, ValueError):
            ok = False
        if not ok:
            _validate_slow(layer, x, w, ids, pad)
            T = x.shape[0]
        y = _new_y(x)
        args.num_tokens, args.x, args.topk_ids, args.topk_weights, args.y = T, xp, ids.data_ptr(), w.data_ptr(), \
            y.data_ptr()
        args.is_padding = pad.data_ptr() if pad is not None else None
        st = _forward(cell[0], args_ref, raw_stream(dev_index) if on_cuda else None)
        if st:
            layer._check(st)
        return y

    return call


def _check_tensor(layer, what, t, dtypes, shape, device):
    where = f"megamoe layer {layer.name!r}: {what}"
    if not isinstance(t, torch.Tensor):
        raise megamoe.InvalidArgumentError(f"{where}: expected a tensor, got {type(t).__name__}", 1)
    if t.dtype not in dtypes:
        names = " or ".join(str(d).replace("torch.", "") for d in dtypes)
        raise megamoe.InvalidArgumentError(f"{where}: dtype {str(t.dtype).replace('torch.', '')}, expected {names}", 1)
    if t.device != device:
        raise megamoe.InvalidArgumentError(f"{where}: on device {t.device}, the layer runs on {device}", 1)
    if tuple(t.shape) != shape:
        raise megamoe.InvalidArgumentError(f"{where}: shape {tuple(t.shape)}, expected {shape}", 1)
    if not t.is_contiguous():
        raise megamoe.InvalidArgumentError(
            f"{where}: not contiguous (strides {tuple(t.stride())}); pass .contiguous()", 1)


def _validate_slow(layer, hidden_states, topk_weights, topk_ids, is_padding):
    """Raises megamoe.InvalidArgumentError (or ClosedError) naming the argument and value that the fast
    check of _layer_call refused."""
    if layer.closed:
        layer._h()  # raises ClosedError with the reason
    device = _layer_device(layer)
    if not isinstance(hidden_states, torch.Tensor) or hidden_states.dim() != 2:
        got = tuple(hidden_states.shape) if isinstance(hidden_states, torch.Tensor) else type(hidden_states).__name__
        raise megamoe.InvalidArgumentError(
            f"megamoe layer {layer.name!r}: hidden_states {got}, expected [T, {layer.hidden_size}]", 1)
    T, H, K = hidden_states.shape[0], layer.hidden_size, layer.top_k
    _check_tensor(layer, "hidden_states", hidden_states, (torch.bfloat16,), (T, H), device)
    _check_tensor(layer, "topk_weights", topk_weights, (torch.float32,), (T, K), device)
    _check_tensor(layer, "topk_ids", topk_ids, (torch.int32,), (T, K), device)
    if is_padding is not None:
        _check_tensor(layer, "is_padding", is_padding, (torch.bool, torch.uint8), (T,), device)
    if device.type == "cuda" and T > 0 and hidden_states.data_ptr() % 16:
        raise megamoe.InvalidArgumentError(
            f"megamoe layer {layer.name!r}: hidden_states at address {hidden_states.data_ptr():#x} is not 16-byte "
            "aligned", 1)


# ---- the op --------------------------------------------------------------------------------------

_lib = torch.library.Library("megamoe", "DEF")
_lib.define("experts(SymInt layer_id, Tensor hidden_states, Tensor topk_weights, Tensor topk_ids, "
            "Tensor? is_padding=None) -> Tensor")


def _experts_kernel(layer_id, hidden_states, topk_weights, topk_ids, is_padding=None):
    """y [T, H] bf16 = the experts of layer `layer_id` on hidden_states [T, H] bf16, topk_weights [T, K]
    float32, topk_ids [T, K] int32 (global expert ids, -1 = empty slot), is_padding [T] bool or None."""
    try:
        call = _calls[layer_id]
    except KeyError:
        lookup(layer_id)  # raises ClosedError
    return call(hidden_states, topk_weights, topk_ids, is_padding)


_lib.impl("experts", _experts_kernel, "CPU")
_lib.impl("experts", _experts_kernel, "CUDA")


@torch.library.register_fake("megamoe::experts", lib=_lib)
def _experts_fake(layer_id, hidden_states, topk_weights, topk_ids, is_padding=None):
    torch._check(hidden_states.dim() == 2, lambda: "megamoe.experts: hidden_states must be [T, H]")
    return _new_y(hidden_states)


experts = torch.ops.megamoe.experts
