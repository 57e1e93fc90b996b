"""What the vLLM plugin costs on vLLM's CPU build: engine start-up and time per generation step, with
and without megamoe, on the tests' tiny models (tests/vllm/models.py; run with the tests' .venv, vLLM's
environment made by scripts/install-vllm.sh).

    .venv/bin/python bench/vllm_cpu.py [--repeat 3] [--json bench/history/vllm-cpu/DATE.jsonl]

Each case runs tests/vllm/run_vllm.py `repeat` times (a fresh engine each time; 6 prompts of 24 tokens,
8 greedy tokens each, eager, one process) and reports the medians. One record per case:
{"case", "model", "dtype", "megamoe", "init_s", "step_ms", "commit", "date", "machine"}.
On the CPU megamoe's backend is its reference, not a fast path (docs/VLLM.md): these figures say what
serving a model through the plugin costs there, not how fast megamoe is.
"""
import argparse
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tests", "vllm"))
import models  # noqa: E402
import test_vllm as tv  # noqa: E402

CASES = [  # name, model, dtype, environment
    ("BF16, vLLM's own MoE", "qwen3", "float32", {"MEGAMOE_VLLM": "0"}),
    ("BF16 on megamoe", "qwen3", "float32", {"MEGAMOE_VLLM_CPU_BF16": "1"}),
    ("NVFP4 (llm-compressor) on megamoe", "qwen3-ct", "float32", {}),
    ("NVFP4 (ModelOpt) on megamoe", "qwen3-modelopt", "float16", {}),
]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeat", type=int, default=3, help="engines per case (default 3)")
    ap.add_argument("--json", help="append one record per case to this file")
    args = ap.parse_args()
    python, why = tv.find_vllm_python()
    if python is None:
        sys.exit(f"vllm_cpu: {why}")
    commit = subprocess.run(["git", "-C", ROOT, "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True).stdout.strip()
    with tempfile.TemporaryDirectory() as tmp:
        site = tv.install_megamoe(python, os.path.join(tmp, "site"), os.path.join(tmp, "build"))
        model = models.Models(tmp)
        rows = []
        for case, name, dtype, env in CASES:
            runs = [tv.run(python, site, model(name), dtype=dtype, env=env)[0] for _ in range(args.repeat)]
            rows.append({"case": case, "model": name, "dtype": dtype, "megamoe": "MEGAMOE_VLLM" not in env,
                         "init_s": round(statistics.median(x["init_s"] for x in runs), 2),
                         "step_ms": round(1e3 * statistics.median(x["step_s"] for x in runs), 1),
                         "commit": commit, "date": datetime.date.today().isoformat(),
                         "machine": f"{os.cpu_count()} CPUs, {platform.machine()}"})
            print(f"{case:40s} {dtype:8s} start-up {rows[-1]['init_s']:6.2f} s  per step {rows[-1]['step_ms']:7.1f} ms",
                  flush=True)
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "a") as f:
            for row in rows:
                f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
