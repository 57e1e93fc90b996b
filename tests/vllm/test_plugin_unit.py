"""The vLLM plugin's parts that need no vLLM (runs in the tests' .venv): its settings, and the rule by
which a layer's expert-parallel ranks share vLLM's tokens (megamoe/vllm/_ep.py), checked on megamoe's
CPU backend: the ranks' outputs, summed as vLLM sums them, are the layer's output bit for bit."""
import os
import sys

import pytest
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "py"))
import torchutil  # noqa: E402,F401  (puts the package of this tree on the path, as the torch tests do)

from megamoe.torch import MegaMoEExperts  # noqa: E402
from megamoe.vllm import Settings, _ep  # noqa: E402


def test_settings_defaults():
    s = Settings({})
    assert (s.enabled, s.activations, s.cpu_bf16) == (True, "bf16", False)
    s = Settings({"MEGAMOE_VLLM": "0", "MEGAMOE_VLLM_ACTIVATIONS": "nvfp4", "MEGAMOE_VLLM_CPU_BF16": "1"})
    assert (s.enabled, s.activations, s.cpu_bf16) == (False, "nvfp4", True)


@pytest.mark.parametrize("env,named", [
    ({"MEGAMOE_VLLM": "off"}, "MEGAMOE_VLLM='off'"), ({"MEGAMOE_VLLM_CPU_BF16": "yes"}, "MEGAMOE_VLLM_CPU_BF16='yes'"),
    ({"MEGAMOE_VLLM_ACTIVATIONS": "fp8"}, "MEGAMOE_VLLM_ACTIVATIONS='fp8'")])
def test_settings_refuse_bad_values(env, named):
    with pytest.raises(ValueError, match=named.replace("'", "'")):
        Settings(env)


@pytest.mark.parametrize("world_size", [1, 2, 3, 8])
def test_token_share_sums_to_the_layer(world_size):
    E, K, H, I, T = 8, 2, 256, 256, 37
    torch.manual_seed(world_size)
    m = MegaMoEExperts(num_experts=E, num_local_experts=E, experts_start_idx=0, top_k=K, hidden_size=H,
                       intermediate_size=I, num_max_tokens_per_rank=64, is_nvfp4=False, device="cpu")
    list(m.load_weights([("w13_weight", torch.randn(E, 2 * I, H).bfloat16() / 16),
                         ("w2_weight", torch.randn(E, H, I).bfloat16() / 16)]))
    m.finalize_weights()
    x = torch.randn(T, H).bfloat16()
    w = torch.rand(T, K)
    ids = torch.randint(-1, E, (T, K), dtype=torch.int32)
    whole = m(x, w, ids)
    masks = [_ep.others_mask(64, world_size, r, "cpu")[:T] for r in range(world_size)]
    assert torch.equal(torch.stack(masks).logical_not().sum(0), torch.ones(T, dtype=torch.long))  # one rank each
    parts = [m(x, w, ids, is_padding=mask) for mask in masks]
    for mask, y in zip(masks, parts):
        assert not y[mask].any()  # the tokens left to other ranks: zero rows
    total = torch.stack([y.float() for y in parts]).sum(0).bfloat16()
    assert torch.equal(total, whole)
