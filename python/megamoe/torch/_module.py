"""MegaMoEExperts: the experts module inference engines expect (the interface of the PyTorch module
megamoe grew from), backed by a megamoe.Layer."""
import atexit
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


def group_for(device, process_group=None):
    """The shared megamoe.Group of a torch device (and, for expert parallelism, a process group)."""
    device = torch.device(device)
    if process_group is not None:
        if device.type != "cuda":
            raise megamoe.InvalidArgumentError(f"expert parallelism over a process group needs CUDA, got {device}", 1)
        index = torch.cuda.current_device() if device.index is None else device.index
        key = ("nccl", index, process_group)
    elif device.type == "cuda":
        index = torch.cuda.current_device() if device.index is None else device.index
        key = ("cuda", index, None)
    elif device.type == "cpu":
        key = ("cpu", 0, None)
    else:
        raise megamoe.InvalidArgumentError(f"device {device}: megamoe runs on cpu or cuda", 1)
    with _groups_lock:
        g = _groups.get(key)
        if g is None or g.closed:
            if key[0] == "nccl":
                with torch.cuda.device(key[1]):
                    comm = _dist.nccl_comm_from_process_group(process_group)
                g = megamoe.Group("nccl", num_ranks=1, device=key[1], nccl_comm=comm)
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
_I64, _HALF_DTYPES = torch.int64, (torch.bfloat16, torch.float16)


def _default_device():
    get = getattr(torch, "get_default_device", None)
    return get() if get else torch.device("cpu")


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
        self.num_experts = num_experts
        self.num_local_experts = num_local_experts
        self.experts_start_idx = experts_start_idx
        self.experts_end_idx = experts_start_idx + num_local_experts
        self.top_k = top_k
        self.hidden_size = hidden_size
        self.intermediate_size = intermediate_size
        self.max_num_tokens = num_max_tokens_per_rank
        self.post_expert_norm = post_expert_norm
        self.is_nvfp4 = is_nvfp4
        self.process_group = process_group
        self.run_device = torch.device(device) if device is not None else _default_device()
        if self.run_device.type == "cuda" and self.run_device.index is None:
            self.run_device = torch.device("cuda", torch.cuda.current_device())

        group = group_for(self.run_device, process_group)
        world, rank = group.world_size, group.rank(0)
        if num_local_experts * world != num_experts or experts_start_idx != rank * num_local_experts:
            raise megamoe.InvalidArgumentError(
                f"{prefix}: num_local_experts={num_local_experts}, experts_start_idx={experts_start_idx} do not "
                f"match rank {rank} of {world} owning experts [{rank} * E/R, ...) of num_experts={num_experts}", 1)
        norm = post_expert_norm
        self._layer = megamoe.Layer(
            group, name=prefix, num_experts=num_experts, top_k=top_k, hidden_size=hidden_size,
            intermediate_size=intermediate_size, max_tokens=num_max_tokens_per_rank,
            format="nvfp4" if is_nvfp4 else "bf16",
            norm_eps=float(getattr(norm, "variance_epsilon", 1e-6)) if norm is not None else 1e-6,
            norm_zero_centered=bool(getattr(norm, "zero_centered_gamma", False)) if norm is not None else False,
            norm_gain_center=float(getattr(norm, "gain_center", 1.0)) if norm is not None else 1.0,
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

        def param(*shape, dtype):
            p = nn.Parameter(torch.zeros(shape, dtype=dtype, device="cpu"), requires_grad=False)
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

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor, weight_name: str, **kwargs) -> None:
        """Copies this rank's experts [experts_start_idx, experts_end_idx) of the all-expert tensor."""
        if param is None:
            raise megamoe.InvalidArgumentError(
                f"{self.prefix}: expert weight {weight_name!r} loaded after finalize_weights()", 1)
        if loaded_weight.shape[0] != self.num_experts:
            raise megamoe.BadWeightError(
                f"{self.prefix}: expert weight {weight_name!r} of shape {tuple(loaded_weight.shape)} does not hold "
                f"all {self.num_experts} experts in its first dimension", 3)
        shard = loaded_weight[self.experts_start_idx:self.experts_end_idx]
        if shard.shape != param.data.shape and shard.dim() == param.dim() + 1 and shard.shape[-1] == 1:
            shard = shard.squeeze(-1)  # per-expert scalars stored as [E, 1] (SPEC §6)
        if shard.shape != param.data.shape:
            raise megamoe.BadWeightError(
                f"{self.prefix}: expert weight {weight_name!r} shard {tuple(shard.shape)} does not fit parameter "
                f"{tuple(param.data.shape)}", 3)
        param.data.copy_(shard.to(param.data.dtype))

    def load_weights(self, weights: Iterable[Tuple[str, torch.Tensor]]) -> Iterable[str]:
        """Loads (name, all-expert tensor) pairs; yields each name. Names may carry the module's prefix."""
        for name, tensor in weights:
            short = name[len(self.prefix) + 1:] if self.prefix and name.startswith(self.prefix + ".") else name
            if short not in self._param_names:
                raise megamoe.BadWeightError(
                    f"{self.prefix}: unexpected expert weight {name!r} (expected one of {list(self._param_names)})", 3)
            self.weight_loader(getattr(self, short), tensor, short)
            yield name

    def finalize_weights(self) -> None:
        """Hands the weights to the C library (which repacks them into its kernel layout and validates
        the scales, SPEC §5) and frees the checkpoint parameters (set to None). Idempotent."""
        if self._layer.finalized:
            return
        if self._param_names:
            self._hand_weights()
        norm = self.post_expert_norm
        if norm is not None and getattr(norm, "weight", None) is not None:
            self._layer.load_norm_weight(norm.weight.detach().float().cpu().contiguous())
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
                    layer.load_expert_weight(g, proj, "input_scale", host["w13_input_scale"][e, j])
                layer.load_expert_weight(g, "down", "weight_scale_2", host["w2_weight_scale_2"][e])
                layer.load_expert_weight(g, "down", "input_scale", host["w2_input_scale"][e])

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
        topk_ids [T, K] (int32, or int64: converted) global expert ids, -1 = empty slot; is_padding [T]
        bool. On CUDA, ids outside [-1, E) are reported by check() (no host sync here)."""
        if topk_ids.dtype is _I64:
            topk_ids = topk_ids.int()
        if topk_weights.dtype in _HALF_DTYPES:
            topk_weights = topk_weights.float()
        # Plain tensors in eager mode go to the op's kernel directly, past PyTorch's dispatcher (as the
        # op does, _op.plain_eager); tracing, tensor subclasses, modes and inputs that require grad take
        # the op. The C library refuses a forward of more tokens than the buffer holds, or before
        # finalize_weights(); the module's own message for these (input_buffer's) is built only then.
        if _plain_eager(hidden_states, topk_weights, topk_ids):
            try:
                return _kernel(self._layer_id, hidden_states, topk_weights, topk_ids, is_padding)
            except (megamoe.BadInputError, megamoe.NotFinalizedError):  # the C library's refusals
                self.input_buffer(hidden_states.shape[0])
                raise
        self.input_buffer(hidden_states.shape[0])
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
        from post_expert_norm (a module with variance_epsilon, zero_centered_gamma, gain_center) or the
        norm_* arguments; its weight from the checkpoint, if it has one."""
        with megamoe.Checkpoint(path) as ck:
            info = ck.describe(prefix)
            if post_expert_norm is None and info["has_norm"]:
                post_expert_norm = types.SimpleNamespace(weight=None, variance_epsilon=norm_eps,
                                                         zero_centered_gamma=norm_zero_centered,
                                                         gain_center=norm_gain_center)
            dev = torch.device(device) if device is not None else _default_device()
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
        m._layer.finalize()
        return m
