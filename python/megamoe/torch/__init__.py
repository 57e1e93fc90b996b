"""PyTorch integration of megamoe (needs torch >= 2.4):

- torch.ops.megamoe.experts(layer_id, hidden_states, topk_weights, topk_ids, is_padding): a custom op with
  a fake implementation (torch.compile, CUDA graphs, opcheck);
- MegaMoEExperts: the experts nn.Module with the engine life cycle (weight_loader, load_weights,
  finalize_weights, forward, from_checkpoint), on CPU, one GPU, or one GPU per process over a
  torch.distributed process group (expert parallelism through the NCCL backend).
"""
try:
    import torch  # noqa: F401
except ImportError as e:  # pragma: no cover
    raise ImportError("megamoe.torch needs PyTorch (pip install torch); `import megamoe` works without it") from e

from ._op import experts
from ._module import MegaMoEExperts, group_for, close_groups
from ._dist import nccl_comm_from_process_group

__all__ = ["experts", "MegaMoEExperts", "group_for", "close_groups", "nccl_comm_from_process_group"]
