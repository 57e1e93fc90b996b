#!/usr/bin/env python3
"""Writes the seed corpora of fuzz_loader and fuzz_forward (tests/fuzz/corpus/{loader,forward}/) in the
compact input forms their headers describe. Pure Python (struct, json), deterministic; run it again to
recreate the seeds after a change of the input form."""
import hashlib
import json
import os
import struct

HERE = os.path.dirname(os.path.abspath(__file__))
SIZES = {"BF16": 2, "F32": 4, "I32": 4, "U8": 1, "F8_E4M3": 1, "BOOL": 1}


def header(tensors):
    """tensors: [(name, dtype, shape)] laid out back to back; returns (header bytes, data bytes needed)."""
    h, off = {}, 0
    for name, dt, shape in tensors:
        n = SIZES[dt]
        for d in shape:
            n *= d
        h[name] = {"dtype": dt, "shape": list(shape), "data_offsets": [off, off + n]}
        off += n
    return json.dumps(h, separators=(",", ":")).encode(), off


def loader_seed(flags, index, ha, hb, D, fill):
    sec = b"".join(struct.pack("<H", len(s)) + s for s in (index, ha, hb))
    return bytes([flags]) + struct.pack("<I", D) + sec + fill


def nvfp4_stacked(p, E, H, I):
    return [(p + "w13_weight", "U8", (E, 2 * I, H // 2)), (p + "w13_weight_scale", "F8_E4M3", (E, 2 * I, H // 16)),
            (p + "w13_weight_scale_2", "F32", (E, 2)), (p + "w13_input_scale", "F32", (E, 2)),
            (p + "w2_weight", "U8", (E, H, I // 2)), (p + "w2_weight_scale", "F8_E4M3", (E, H, I // 16)),
            (p + "w2_weight_scale_2", "F32", (E,)), (p + "w2_input_scale", "F32", (E,))]


def per_expert(p, E, H, I, bf16, names=("gate_proj", "up_proj", "down_proj")):
    out = []
    for e in range(E):
        for j, proj in enumerate(names):
            rows, cols = (I, H) if j < 2 else (H, I)
            b = f"{p}experts.{e}.{proj}."
            if bf16:
                out.append((b + "weight", "BF16", (rows, cols)))
            else:
                out += [(b + "weight", "U8", (rows, cols // 2)), (b + "weight_scale", "F8_E4M3", (rows, cols // 16)),
                        (b + "weight_scale_2", "F32", ()), (b + "input_scale", "F32", ())]
    return out


def write(folder, seeds):
    os.makedirs(folder, exist_ok=True)
    for s in seeds:
        with open(os.path.join(folder, hashlib.sha1(s).hexdigest()), "wb") as f:
            f.write(s)


def main():
    E, H, I = 2, 256, 256
    # Block scales 0x38 (1.0) and global scales 1/64 read from a fill pattern: 0x38 bytes, with some
    # 0x3C 0x80 0x00 0x00 ... so F32 fields are finite; the fuzzer mutates from there.
    fill = bytes([0x38, 0x3C, 0x38, 0x3C])
    seeds = []
    ha, D = header(nvfp4_stacked("", E, H, I))
    seeds.append(loader_seed(0, b"", ha, b"", D, fill))
    ha, D = header(nvfp4_stacked("model.layers.0.mlp.", E, H, I) + [("model.layers.0.mlp.post_expert_norm.weight", "F32", (H,))])
    seeds.append(loader_seed(2 | 8, b"", ha, b"", D, fill))
    # BF16 per expert in two shards with an index; quantized too (flag 4 applies to files only).
    t = per_expert("m.", E, H, I, True)
    ha, Da = header(t[:3])
    hb, Db = header(t[3:])
    index = json.dumps({"metadata": {}, "weight_map": {**{n: "a.safetensors" for n, _, _ in t[:3]},
                                                       **{n: "b.safetensors" for n, _, _ in t[3:]}}}).encode()
    seeds.append(loader_seed(1, index, ha, hb, max(Da, Db), bytes([0x00, 0x3C])))
    ha, D = header(per_expert("m.", E, H, I, True, ("w1", "w3", "w2")))
    seeds.append(loader_seed(4, b"", ha, b"", D, bytes([0x00, 0x3C, 0x80, 0xBC])))
    # NVFP4 per expert, compressed-tensors names.
    ct = [(n.replace(".weight", ".weight_packed") if n.endswith(".weight") else
           n.replace("weight_scale_2", "weight_global_scale").replace("input_scale", "input_global_scale"), d, s)
          for n, d, s in per_expert("x.", E, H, I, False)]
    ha, D = header(ct)
    seeds.append(loader_seed(0, b"", ha, b"", D, fill))
    write(os.path.join(HERE, "corpus", "loader"), seeds)

    # fuzz_forward: an inputs file for T tokens (K = 2, H = 256, E = 4) with edge cases.
    def inputs(T, ids, weights, pad=None, nan_row=None):
        x = bytearray()
        for t in range(T):
            row = [0x3F80 ^ (((t * 31 + h * 7) & 0xFF) << 0) for h in range(H)]
            if t == nan_row:
                row[3] = 0x7FC0
            x += struct.pack(f"<{H}H", *row)
        ts = [("hidden_states", "BF16", (T, H)), ("topk_ids", "I32", (T, 2)), ("topk_weights", "F32", (T, 2))]
        data = bytes(x) + struct.pack(f"<{2 * T}i", *ids) + struct.pack(f"<{2 * T}f", *weights)
        if pad is not None:
            ts.append(("is_padding", "BOOL", (T,)))
            data += bytes(pad)
        h, _ = header(ts)
        return struct.pack("<Q", len(h)) + h + data

    fw = []
    fw.append(bytes([0, 0, 0]) + inputs(4, [0, 1, 2, 3, 1, -1, 3, 3], [0.5, 0.5, 1.0, -1.0, 2.0, 0.0, 0.25, 0.75]))
    fw.append(bytes([1, 0, 0]) + inputs(3, [0, 1, -1, -1, 2, 3], [0.5, 0.5, 1.0, 1.0, 1.0, 1.0], pad=[0, 0, 1]))
    fw.append(bytes([2, 0, 3]) + inputs(6, [0, 1, 1, 2, 2, 3, 3, 0, 0, 2, 1, 3], [1.0] * 12, nan_row=2))
    fw.append(bytes([3 | 4, 9, 5]) + inputs(5, [0, 4, -2, 1, 3, 3, 0, 0, 1, 1], [1.0] * 10, pad=[1, 0, 0, 0, 1]))
    write(os.path.join(HERE, "corpus", "forward"), fw)


if __name__ == "__main__":
    main()
