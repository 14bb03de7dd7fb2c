"""balance_row_pairs.py: the measured-pricing table of SparseBalance's predictor on a length grid.

For every layer of a budget file, every head and every budget level, the pairs per query row of
the head's estimated vertical-slash pattern on structured inputs (seed 1000 + layer) at each
length of --lengths; written to --out after every layer, so that a long run resumes where it
stopped (same settings). balance_measure.py --row-pairs FILE and mtrain.balance_batch(row_pairs=,
row_pairs_lengths=) price by it (docs/BALANCE.md, "Pricing on a length grid").

usage: python tools/balance_row_pairs.py --budgets FILE --out FILE
       [--lengths 2048,...] [--levels 0.25,...] [--layers 0-35] [--backend cpu|cuda]
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import sys

_HERE = str(pathlib.Path(__file__).resolve().parent)
if _HERE not in sys.path:
    sys.path.insert(0, _HERE)

from balance_tool.budgets import derive_budgets, read_budgets  # noqa: E402
from balance_tool.row_pairs import FORMAT, measure  # noqa: E402
from balance_tool.runner import Runner  # noqa: E402

LENGTHS = "2048,8192,16384,32768,65536,131072,262144,472448"


def _layers(text: str, num_layers: int) -> list[int]:
    if not text:
        return list(range(num_layers))
    out: list[int] = []
    for part in text.split(","):
        lo, _, hi = part.partition("-")
        out += list(range(int(lo), int(hi or lo) + 1))
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="balance_row_pairs.py", description=__doc__.split("\n\n")[0])
    ap.add_argument("--budgets", required=True, help="MInference budget file (top-k heads)")
    ap.add_argument("--out", required=True, help="the table (JSON); resumed when it exists")
    ap.add_argument("--lengths", default=LENGTHS, help=f"increasing token counts ({LENGTHS})")
    ap.add_argument("--levels", default="0.25,0.5,0.75,1,1.5,2", help="budget scales")
    ap.add_argument("--layers", default="", help="layers to measure, e.g. 0-11,20 (all)")
    ap.add_argument("--backend", default="cpu", choices=("cpu", "cuda"))
    ap.add_argument("--heads", type=int, default=16, help="query heads per layer (16)")
    ap.add_argument("--kv-heads", type=int, default=2, help="kv heads (2)")
    ap.add_argument("--head-dim", type=int, default=128, help="head dim (128)")
    ap.add_argument("--granularity", type=int, default=128, help="block size G (128)")
    a = ap.parse_args(argv)
    lengths = [int(x) for x in a.lengths.split(",")]
    if any(n < 1 for n in lengths) or lengths != sorted(set(lengths)):
        ap.error(f"--lengths {a.lengths}: token counts >= 1, strictly increasing")
    levels = [float(x) for x in a.levels.split(",")]
    budgets = derive_budgets(read_budgets(a.budgets), a.heads, 1)
    if any(b["kind"] != "topk" for row in budgets for b in row):
        ap.error(f"--budgets {a.budgets}: top-p heads depend on their inputs; top-k budgets only")
    layers = _layers(a.layers, len(budgets))
    if any(not 0 <= x < len(budgets) for x in layers):
        ap.error(f"--layers {a.layers}: the budgets have layers 0..{len(budgets) - 1}")
    a.dtype = "bfloat16" if a.backend == "cuda" else "float32"
    a.deterministic, a.clock = True, "wall"
    header = {
        "format": FORMAT,
        "tool": "tools/balance_row_pairs.py",
        "budgets": os.path.basename(a.budgets),
        "backend": a.backend,
        "dtype": a.dtype,
        "inputs": "mtrain_generate_structured, seed 1000 + layer (the mass curves' inputs)",
        "heads": a.heads,
        "kv_heads": a.kv_heads,
        "head_dim": a.head_dim,
        "granularity": a.granularity,
        "levels": levels,
        "lengths": lengths,
        "num_layers": len(budgets),
        "units": "pairs of the estimated pattern / length, per [length][head][level]",
    }
    done: dict[int, object] = {}
    if os.path.exists(a.out):
        with open(a.out) as f:
            old = json.load(f)
        diff = [k for k in header if k != "tool" and old.get(k) != header[k]]
        if diff:
            ap.error(f"--out {a.out} holds another setting ({', '.join(diff)}); remove it first")
        done = {int(k): v for k, v in old["layers_done"].items()}

    def save(table: dict) -> None:
        tmp = a.out + ".tmp"
        with open(tmp, "w") as f:
            json.dump(table, f)
        os.replace(tmp, a.out)

    measure(budgets, layers, lengths, levels, a.granularity, Runner(a), header, done, save, print)


if __name__ == "__main__":
    main()
