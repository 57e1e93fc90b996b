#!/usr/bin/env python3
"""The builds of a device call side by side: reads the `bench[NAME]: ... median X ms` lines that
bench/call_lib.sh's cmp_bench writes (any number of logs), and prints, per shape and token count,
each build's mean over its runs (the runs alternate within one call), its spread (min-max), and its
change against the reference build.

    python3 bench/cmp_table.py LOG... [--ref main] [--shapes qwen3,mixtral,dsv3]

Standard library only; runs here on the logs a call brings back.
"""
import argparse
import re
import signal
import sys
from collections import defaultdict

LINE = re.compile(r"^bench\[(?P<name>[^\]]+)\]: E=(?P<E>\d+) K=(?P<K>\d+) H=(?P<H>\d+) I=(?P<I>\d+) "
                  r"T=(?P<T>\d+) (?P<fmt>\w+) .*?median (?P<ms>[0-9.]+) ms")
SHAPES = {(128, 8, 2048, 768): "qwen3", (8, 2, 4096, 14336): "mixtral", (256, 8, 7168, 2048): "dsv3"}


def read(paths):
    """{(shape, fmt, T): {name: [ms, ...]}} and the build names in order of first appearance."""
    runs = defaultdict(lambda: defaultdict(list))
    names = []
    for path in paths:
        with open(path, encoding="utf-8", errors="replace") as f:
            for line in f:
                m = LINE.match(line)
                if not m:
                    continue
                key = tuple(int(m[k]) for k in ("E", "K", "H", "I"))
                shape = SHAPES.get(key, "E%d K%d H%d I%d" % key)
                runs[(shape, m["fmt"], int(m["T"]))][m["name"]].append(float(m["ms"]))
                if m["name"] not in names:
                    names.append(m["name"])
    return runs, names


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("logs", nargs="+")
    ap.add_argument("--ref", default="main", help="the build the others are compared with (default main)")
    ap.add_argument("--shapes", default="", help="a comma list of shapes to keep (qwen3, mixtral, dsv3)")
    args = ap.parse_args()
    runs, names = read(args.logs)
    if not runs:
        print("no bench[NAME] lines in " + ", ".join(args.logs), file=sys.stderr)
        return 1
    keep = set(filter(None, args.shapes.split(",")))
    ref = args.ref if args.ref in names else names[0]
    order = {"qwen3": 0, "mixtral": 1, "dsv3": 2}
    for key in sorted(runs, key=lambda k: (order.get(k[0], 9), k[0], k[1], k[2])):
        shape, fmt, T = key
        if keep and shape not in keep:
            continue
        by = runs[key]
        base = sum(by[ref]) / len(by[ref]) if by.get(ref) else None
        cells = []
        for n in names:
            v = by.get(n)
            if not v:
                continue
            mean = sum(v) / len(v)
            cell = "%s %.4f" % (n, mean)
            if len(v) > 1:
                cell += " (%.4f-%.4f)" % (min(v), max(v))
            if base and n != ref:
                cell += " %+.1f%%" % (100.0 * (mean / base - 1.0))
            cells.append(cell)
        print("%-8s %-5s T=%-5d | %s" % (shape, fmt, T, " | ".join(cells)))
    return 0


if __name__ == "__main__":
    signal.signal(signal.SIGPIPE, signal.SIG_DFL)  # quiet under | head
    sys.exit(main())
