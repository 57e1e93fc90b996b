"""Runs vLLM (its CPU build) on one model and prints what tests/py/test_vllm.py checks, as one JSON line.

Run with the vLLM environment's python (scripts/install-vllm.sh), megamoe on PYTHONPATH with its
dist-info, so that vLLM finds the plugin through its entry point as an installed package would be found,
and this folder too (vllm_probe, which vLLM's worker processes import).

    python run_vllm.py SPEC.json  ->  {"tokens": [[...], ...], "margins": [[top-1 less top-2 log-prob per
                                      step], ...], "prompt_logprobs": [[[...V], ...], ...],
                                      "layers": {name: method class}, "op_calls": {layer_id: n} | null,
                                      "init_s": ..., "generate_s": ..., "step_s": ...}

SPEC: {"model": dir, "dtype": "float32" | "bfloat16", "eager": bool, "multiprocess": bool,
       "prompts": [[ids], ...], "max_tokens": n, "vocab": V, "prompt_logprobs": bool, "teacher": "own" | [[ids]],
       "record_routing": bool, "count_op_calls": bool}
prompt_logprobs: every prompt's full log-probability rows (V entries per position), or with teacher those
of the sequences it names ("own": each prompt and the tokens this run generated); record_routing (eager,
one process): each prompt's routing per MoE layer, as vLLM's router chose it, and the first prompt's
inputs and output of every MoE layer (x, topk_weights, topk_ids, y).
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
# apply_model sends a function to vLLM's engine process, which vLLM pickles only when allowed.
os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")

from vllm import LLM, SamplingParams  # noqa: E402

# What runs on the model in vLLM's worker (apply_model), importable there by name (PYTHONPATH).
from vllm_probe import layer_methods, record_routing, take_io, take_routes  # noqa: E402


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

    # each step's margin: the chosen token's log-probability less the runner-up's (a generation of its
    # own: vLLM's log-probabilities slow the timed one)
    scored = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=spec["max_tokens"], detokenize=False,
                                                  logprobs=2), use_tqdm=False)
    assert [list(o.outputs[0].token_ids) for o in scored] == [list(o.outputs[0].token_ids) for o in outs]
    margins = [[sorted((lp.logprob for lp in step.values()), reverse=True)[:2] for step in o.outputs[0].logprobs]
               for o in scored]
    result = {"tokens": [list(o.outputs[0].token_ids) for o in outs], "init_s": init_s, "generate_s": gen_s,
              "margins": [[m[0] - m[1] for m in seq] for seq in margins],
              "step_s": gen_s / max(steps, 1), "op_calls": calls,
              "layers": llm.apply_model(layer_methods)[0]}
    if spec.get("prompt_logprobs"):
        # One prompt per call, so that the call's one forward is that prompt's prefill; its routing
        # (each layer's topk_ids, [len, K]) is what the float64 reference replays.
        if spec.get("record_routing"):
            llm.apply_model(record_routing)
        one = SamplingParams(temperature=0.0, max_tokens=1, detokenize=False, prompt_logprobs=vocab)
        result["prompt_logprobs"], result["routes"] = [], []
        # "teacher": "own" scores this run's prompts followed by the tokens it generated (all but the
        # last), a list scores those sequences: one position per generated step, under one prefix
        teacher = spec.get("teacher")
        if teacher == "own":
            teacher = [p + t[:-1] for p, t in zip(spec["prompts"], result["tokens"])]
        scored = [{"prompt_token_ids": p} for p in teacher] if teacher else prompts
        for p in scored:
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
        if spec.get("record_routing"):  # the first prompt's MoE inputs and outputs, by layer
            result["layer_io"] = [io for _, io in sorted(llm.apply_model(take_io)[0].items())]
    print("RESULT " + json.dumps(result), flush=True)
    # The engine (and, multi-process, its processes) shut down here, in order, not among the interpreter's
    # teardown: there vLLM's front end once aborted on a thread still running (std::terminate).
    llm.llm_engine.engine_core.shutdown()


if __name__ == "__main__":
    main()
