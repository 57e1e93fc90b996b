#!/usr/bin/env python3
"""Summarize ncu's source page (SASS) with warp-stall samples, as bench/stalls_sass.sh writes it.

    python3 bench/stalls_top.py FILE.csv [--top N]   per kernel: samples by stall reason, the top
                                                     instructions with their two main reasons
    python3 bench/stalls_top.py --cut FULL.csv       (stalls_sass.sh) keep only address, source,
                                                     samples, executions and stall reasons
"""
import argparse
import csv
import sys

KEEP = ("Address", "Source", "Warp Stall Sampling (All Samples)", "Instructions Executed")


def kernels(path):
    """Yields (kernel name, header, rows) for each kernel block of the CSV."""
    name, header, rows = None, None, []
    for r in csv.reader(open(path, newline="")):
        if r and r[0] == "Kernel Name":
            if name is not None and header:
                yield name, header, rows
            name, header, rows = r[1], None, []
        elif r and r[0] == "Address":
            header = r
        elif header and len(r) == len(header):
            rows.append(r)
    if name is not None and header:
        yield name, header, rows


def is_reason(col):
    return col.startswith("stall_") and "Not Issued" not in col


def cut(path):
    out = csv.writer(sys.stdout)
    for name, header, rows in kernels(path):
        keep = [i for i, c in enumerate(header) if c in KEEP or is_reason(c)]
        out.writerow(["Kernel Name", name])
        out.writerow([header[i] for i in keep])
        for r in rows:
            v = [r[i] for i in keep]
            v[0] = v[0][-6:]  # the offset in the module, not this run's address
            out.writerow(v)


def top(path, n):
    for name, header, rows in kernels(path):
        ix = {c: i for i, c in enumerate(header)}
        samples = lambda r: int(r[ix["Warp Stall Sampling (All Samples)"]] or 0)
        total = sum(samples(r) for r in rows) or 1
        reasons = [c for c in header if is_reason(c)]
        by = {c: sum(int(r[ix[c]] or 0) for r in rows) for c in reasons}
        print(f"== {name[:100]}: {len(rows)} instructions, {total} samples")
        print("   " + ", ".join(f"{c[6:]} {100 * v / total:.1f}%" for c, v in sorted(by.items(), key=lambda x: -x[1])[:8]))
        for r in sorted(rows, key=lambda r: -samples(r))[:n]:
            main = sorted(((int(r[ix[c]] or 0), c[6:]) for c in reasons), reverse=True)[:2]
            why = ", ".join(f"{c} {v}" for v, c in main if v)
            print(f"   {r[0]:>8} {samples(r):6d} {100 * samples(r) / total:5.1f}%  {r[1].strip()[:56]:56s} {why}")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("csv")
    ap.add_argument("--top", type=int, default=15)
    ap.add_argument("--cut", action="store_true")
    a = ap.parse_args()
    cut(a.csv) if a.cut else top(a.csv, a.top)


if __name__ == "__main__":
    main()
