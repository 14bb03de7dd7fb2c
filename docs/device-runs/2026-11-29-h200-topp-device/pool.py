"""Pools the 32K passkey results of the two result files of 2026-11-29 (docs/TRAINING.md, "Top-p
selected on the device"): every run of dense and of mtrain-topp with the sinks and the window
forced, at 32768 tokens, from call T1's weights; prints each run, then per arm the mean, the
sample standard deviation, the standard error, and the ratio of the means to dense's with its
standard error (first order). Run from the repository root: python3 <this file>."""

from __future__ import annotations

import json
import math
from pathlib import Path

HERE = Path(__file__).resolve().parent
FILES = (HERE.parent / "2026-11-29-h200-topp-forced" / "results.json", HERE / "results.json")


def arm_of(run: dict) -> str:
    arm = run["arm"]
    if arm["arm"] != "mtrain-topp":
        return arm["arm"]
    return f"mtrain-topp p {arm['budgets']['TopP'][0]}"


def main() -> None:
    pooled: dict[str, list[float]] = {}
    for f in FILES:
        for run in json.loads(f.read_text())["runs"]:
            if not run.get("eval") or run["config"]["seq_len"] != 32768 or run["steps"] == []:
                continue
            if run["config"]["steps"] == 0:  # the zero-shot evaluations
                continue
            acc = run["eval"]["passkey"]["overall"]
            name = arm_of(run)
            seed, step = run["config"]["data_seed"], run["step_s_median"]
            print(
                f"{f.parent.name:32s} {run['name']:40s} {name:20s} seed {seed} "
                f"passkey {acc:.4f} step {step:.4f} s"
            )
            pooled.setdefault(name, []).append(acc)
    stats = {}
    for name, xs in pooled.items():
        n = len(xs)
        mean = sum(xs) / n
        sd = math.sqrt(sum((x - mean) ** 2 for x in xs) / (n - 1)) if n > 1 else float("nan")
        stats[name] = (n, mean, sd, sd / math.sqrt(n))
    tp = [x for k, xs in pooled.items() if k.startswith("mtrain-topp") for x in xs]
    n = len(tp)
    mean = sum(tp) / n
    sd = math.sqrt(sum((x - mean) ** 2 for x in tp) / (n - 1))
    stats["mtrain-topp, both p"] = (n, mean, sd, sd / math.sqrt(n))
    _, d_mean, _, d_se = stats["dense"]
    for name, (n, mean, sd, se) in stats.items():
        ratio = mean / d_mean
        ratio_se = ratio * math.sqrt((se / mean) ** 2 + (d_se / d_mean) ** 2)
        print(
            f"{name:22s} runs {n}  mean {mean:.4f}  sd {sd:.4f}  se {se:.4f}  "
            f"of dense {100 * ratio:.1f}% (se {100 * ratio_se:.1f} points)"
        )


if __name__ == "__main__":
    main()
