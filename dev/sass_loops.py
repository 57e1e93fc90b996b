#!/usr/bin/env python3
"""Instruction counts of the innermost loops that issue tensor-core instructions, per kernel, from
`cuobjdump -sass` output: for each backward branch whose body holds an HMMA/HGMMA, the body's size
and its mix by opcode. A static view of what a K step costs (no GPU needed: cuobjdump is in the
CUDA toolkit, or in PyPI's nvidia-cuda-cuobjdump wheel).
    usage: cuobjdump -sass file.cubin | python3 dev/sass_loops.py [KERNEL_SUBSTRING]
"""
import collections
import re
import sys

want = sys.argv[1] if len(sys.argv) > 1 else ""
func, insts = None, []


def report(name, insts):
    if not name or want not in name:
        return
    addr = {a: i for i, (a, _) in enumerate(insts)}
    for i, (a, op) in enumerate(insts):
        m = re.search(r"BRA (?:\S+, )?0x([0-9a-f]+)", op)
        if not m or int(m.group(1), 16) >= a or int(m.group(1), 16) not in addr:
            continue
        body = [o for _, o in insts[addr[int(m.group(1), 16)]: i + 1]]
        mma = sum(1 for o in body if re.search(r"\bH[G]?MMA", o))
        inner = [o for o in body[:-1] if (b := re.search(r"BRA (?:\S+, )?0x([0-9a-f]+)", o)) and int(b.group(1), 16) < a]
        if not mma or inner:  # innermost loops only
            continue
        mix = collections.Counter(re.sub(r"^@!?U?P\w+ ", "", o).split()[0].split(".")[0] for o in body)
        top = ", ".join(f"{k} {v}" for k, v in mix.most_common(12))
        print(f"{name[:70]}\n  loop 0x{int(m.group(1), 16):x}-0x{a:x}: {len(body)} instructions, {mma} MMA: {top}")


for line in sys.stdin:
    m = re.search(r"Function : (\S+)", line)
    if m:
        report(func, insts)
        func, insts = m.group(1), []
        continue
    m = re.match(r"\s+/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;", line)
    if m:
        insts.append((int(m.group(1), 16), m.group(2)))
report(func, insts)
