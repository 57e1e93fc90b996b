"""The side-by-side table from benchmark records (bench/records.py): per shape, one row per implementation
(megamoe NVFP4 in each activation mode, megamoe BF16, Humming whole and GEMMs only, Marlin W4A16, PyTorch
BF16), one column per T, ms per forward; the latest record of each (source, format, activations, T)
wins. The three shapes of the benchmark table come first, then any other shape the records hold.
Marlin's recorded table comes from bench/history/2026-11-29.jsonl unless a file given has it.

  python3 bench/side_by_side.py FILE.jsonl...        (markdown on stdout)
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import records as R  # noqa: E402

MARLIN = os.path.join(os.path.dirname(os.path.abspath(__file__)), "history", "2026-11-29.jsonl")


def row_name(r):
    src = r["source"].split(":")[0]
    if src == "megamoe":
        if r["format"] == "bf16":
            return "megamoe BF16"
        act = r.get("activations")
        return f"megamoe NVFP4, activations {act}" if act else "megamoe NVFP4"
    return {"humming": "Humming NVFP4 W4A16, whole forward", "humming-gemms": "Humming NVFP4, its two GEMMs alone",
            "marlin": "Marlin W4A16 (issue 3's table)",
            "torch": f"PyTorch grouped_mm {r['format'].upper()} (eager)"}.get(src, src)


ORDER = ["megamoe NVFP4, activations bf16", "megamoe NVFP4, activations nvfp4", "megamoe NVFP4",
         "Humming NVFP4 W4A16, whole forward", "Humming NVFP4, its two GEMMs alone", "Marlin W4A16 (issue 3's table)",
         "megamoe BF16", "PyTorch grouped_mm BF16 (eager)"]


def main():
    files = [f for f in sys.argv[1:] if os.path.exists(f)]
    recs = [r for f in files for r in R.read_jsonl(f)]
    if not any(r["source"].startswith("marlin") for r in recs) and os.path.exists(MARLIN):
        recs += [r for r in R.read_jsonl(MARLIN) if r["source"].startswith("marlin")]
    cells, meta = {}, set()
    for r in recs:  # later records replace earlier ones
        cells[(r["shape"], row_name(r), r["T"])] = r["median_ms"]
        if r.get("commit") or r.get("gpu"):
            day = (r.get("date") or "")[:10]
            meta.add(f"{r['source'].split(':')[0]} {r.get('commit') or ''} {r.get('gpu') or ''} {day}".strip())
    for m in sorted(meta):
        print(f"- {m}")
    named = [(name, R.shape_str(*dims)) for name, dims in R.SHAPES.items()]
    others = sorted({s for (s, _, _) in cells} - {shape for _, shape in named})
    for name, shape in named + [(None, s) for s in others]:  # the table's three shapes, then any other
        Ts = sorted({T for (s, _, T) in cells if s == shape})
        rows = [n for n in ORDER if any((shape, n, T) in cells for T in Ts)]
        rows += sorted({n for (s, n, _) in cells if s == shape} - set(rows))
        if not Ts:
            continue
        print(f"\n### {name + ' (' + shape + ')' if name else shape}, ms per forward\n")
        print("| implementation | " + " | ".join(f"T={T}" for T in Ts) + " |")
        print("|---|" + "---|" * len(Ts))
        for n in rows:
            vals = [cells.get((shape, n, T)) for T in Ts]
            print(f"| {n} | " + " | ".join("–" if v is None else f"{v:.4g}" for v in vals) + " |")


if __name__ == "__main__":
    main()
