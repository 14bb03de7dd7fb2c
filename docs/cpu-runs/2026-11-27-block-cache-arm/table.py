"""The table of docs/TRAINING.md's CPU comparison of the block arm's pattern cache, from this
folder's refresh-*.json (python docs/cpu-runs/2026-11-27-block-cache-arm/table.py)."""

from __future__ import annotations

import json
import statistics
from pathlib import Path


def main() -> None:
    """Prints one Markdown row per run, in file-name order."""
    here = Path(__file__).parent
    print(
        "| run | K | steps | refreshes | measures | drop mean (layer 0 / 1) | worst drop | "
        "select s per step (refresh / reuse) | median step s | tokens/s (median) | "
        "tokens/s (amortised) | final loss | MQAR / passkey |"
    )
    print("|" + "---|" * 13)
    for f in sorted(here.glob("refresh-*.json")):
        r = json.loads(f.read_text())
        c = r["block_cache"]
        ms = c["measures"]

        def layer(i: int, ms: list[dict] = ms) -> str:
            d = [m["drop"] for m in ms if m["layer"] == i]
            return f"{statistics.mean(d):.4f}" if d else "-"

        drop = "-" if c["drop_mean"] is None else f"{c['drop_mean']:.4f} ({layer(0)} / {layer(1)})"
        worst = "-" if c["drop_max"] is None else f"{c['drop_max']:.4f}"
        reuse = c["select_s_reuse_mean"]
        sel = f"{c['select_s_refresh_mean']:.4f} / " + ("-" if reuse is None else f"{reuse:.4f}")
        ev = r["eval"]
        print(
            f"| {f.stem} | {c['refresh_every']} | {c['steps']} | {c['refreshes']} | {len(ms)} | "
            f"{drop} | {worst} | {sel} | {r['step_s_median']:.3f} | {r['tokens_per_s']:.0f} | "
            f"{c['tokens_per_s_mean']:.0f} | {r['final_loss']:.4f} | "
            f"{ev['mqar']['overall']:.3f} / {ev['passkey']['overall']:.3f} |"
        )


if __name__ == "__main__":
    main()
