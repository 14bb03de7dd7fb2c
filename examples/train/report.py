"""Charts and a table from results JSON files (written by python -m
examples.train): loss curves of all runs in one chart, a heatmap of the final
accuracy per bucket for each task, and a Markdown table on stdout. Needs
matplotlib (examples/train/requirements.txt).

    python -m examples.train.report results/*.json --out-dir results/
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
from pathlib import Path
from typing import Any


def load(paths: list[str]) -> list[dict[str, Any]]:
    runs = []
    for p in paths:
        r = json.loads(Path(p).read_text())
        # a context-parallel run is told from the single-GPU run of the same name
        world = int(r.get("world_size", 1))
        r["_label"] = Path(p).stem + (f" (cp{world})" if world > 1 else "")
        runs.append(r)
    return runs


def smooth(xs: list[float], k: int) -> list[float]:
    out, acc = [], 0.0
    for i, x in enumerate(xs):
        acc += x
        if i >= k:
            acc -= xs[i - k]
        out.append(acc / min(i + 1, k))
    return out


def loss_chart(runs: list[dict[str, Any]], path: Path, window: int) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5))
    for r in runs:
        if not r["steps"]:  # an evaluation only (--steps 0)
            continue
        steps = [s["step"] for s in r["steps"]]
        ax.plot(steps, smooth([s["loss"] for s in r["steps"]], window), label=r["_label"])
    ax.set_xlabel("step")
    ax.set_ylabel(f"loss on answer tokens (moving mean of {window})")
    ax.set_yscale("log")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def heatmaps(runs: list[dict[str, Any]], out_dir: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = []
    tasks = sorted({t for r in runs for t in r["eval"]})
    # every task's buckets, then MQAR's by the distance to the nearest copy of the key (runs
    # written before that bucketing existed have none and are left out of its chart)
    views = [(t, "") for t in tasks] + [
        (t, "nearest") for t in tasks if any("nearest" in r["eval"].get(t, {}) for r in runs)
    ]
    for task, view in views:

        def of(r: dict[str, Any], task: str = task, view: str = view) -> dict[str, Any]:
            e = r["eval"][task]
            return e[view] if view else e

        rows = [r for r in runs if task in r["eval"] and (not view or view in r["eval"][task])]
        # runs of several lengths: MQAR's distance buckets of a shorter run are a prefix of a
        # longer run's; the grid takes the longest list and leaves the rest blank
        buckets = max((of(r)["buckets"] for r in rows), key=len)
        grid = [[float("nan") if a is None else a for a in of(r)["accuracy"]] for r in rows]
        grid = [row + [float("nan")] * (len(buckets) - len(row)) for row in grid]
        fig, ax = plt.subplots(figsize=(1.2 + 0.9 * len(buckets), 1.2 + 0.5 * len(rows)))
        im = ax.imshow(grid, vmin=0, vmax=1, cmap="viridis", aspect="auto")
        ax.set_xticks(range(len(buckets)), buckets, rotation=45, ha="right")
        ax.set_yticks(range(len(rows)), [r["_label"] for r in rows])
        for i, row in enumerate(grid):
            for j, a in enumerate(row):
                if not math.isnan(a):
                    ax.text(j, i, f"{a:.2f}", ha="center", va="center", fontsize=8, color="w")
        what = "distance (tokens)" if task == "mqar" else "needle depth"
        if view:
            what = "distance to the nearest earlier copy of the key (tokens)"
        ax.set_xlabel(f"{task}: {what}")
        ax.set_title(f"{task} accuracy per bucket (chance {rows[0]['eval'][task]['chance']:.2f})")
        fig.colorbar(im, ax=ax)
        fig.tight_layout()
        p = out_dir / (f"accuracy_{task}_{view}.png" if view else f"accuracy_{task}.png")
        fig.savefig(p, dpi=120)
        plt.close(fig)
        paths.append(p)
    return paths


def table(runs: list[dict[str, Any]]) -> str:
    tasks = sorted({t for r in runs for t in r["eval"]})
    head = ["run", "ranks", "final loss", "tokens/s", "attention share", "density", "recall"]
    head += ["peak GiB"]
    head += [f"{t} acc" for t in tasks]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in runs:
        probes = r["probes"]
        shares = [p["attention_share"] for p in probes if p["attention_share"] is not None]
        layers = [x for p in probes for x in p["layers"].values()]
        dens = statistics.mean(x["density"] for x in layers) if layers else None
        rec = statistics.mean(x["recall"] for x in layers) if layers else None
        mem = r.get("peak_memory_bytes")
        cells = [
            r["_label"],
            str(r.get("world_size", 1)),  # context parallel: tokens/s of all ranks together
            f"{r['final_loss']:.4f}" if r["final_loss"] is not None else "- (no steps)",
            f"{r['tokens_per_s']:.0f}" if r["tokens_per_s"] else "-",
            f"{statistics.median(shares):.0%}" if shares else "-",
            f"{dens:.3f}" if dens is not None else "1 (dense)",
            f"{rec:.3f}" if rec is not None else "-",
            f"{mem / 2**30:.1f}" if mem else "-",
        ]
        cells += [f"{r['eval'][t]['overall']:.3f}" if t in r["eval"] else "-" for t in tasks]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def cache_table(runs: list[dict[str, Any]]) -> str:
    """The runs of the block arm through the pattern cache (--block-refresh): refreshes, the
    measured recall drop (mean and worst), tokens/s (median step and amortised); "" if none."""
    head = ["run", "refresh K", "steps", "refreshes", "measures", "mean drop", "worst drop"]
    head += ["select s/step (refresh, reuse)", "tokens/s (median)", "tokens/s (amortised)"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in runs:
        c = r.get("block_cache")
        if not c:
            continue
        lines.append(
            "| " + " | ".join([
                r["_label"], str(c["refresh_every"]), str(c["steps"]), str(c["refreshes"]),
                str(len(c["measures"])), _num(c["drop_mean"], ".4f"), _num(c["drop_max"], ".4f"),
                f"{_num(c.get('select_s_refresh_mean'), '.4f')}, "
                f"{_num(c.get('select_s_reuse_mean'), '.4f')}",
                _num(r["tokens_per_s"], ".0f"), _num(c["tokens_per_s_mean"], ".0f"),
            ]) + " |"
        )  # fmt: skip
    return "\n".join(lines) if len(lines) > 2 else ""


def _num(x: float | None, fmt: str) -> str:
    return "-" if x is None else format(x, fmt)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m examples.train.report", description=__doc__)
    p.add_argument("results", nargs="+", help="results JSON files")
    p.add_argument("--out-dir", default=".", help="where the PNG charts go")
    p.add_argument("--smooth", type=int, default=10, help="moving-mean window of the loss chart")
    args = p.parse_args(argv)
    runs = load(args.results)
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    loss_chart(runs, out / "loss.png", args.smooth)
    charts = [out / "loss.png", *heatmaps(runs, out)]
    print(table(runs))
    cached = cache_table(runs)
    if cached:
        print("\nblock pattern cache (--block-refresh):\n\n" + cached)
    print("\ncharts: " + ", ".join(str(c) for c in charts))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
