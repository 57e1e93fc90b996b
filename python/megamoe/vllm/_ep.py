"""How a served layer shares vLLM's tokens among the ranks of its expert-parallel group.

vLLM hands every rank of the group the same tokens (tensor-parallel replicas, or the data-parallel
ranks' tokens gathered before the experts) and, after a method that has no combine of its own, sums
the ranks' outputs (an all-reduce, or a reduce-scatter back to the data-parallel ranks). megamoe's
expert-parallel forward already sends each token to the ranks that own its experts and brings the
result home, so each token must enter it on one rank only: rank r computes the tokens t with
t % R == r and marks the others as padding, whose output rows are zero (SPEC §1). vLLM's sum then
adds one nonzero row per token: the layer's output, computed once.
"""
import torch


def others_mask(max_tokens, world_size, rank, device):
    """[max_tokens] bool: True for the tokens rank `rank` of `world_size` leaves to the other ranks
    (megamoe's is_padding). A forward of T tokens uses its first T entries."""
    return (torch.arange(max_tokens, device=device) % world_size) != rank
