"""One rank of the expert-parallel check of test_torch_multi_gpu.py, started by torchrun: every rank
builds MegaMoEExperts over the world process group (NCCL backend, num_local_experts = E / R), loads the
all-expert weights through weight_loader, runs its share of the tokens eagerly and in a CUDA graph; rank 0
gathers y and compares it bitwise with the CUDA backend on one GPU running all tokens.
Usage: torchrun --nproc-per-node N torch_ep_worker.py OUT_FILE FORMAT
"""
import os
import sys

import numpy as np
import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(__file__))
import mmref as mr  # noqa: E402
import torchutil as tu  # noqa: E402

from megamoe.torch import MegaMoEExperts  # noqa: E402


def main(out_file, fmt):
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
    dist.init_process_group("nccl")
    E, K, H, I, T = 16, 4, 512, 256, 37
    model = mr.random_model(fmt, E, H, I, seed=61)
    x, ids, w, pad = mr.random_inputs(T * world, K, H, E, seed=62)
    mr.calibrate_a2(model, x, ids, pad)
    El = E // world
    m = MegaMoEExperts(num_experts=E, num_local_experts=El, experts_start_idx=rank * El, top_k=K, hidden_size=H,
                       intermediate_size=I, post_expert_norm=tu.Norm(model["norm"]), num_max_tokens_per_rank=T,
                       is_nvfp4=fmt == "nvfp4", prefix="ep", process_group=dist.group.WORLD, device="cuda",
                       **tu.spec3_activations(fmt))
    list(m.load_weights(tu.module_weights(model)))
    m.finalize_weights()
    X, W, ID, P = tu.torch_inputs(x, ids, w, pad, "cuda")
    mine = slice(rank * T, (rank + 1) * T)
    args = (X[mine].contiguous(), W[mine].contiguous(), ID[mine].contiguous(), P[mine].contiguous())
    y = m(*args)
    m.check()
    # the same forward captured in a CUDA graph and replayed
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        gy = m(*args)
    g.replay()
    torch.cuda.synchronize()
    same_graph = tu.same_bits(gy, y)
    ys = [torch.empty_like(y) for _ in range(world)]
    dist.all_gather(ys, y)
    if rank == 0:
        ref = tu.make_module(model, K=K, t_max=T * world, device="cuda", prefix="one")(X, W, ID, P)
        ok = tu.same_bits(torch.cat(ys), ref)
        with open(out_file, "w") as f:
            f.write(f"bitwise_equal_one_gpu={ok} graph_equal_eager={same_graph} world={world}\n")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
