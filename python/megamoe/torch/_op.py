"""The torch op `torch.ops.megamoe.experts(layer_id, hidden_states, topk_weights, topk_ids, is_padding)`.

The op finds its C layer through an integer key into a registry (torch ops take tensors and plain
values, not Python objects); MegaMoEExperts registers its layer and passes the key. CPU tensors run a
CPU-backend layer; CUDA tensors a CUDA- or NCCL-backend layer, enqueued on the current CUDA stream.
Every check is on tensor metadata (no host synchronization), so the op can be captured in a CUDA graph
and traced by torch.compile (the fake implementation gives the output's shape).
"""
import itertools
import threading
from typing import Optional

import torch

import megamoe

_registry = {}
_ids = itertools.count(1)
_lock = threading.Lock()


def register(layer):
    """Makes a megamoe.Layer reachable from the op; returns its key."""
    layer._torch_device = _layer_device(layer)
    with _lock:
        key = next(_ids)
        _registry[key] = layer
    return key


def unregister(key):
    """Drops the registry's reference (and closes the layer, which nothing else may use after this)."""
    with _lock:
        layer = _registry.pop(key, None)
    if layer is not None:
        layer.close()


def lookup(key):
    layer = _registry.get(int(key))
    if layer is None:
        raise megamoe.ClosedError(f"megamoe.experts: no layer with id {key} (its module was deleted or closed)", 1)
    return layer


def _layer_device(layer):
    if layer.group.backend == "cpu":
        return torch.device("cpu")
    return torch.device("cuda", layer.group.device)


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


_BF16, _F32, _I32 = torch.bfloat16, torch.float32, torch.int32


def validate(layer, hidden_states, topk_weights, topk_ids, is_padding):
    """Raises megamoe.InvalidArgumentError / BadInputError naming the argument and value. The common
    case (everything right) is one expression; the messages are built only on the slow path."""
    try:
        dev = layer._torch_device
        x, w, ids = hidden_states, topk_weights, topk_ids
        T = x.shape[0]
        if (layer._cell[0] is not None and layer.finalized and T <= layer.max_tokens and x.dim() == 2
                and x.dtype is _BF16 and w.dtype is _F32 and ids.dtype is _I32
                and x.shape[1] == layer.hidden_size and w.shape == ids.shape and w.dim() == 2
                and w.shape[0] == T and w.shape[1] == layer.top_k
                and x.device == dev and w.device == dev and ids.device == dev
                and x.is_contiguous() and w.is_contiguous() and ids.is_contiguous()
                and (is_padding is None or (is_padding.dtype in (torch.bool, torch.uint8) and is_padding.dim() == 1
                                            and is_padding.shape[0] == T and is_padding.device == dev
                                            and is_padding.is_contiguous()))
                and (dev.type == "cpu" or T == 0 or x.data_ptr() % 16 == 0)):
            return
    except (AttributeError, TypeError, IndexError):
        pass
    _validate_slow(layer, hidden_states, topk_weights, topk_ids, is_padding)


def _validate_slow(layer, hidden_states, topk_weights, topk_ids, is_padding):
    if layer.closed:
        layer._h()  # raises ClosedError with the reason
    if not layer.finalized:
        raise megamoe.NotFinalizedError(f"megamoe layer {layer.name!r}: forward before finalize", 4)
    device = _layer_device(layer)
    if not isinstance(hidden_states, torch.Tensor) or hidden_states.dim() != 2:
        got = tuple(hidden_states.shape) if isinstance(hidden_states, torch.Tensor) else type(hidden_states).__name__
        raise megamoe.InvalidArgumentError(
            f"megamoe layer {layer.name!r}: hidden_states {got}, expected [T, {layer.hidden_size}]", 1)
    T, H, K = hidden_states.shape[0], layer.hidden_size, layer.top_k
    if T > layer.max_tokens:
        raise megamoe.BadInputError(
            f"megamoe layer {layer.name!r}: {T} tokens, but the layer was created for at most {layer.max_tokens} "
            "(num_max_tokens_per_rank)", 5)
    _check_tensor(layer, "hidden_states", hidden_states, (torch.bfloat16,), (T, H), device)
    _check_tensor(layer, "topk_weights", topk_weights, (torch.float32,), (T, K), device)
    _check_tensor(layer, "topk_ids", topk_ids, (torch.int32,), (T, K), device)
    if is_padding is not None:
        _check_tensor(layer, "is_padding", is_padding, (torch.bool, torch.uint8), (T,), device)
    if device.type == "cuda" and T > 0 and hidden_states.data_ptr() % 16:
        raise megamoe.InvalidArgumentError(
            f"megamoe layer {layer.name!r}: hidden_states at address {hidden_states.data_ptr():#x} is not 16-byte "
            "aligned", 1)


@torch.library.custom_op("megamoe::experts", mutates_args=())
def experts(layer_id: int, hidden_states: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
            is_padding: Optional[torch.Tensor] = None) -> torch.Tensor:
    """y [T, H] bf16 = the experts of layer `layer_id` on hidden_states [T, H] bf16, topk_weights [T, K]
    float32, topk_ids [T, K] int32 (global expert ids, -1 = empty slot), is_padding [T] bool or None."""
    layer = lookup(layer_id)
    validate(layer, hidden_states, topk_weights, topk_ids, is_padding)
    y = torch.empty_like(hidden_states, memory_format=torch.contiguous_format)
    stream = 0
    if hidden_states.is_cuda:
        stream = torch.cuda.current_stream(hidden_states.device).cuda_stream
    pad = is_padding.data_ptr() if is_padding is not None else 0
    layer.forward1(hidden_states.shape[0], hidden_states.data_ptr(), topk_ids.data_ptr(), topk_weights.data_ptr(), pad,
                   y.data_ptr(), stream)
    return y


@experts.register_fake
def _experts_fake(layer_id, hidden_states, topk_weights, topk_ids, is_padding=None):
    torch._check(hidden_states.dim() == 2, lambda: "megamoe.experts: hidden_states must be [T, H]")
    return torch.empty_like(hidden_states, memory_format=torch.contiguous_format)
