"""Benchmark records: the one format of bench/history/*.jsonl and of `megamoe bench --json FILE`.

One JSON object per measured point, one per line:
  shape       "E=256 K=8 H=7168 I=2048" (experts, top-k, hidden, intermediate)
  format      "nvfp4" or "bf16" (the weights)
  activations "bf16" or "nvfp4" for NVFP4 weights (SPEC §3b; null where not recorded), null for BF16
  T           tokens per forward (per GPU with "gpus" > 1 in source)
  median_ms, min_ms, max_ms   time per forward (min/max null where not recorded)
  tflops      6*H*I*T*K / median (bf16-equivalent arithmetic rate)
  weight_gbps bytes of the touched experts' weights / median (null where not recorded)
  pct_copy    weight_gbps as % of the device's measured copy bandwidth (null where not recorded)
  commit, gpu, date           what ran, where, when (YYYY-MM-DD)
  source      who computed it: "megamoe", "humming", "humming-gemms", "marlin", "torch", with a
              suffix after ":" where it needs one (e.g. "megamoe:docs/BENCHMARKS.md")

Also a command: turn `megamoe bench` text output into records (for builds without --json):
  python3 bench/records.py --commit C --gpu G --date D [--source S] LOG... >> FILE.jsonl
"""
import argparse
import json
import re
import sys

KEYS = ["shape", "format", "activations", "T", "median_ms", "min_ms", "max_ms", "tflops", "weight_gbps",
        "pct_copy", "commit", "gpu", "date", "source"]

# The three shapes of the benchmark table: name -> (E, K, H, I).
SHAPES = {"DeepSeek-V3-like": (256, 8, 7168, 2048), "Qwen3-30B-like": (128, 8, 2048, 768),
          "Mixtral-like": (8, 2, 4096, 14336)}
TOKENS = [1, 8, 32, 128, 512, 2048, 8192]


def shape_str(E, K, H, I):
    return f"E={E} K={K} H={H} I={I}"


def shape_dims(shape):
    """'E=256 K=8 H=7168 I=2048' -> (256, 8, 7168, 2048)."""
    d = dict(kv.split("=") for kv in shape.split())
    return int(d["E"]), int(d["K"]), int(d["H"]), int(d["I"])


def tflops_of(shape, T, ms):
    E, K, H, I = shape_dims(shape)
    return round(6.0 * H * I * T * K / (ms * 1e-3) / 1e12, 2)


def record(shape, fmt, T, median_ms, *, activations=None, min_ms=None, max_ms=None, tflops=None,
           weight_gbps=None, pct_copy=None, commit=None, gpu=None, date=None, source="megamoe"):
    """A record with every key in KEYS order; tflops computed from the shape when not given."""
    if tflops is None and median_ms:
        tflops = tflops_of(shape, T, median_ms)
    r = dict(shape=shape, format=fmt, activations=activations, T=T, median_ms=median_ms, min_ms=min_ms,
             max_ms=max_ms, tflops=tflops, weight_gbps=weight_gbps, pct_copy=pct_copy, commit=commit, gpu=gpu,
             date=date, source=source)
    return {k: r[k] for k in KEYS}


# bench: E=256 K=8 H=7168 I=2048 T=8 nvfp4 R=1 backend=cuda: median 0.4135 ms over 10, 142.0 TFLOP/s,
#        3250.1 GB/s of touched expert weights (61 experts) [78% of copy, 17.9% of bf16 peak]
# (an "activations=X" or "act=X" word between the format and the colon is read when present)
_BENCH = re.compile(r"bench(?:\[[^\]]*\])?: E=(\d+) K=(\d+) H=(\d+) I=(\d+) T=(\d+) (nvfp4|bf16)([^:]*):"
                    r" median ([\d.]+) ms(?:.*?, ([\d.]+) TFLOP/s)?(?:, ([\d.]+) GB/s)?(?:.*?\[(\d+)% of copy)?")


def parse_bench_text(text, **common):
    """Records from the lines of `megamoe bench` output; common fills commit, gpu, date, source."""
    out = []
    for line in text.splitlines():
        m = _BENCH.search(line)
        if not m:
            continue
        E, K, H, I, T = (int(v) for v in m.groups()[:5])
        fmt, rest, ms, tf, gbps, pct = m.groups()[5:]
        a = re.search(r"act(?:ivations)?[=: ]+(bf16|nvfp4)", rest)
        out.append(record(shape_str(E, K, H, I), fmt, T, float(ms),
                          activations=a.group(1) if a else None,
                          tflops=float(tf) if tf else None, weight_gbps=float(gbps) if gbps else None,
                          pct_copy=float(pct) if pct else None, **common))
    return out


def write_jsonl(records, f):
    for r in records:
        f.write(json.dumps(r) + "\n")


def read_jsonl(path):
    """The records of a file; one without "source" is megamoe's (`megamoe bench --json` before it wrote the key)."""
    with open(path) as f:
        return [{"source": "megamoe", **json.loads(line)} for line in f if line.strip()]


def main():
    ap = argparse.ArgumentParser(description="megamoe bench text output -> JSON-lines records (stdout)")
    ap.add_argument("logs", nargs="+")
    ap.add_argument("--commit")
    ap.add_argument("--gpu")
    ap.add_argument("--date")
    ap.add_argument("--source", default="megamoe")
    a = ap.parse_args()
    for p in a.logs:
        with open(p) as f:
            write_jsonl(parse_bench_text(f.read(), commit=a.commit, gpu=a.gpu, date=a.date, source=a.source),
                        sys.stdout)


if __name__ == "__main__":
    main()
