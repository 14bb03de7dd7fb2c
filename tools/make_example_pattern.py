#!/usr/bin/env python3
"""make_example_pattern.py: writes a pattern JSON (SPEC.md section 8) from one
layer of a MInference static budget file (data/budgets/), for the example
pattern files of examples/patterns (the main job estimates its pattern online
instead). Position model: the first min(v, 30) keys
are sinks, the remaining verticals are spread evenly over the sequence; the
token diagonals 0..99 are the local window, the remaining slashes are spread
evenly; budgets are scaled by seq_len / --budget-context. Token diagonals
become block diagonals as SPEC.md section 2 says."""
import argparse
import json


def spread(count, start, stop):
    if count <= 0 or stop <= start:
        return []
    step = (stop - start) / count
    return sorted({start + int(i * step) for i in range(count)})


def head_pattern(v_size, s_size, n, g):
    nb = (n + g - 1) // g
    sinks = list(range(min(v_size, 30, n)))
    verticals = sorted(set(sinks) | set(spread(v_size - len(sinks), len(sinks), n)))
    window = list(range(min(s_size, 100, n)))
    slashes = set(window) | set(spread(s_size - len(window), len(window), n))
    diagonals = {0}
    for t in slashes:
        a, b = divmod(t, g)
        if a < nb:
            diagonals.add(a)
        if b > 0 and a + 1 < nb:
            diagonals.add(a + 1)
    return {"diagonals": sorted(diagonals), "verticals": verticals}


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("budgets")
    ap.add_argument("--layer", type=int, required=True)
    ap.add_argument("--seq-len", type=int, required=True)
    ap.add_argument("--granularity", type=int, default=128)
    ap.add_argument("--budget-context", type=int, default=32768)
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    layers = json.load(open(a.budgets))
    layer = layers[a.layer]
    scale = a.seq_len / a.budget_context
    heads = []
    for h in range(len(layer)):
        kind, v_size, s_size = layer[str(h)][:3]
        if kind != "vertical_and_slash":
            raise SystemExit(f"{a.budgets}: layer {a.layer} head {h} is {kind}, not static top-k")
        heads.append(head_pattern(round(v_size * scale), round(s_size * scale), a.seq_len, a.granularity))
    with open(a.out, "w") as f:
        f.write('{"granularity": %d, "seq_len": %d, "heads": [\n' % (a.granularity, a.seq_len))
        f.write(",\n".join(json.dumps(h) for h in heads))
        f.write("\n]}\n")


if __name__ == "__main__":
    main()
