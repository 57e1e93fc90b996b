"""megamoe's vLLM MoE methods, and where they go in vLLM (install).

Each method subclasses the vLLM method it stands in for, so that vLLM's weight loading treats it as
that method: its `create_weights` parameters, its weight loaders (they pick a branch by the method's
class name: "ModelOpt", "compressed"), its checkpoint names. A layer is served when megamoe runs on
the layer's device and has every feature the layer uses (_why_not); otherwise the instance runs vLLM's
own method, constructed as vLLM would have, and the log says why. A served layer:
  create_weights             vLLM's parameters, plus the megamoe layer (whose size rules may still
                             refuse it: then vLLM's method, with megamoe's message in the log)
  process_weights_after_loading
                             hands the loaded parameters to megamoe, which checks and repacks them
                             (finalize), then frees vLLM's copies
  apply                      the `megamoe::experts` op on vLLM's routing (no host sync: graph-safe,
                             and torch.compile traces it through the op's fake implementation)
"""
import threading

import torch

import megamoe
from megamoe.torch import _module, _op

from vllm.config import get_current_vllm_config
from vllm.model_executor.layers.fused_moe.activation import MoEActivation
from vllm.model_executor.layers.fused_moe.fused_moe_method_base import FusedMoEMethodBase
from vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method import UnquantizedFusedMoEMethod
from vllm.model_executor.layers.quantization import modelopt
from vllm.model_executor.layers.quantization.compressed_tensors.compressed_tensors_moe import (
    compressed_tensors_moe_w4a4_nvfp4 as ct_nvfp4)
from vllm.model_executor.utils import replace_parameter

from . import _ep, announce, logger

_settings = None  # megamoe.vllm.Settings, set by install
_said = set()  # (kind, decision) pairs already logged
_model_bytes = {"layers": 0, "finalized": 0, "bytes": 0}  # resident bytes, logged once per model
_log_lock = threading.Lock()


def _say_once(kind, text):
    announce()
    with _log_lock:
        if (kind, text) in _said:
            return
        _said.add((kind, text))
    logger().info("megamoe: %s MoE layers: %s", kind, text)


# ---- which layers megamoe serves -----------------------------------------------------------------

def _device(moe):
    d = torch.device(moe.device) if moe.device is not None else torch.device("cpu")
    if d.type == "cuda" and d.index is None:
        d = torch.device("cuda", torch.cuda.current_device())
    return d


def _why_not(moe, fmt, use_a16):
    """None where megamoe serves a layer of this vLLM MoE config, else the reason, in one line.
    fmt: "nvfp4" or "bf16" (the weights); use_a16: a weight-only NVFP4 checkpoint (no input scales)."""
    pc = moe.moe_parallel_config
    if pc.tp_size > 1:
        return (f"tensor-parallel experts (tp_size {pc.tp_size}): megamoe keeps whole experts per rank; "
                "--enable-expert-parallel runs them on megamoe")
    if pc.pcp_size > 1 or pc.is_sequence_parallel:
        return "context or sequence parallelism around the experts"
    if pc.enable_eplb:
        return "expert load balancing (EPLB) moves experts between ranks, megamoe's placement is fixed"
    if moe.activation != MoEActivation.SILU or not moe.is_act_and_mul:
        return f"activation {moe.activation.value!r}: megamoe computes SwiGLU (silu(gate) * up)"
    if moe.has_bias:
        return "expert biases"
    if any(v is not None for v in (moe.swiglu_limit, moe.swiglu_alpha, moe.swiglu_beta)):
        return "a clamped or scaled SwiGLU (swiglu_limit / alpha / beta)"
    if moe.is_lora_enabled:
        return "LoRA on the experts"
    if moe.num_logical_experts != moe.num_experts:
        return "redundant or fused shared experts (physical experts differ from the model's)"
    if fmt == "nvfp4" and use_a16 and _settings.activations == "nvfp4":
        return ("a weight-only NVFP4 checkpoint has no input scales, which MEGAMOE_VLLM_ACTIVATIONS=nvfp4 "
                "needs (bf16, the default, serves it)")
    device = _device(moe)
    if device.type == "cpu":
        if pc.ep_size > 1:
            return f"expert parallelism on the CPU (ep_size {pc.ep_size}): megamoe's CPU backend runs in one process"
        if fmt == "bf16" and not _settings.cpu_bf16:
            return ("BF16 on the CPU, where megamoe's backend is the reference, not a fast path "
                    "(MEGAMOE_VLLM_CPU_BF16=1 serves it)")
        return None
    if device.type != "cuda":
        return f"device {device.type}: megamoe runs on Hopper GPUs and the CPU"
    if not megamoe.backend_available("cuda"):
        return "this megamoe build has no CUDA backend"
    major, minor = torch.cuda.get_device_capability(device)
    if (major, minor) != (9, 0):
        return f"GPU sm_{major}{minor}: megamoe's kernels are for sm_90 (H100/H200)"
    if pc.ep_size > 1:
        if not megamoe.backend_available("nccl"):
            return "expert parallelism needs megamoe's NCCL backend, which this build lacks"
        placement = get_current_vllm_config().parallel_config.expert_placement_strategy
        if placement != "linear":
            return f"expert placement {placement!r}: megamoe's rank r owns experts [r*E/R, (r+1)*E/R) ('linear')"
    return None


def _max_tokens(moe):
    """Tokens one forward may carry: the scheduler's batch, times the data-parallel ranks whose tokens
    vLLM gathers before the experts."""
    cfg = get_current_vllm_config()
    return cfg.scheduler_config.max_num_batched_tokens * max(1, moe.moe_parallel_config.dp_size)


class _Experts:
    """A served layer's megamoe side: the C layer, its op key and, with expert parallelism, the mask
    of the tokens other ranks compute."""

    def __init__(self, layer_name, moe, fmt, num_local_experts, hidden_size, intermediate_size):
        pc = moe.moe_parallel_config
        device = _device(moe)
        group = None
        if pc.ep_size > 1:
            from vllm.distributed import get_ep_group
            group = get_ep_group().device_group
        # On the CPU as many threads as vLLM gives torch: vLLM's CPU worker binds its threads to cores,
        # and a second full set of OpenMP threads would fight them.
        g = _module.group_for(device, group, num_threads=torch.get_num_threads() if device.type == "cpu" else 0)
        E, R = moe.num_experts, g.world_size
        if num_local_experts * R != E:
            raise megamoe.InvalidArgumentError(
                f"{layer_name}: {num_local_experts} local experts on each of {R} ranks, the model has {E}", 1)
        self.T_max = _max_tokens(moe)
        self.layer = megamoe.Layer(
            g, name=layer_name, num_experts=E, top_k=moe.experts_per_token, hidden_size=hidden_size,
            intermediate_size=intermediate_size, max_tokens=self.T_max, format=fmt,
            activations=_settings.activations if fmt == "nvfp4" else None)
        self.key = _op.register(self.layer)
        self.on_cpu = device.type == "cpu"
        self.start = g.rank(0) * num_local_experts
        self.others = None if R == 1 else _ep.others_mask(self.T_max, R, g.rank(0), device)

    def load(self, tensors, fields):
        """Hands this rank's experts to megamoe and finalizes the layer: tensors maps a vLLM parameter's
        name to its [E_local, ...] tensor; fields lists (name, proj, field, part) as _nvfp4_fields says."""
        host = {n: t.detach().cpu().contiguous() for n, t in tensors.items()}
        E_local = next(iter(host.values())).shape[0]
        for e in range(E_local):
            for name, proj, field, part in fields:
                t = host[name][e] if part is None else host[name][e][part]
                self.layer.load_expert_weight(self.start + e, proj, field, t.contiguous())
        self.layer.finalize()

    def forward(self, x, w, ids):
        """y in x's dtype; the op takes the routing in any dtype vLLM's routers give (it converts, ids
        after their range check)."""
        xb = x if x.dtype is torch.bfloat16 else x.to(torch.bfloat16)
        pad = None if self.others is None else self.others[:x.shape[0]]
        if self.on_cpu:
            # vLLM's dummy runs route uninitialized rows, whose routing weights may be NaN. megamoe's C API
            # refuses such a forward on the CPU (SPEC §5) where vLLM's kernels give the token a NaN row: so
            # does this. On the GPU the combine multiplies by the NaN weight: a NaN row as well.
            bad = ~torch.isfinite(w).all(dim=1, keepdim=True)
            y = torch.ops.megamoe.experts(self.key, xb, w.masked_fill(bad, 0.0), ids, pad)
            y = y.masked_fill(bad, float("nan"))
        else:
            y = torch.ops.megamoe.experts(self.key, xb, w, ids, pad)
        return y if y.dtype is x.dtype else y.to(x.dtype)


# ---- the methods -----------------------------------------------------------------------------------

class _MegaMoEMethod:
    """What megamoe's three methods share. A subclass sets _mm_kind (the log's name of the layer kind),
    _mm_format and _mm_fields (which of vLLM's parameters go to which megamoe field), and calls
    _mm_init from its __init__ with a function that runs vLLM's own __init__ on the instance."""

    _mm_kind = ""
    _mm_format = ""

    def _mm_init(self, moe, vllm_init, use_a16=False):
        self._mm = None  # the _Experts of a served layer (from create_weights on)
        self._mm_vllm_init = vllm_init
        self._mm_use_a16 = use_a16
        why = _why_not(moe, self._mm_format, use_a16)
        self._mm_serving = why is None
        if why is not None:
            self._mm_fall_back(why)
        else:
            FusedMoEMethodBase.__init__(self, moe)

    def _mm_fall_back(self, why):
        self._mm_serving = False
        self._mm = None
        _say_once(self._mm_kind, f"vLLM's {type(self).__mro__[2].__name__}: {why}")
        self._mm_vllm_init()

    # -- vLLM's method contract
    @property
    def is_monolithic(self):
        return False if self._mm_serving else super().is_monolithic

    @property
    def topk_indices_dtype(self):
        return torch.int32 if self._mm_serving else super().topk_indices_dtype

    @property
    def supports_eplb(self):
        return False if self._mm_serving else super().supports_eplb

    def maybe_roundup_sizes(self, hidden_size, intermediate_size_per_partition, act_dtype, moe_parallel_config):
        if self._mm_serving:  # megamoe pads for its kernels itself (SPEC §1); vLLM's sizes stay the model's
            return hidden_size, intermediate_size_per_partition
        return super().maybe_roundup_sizes(hidden_size, intermediate_size_per_partition, act_dtype,
                                           moe_parallel_config)

    def create_weights(self, layer, num_experts, hidden_size, intermediate_size_per_partition, params_dtype,
                       **extra_weight_attrs):
        if self._mm_serving:
            if getattr(layer, "apply_router_weight_on_input", False):
                self._mm_fall_back("routing weights applied to the input (apply_router_weight_on_input)")
            else:
                try:
                    self._mm = _Experts(layer.layer_name, self.moe, self._mm_format, num_experts, hidden_size,
                                        intermediate_size_per_partition)
                except megamoe.Error as e:
                    self._mm_fall_back(f"megamoe refuses the layer: {e}")
        if self._mm_serving:
            acts = f", activations {_settings.activations}" if self._mm_format == "nvfp4" else ""
            _say_once(self._mm_kind, f"megamoe ({self._mm.layer.group.backend} backend{acts})")
            with _log_lock:
                _model_bytes["layers"] += 1
        super().create_weights(layer, num_experts, hidden_size, intermediate_size_per_partition, params_dtype,
                               **extra_weight_attrs)

    def process_weights_after_loading(self, layer):
        if not self._mm_serving:
            return super().process_weights_after_loading(layer)
        if self._mm.layer.finalized:
            raise megamoe.UnsupportedError(
                f"{layer.layer_name}: weights reloaded after megamoe finalized the layer (not supported)", 8)
        tensors = {name: getattr(layer, name) for name, *_ in self._mm_fields}
        self._mm.load(self._mm_tensors(layer, tensors), self._mm_fields)
        for name in dict.fromkeys(name for name, *_ in self._mm_fields):
            # vLLM's checkpoint-layout copy, no longer read: an empty parameter keeps the attribute
            p = getattr(layer, name)
            replace_parameter(layer, name, torch.empty(0, dtype=p.dtype, device=p.device))
        self._mm_count_bytes()

    def _mm_tensors(self, layer, tensors):
        return tensors

    def _mm_count_bytes(self):
        with _log_lock:
            _model_bytes["finalized"] += 1
            _model_bytes["bytes"] += self._mm.layer.memory()["weight_bytes"]
            done = _model_bytes["finalized"] == _model_bytes["layers"]
            total, n = _model_bytes["bytes"], _model_bytes["layers"]
        if done:
            logger().info("megamoe: %d MoE layers finalized, %.1f MiB of expert weights resident in megamoe's "
                          "kernel layout (vLLM's checkpoint-layout copies freed)", n, total / 2**20)

    def get_fused_moe_quant_config(self, layer):
        return None if self._mm_serving else super().get_fused_moe_quant_config(layer)

    def apply(self, layer, x, topk_weights, topk_ids, shared_experts, shared_experts_input):
        if not self._mm_serving:
            return super().apply(layer, x, topk_weights, topk_ids, shared_experts, shared_experts_input)
        # Shared experts: with no modular kernel of vLLM's, the runner computes them around this call.
        return self._mm.forward(x, topk_weights, topk_ids)


def _nvfp4_fields(w13, w13_scale, w13_scale_2, w13_input, w2, w2_scale, w2_scale_2, w2_input, I, inputs):
    """(vLLM parameter, megamoe projection, megamoe field, part) for an NVFP4 layer: part indexes one
    expert's slice of the parameter, the rows of a fused gate/up tensor ([2I, ...]: gate rows first) or
    the column of a [2] scale pair, or is None for all of it. inputs: whether the checkpoint has input
    scales (weight-only exports have none, SPEC §6)."""
    gate, up = slice(0, I), slice(I, 2 * I)
    f = [(w13, "gate", "weight", gate), (w13, "up", "weight", up), (w2, "down", "weight", None),
         (w13_scale, "gate", "weight_scale", gate), (w13_scale, "up", "weight_scale", up),
         (w2_scale, "down", "weight_scale", None),
         (w13_scale_2, "gate", "weight_scale_2", 0), (w13_scale_2, "up", "weight_scale_2", 1),
         (w2_scale_2, "down", "weight_scale_2", None)]
    if inputs:
        f += [(w13_input, "gate", "input_scale", 0), (w13_input, "up", "input_scale", 1),
              (w2_input, "down", "input_scale", None)]
    return f


def _define_methods():
    class MegaMoEUnquantizedFusedMoEMethod(_MegaMoEMethod, UnquantizedFusedMoEMethod):
        """vLLM's unquantized MoE method on megamoe's BF16 format (SPEC §4)."""
        _mm_kind = "unquantized"
        _mm_format = "bf16"

        def __init__(self, moe):
            self._mm_init(moe, lambda: UnquantizedFusedMoEMethod.__init__(self, moe))

        def create_weights(self, layer, num_experts, hidden_size, intermediate_size_per_partition, params_dtype,
                           **extra_weight_attrs):
            I = intermediate_size_per_partition
            self._mm_fields = [("w13_weight", "gate", "weight", slice(0, I)),
                               ("w13_weight", "up", "weight", slice(I, 2 * I)),
                               ("w2_weight", "down", "weight", None)]
            super().create_weights(layer, num_experts, hidden_size, I, params_dtype, **extra_weight_attrs)

        def _mm_tensors(self, layer, tensors):
            out = {}
            for name, t in tensors.items():
                b = t.data.to(torch.bfloat16)
                if t.dtype != torch.bfloat16 and not torch.equal(b.to(t.dtype), t.data):
                    _say_once(self._mm_kind, f"{t.dtype} expert weights rounded to bf16 (megamoe's BF16 format)")
                out[name] = b
            return out

    class MegaMoEModelOptNvFp4FusedMoE(_MegaMoEMethod, modelopt.ModelOptNvFp4FusedMoE):
        """vLLM's ModelOpt NVFP4 MoE method on megamoe's NVFP4 format (SPEC §3, §3b). Gate and up keep
        their own global scales (vLLM's NVFP4 methods keep the gate's for both)."""
        _mm_kind = "ModelOpt NVFP4"
        _mm_format = "nvfp4"

        def __init__(self, quant_config, moe_config):
            use_a16 = quant_config.quant_method == "W4A16_NVFP4"
            self._mm_init(moe_config, lambda: modelopt.ModelOptNvFp4FusedMoE.__init__(self, quant_config, moe_config),
                          use_a16)
            if self._mm_serving:  # what vLLM's create_weights reads of the method
                self.quant_config = quant_config
                self.use_a16 = use_a16
                self.use_global_sf = False
                self.per_token_activation = False

        def create_weights(self, layer, num_experts, hidden_size, intermediate_size_per_partition, params_dtype,
                           **extra_weight_attrs):
            self._mm_fields = _nvfp4_fields("w13_weight", "w13_weight_scale", "w13_weight_scale_2", "w13_input_scale",
                                            "w2_weight", "w2_weight_scale", "w2_weight_scale_2", "w2_input_scale",
                                            intermediate_size_per_partition, not self._mm_use_a16)
            super().create_weights(layer, num_experts, hidden_size, intermediate_size_per_partition, params_dtype,
                                   **extra_weight_attrs)

    class MegaMoECompressedTensorsW4A4Nvfp4MoEMethod(_MegaMoEMethod, ct_nvfp4.CompressedTensorsW4A4Nvfp4MoEMethod):
        """vLLM's compressed-tensors NVFP4 MoE method (W4A4 and weight-only NVFP4A16) on megamoe's NVFP4
        format. compressed-tensors stores the reciprocals of the global scales (SPEC §6)."""
        _mm_kind = "compressed-tensors NVFP4"
        _mm_format = "nvfp4"

        def __init__(self, moe, layer_name=None, use_a16=False):
            self._mm_init(moe, lambda: ct_nvfp4.CompressedTensorsW4A4Nvfp4MoEMethod.__init__(
                self, moe, layer_name, use_a16), use_a16)
            if self._mm_serving:
                self.group_size = 16
                self.use_a16 = use_a16
                self.use_global_sf = False

        def create_weights(self, layer, num_experts, hidden_size, intermediate_size_per_partition, params_dtype,
                           **extra_weight_attrs):
            self._mm_fields = _nvfp4_fields(
                "w13_weight_packed", "w13_weight_scale", "w13_weight_global_scale", "w13_input_global_scale",
                "w2_weight_packed", "w2_weight_scale", "w2_weight_global_scale", "w2_input_global_scale",
                intermediate_size_per_partition, not self._mm_use_a16)
            super().create_weights(layer, num_experts, hidden_size, intermediate_size_per_partition, params_dtype,
                                   **extra_weight_attrs)

        def _mm_tensors(self, layer, tensors):
            # float32 reciprocals, as megamoe's checkpoint loader takes them (SPEC §6)
            return {n: torch.reciprocal(t.data) if "global_scale" in n else t for n, t in tensors.items()}

    return MegaMoEUnquantizedFusedMoEMethod, MegaMoEModelOptNvFp4FusedMoE, MegaMoECompressedTensorsW4A4Nvfp4MoEMethod


def install(settings):
    """Puts megamoe's methods in place of vLLM's; returns the kinds now served."""
    global _settings
    _settings = settings
    unquantized, modelopt_nvfp4, ct = _define_methods()
    from vllm.model_executor.custom_op import op_registry_oot
    served = []
    taken = op_registry_oot.get(UnquantizedFusedMoEMethod.__name__)
    if taken is None:
        UnquantizedFusedMoEMethod.register_oot(unquantized)
        unquantized.name = UnquantizedFusedMoEMethod.name  # vLLM's custom-op name, for its fallback dispatch
        served.append("unquantized")
    else:
        logger().warning("megamoe: unquantized MoE layers stay with %s, which another plugin registered",
                         taken.__name__)
    modelopt.ModelOptNvFp4Config.FusedMoEMethodCls = modelopt_nvfp4
    served.append("ModelOpt NVFP4")
    ct_nvfp4.CompressedTensorsW4A4Nvfp4MoEMethod = ct
    served.append("compressed-tensors NVFP4")
    return served
