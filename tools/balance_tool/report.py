# The report of tools/balance_measure.py: the statistics of the measured and predicted rank
# times, the printed tables and spreads, and the device's name.

from __future__ import annotations

import argparse
import os
import statistics
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch


def _stats(xs: Sequence[float]) -> dict[str, float]:
    mx, mean = max(xs), sum(xs) / len(xs)
    return {"max": mx, "mean": mean, "max_over_mean": mx / mean if mean > 0 else float("nan")}


def _device_name(backend: str) -> str:
    if backend == "cuda":
        return torch.cuda.get_device_name()
    threads = os.environ.get("MTRAIN_NUM_THREADS", "unset")
    return f"cpu ({os.cpu_count()} logical cores, MTRAIN_NUM_THREADS={threads})"


def repetition_spread(
    a: argparse.Namespace, meas: dict[tuple, dict[str, Any]], say: Callable[[str], None]
) -> dict[str, float] | None:
    """The spread of every point's timed runs (with --reps >= 2), and the plans' computed pairs
    against the predictor's (printed)."""
    noise = None
    if a.reps >= 2:
        spread_r = sorted(max(m["reps_s"]) / min(m["reps_s"]) for m in meas.values())
        noise = {
            "median": statistics.median(spread_r),
            "max": spread_r[-1],
            "share_above_1.2": sum(x > 1.2 for x in spread_r) / len(spread_r),
        }
        say(
            f"repetition spread (max/min of the {a.reps} timed runs of a point): median "
            f"{noise['median']:.3f}x, max {noise['max']:.3f}x, "
            f"{100 * noise['share_above_1.2']:.0f}% of the points above 1.2x"
        )
    ratios = [
        m["computed_pairs"] / m["predicted_pairs"] for m in meas.values() if m["predicted_pairs"]
    ]
    say(
        f"pairs: the plans computed {min(ratios):.3f}-{max(ratios):.3f}x the pairs the predictor "
        "counts (every measured point)"
    )
    return noise


def _errors(pred: np.ndarray, meas_s: np.ndarray, prefix: str) -> dict[str, Any]:
    """pred / measured - 1 per rank, its mean and largest |value|, and the largest shape error
    (rank / mean, predicted against measured: what a calibration's scale cannot fix)."""
    err = pred / meas_s - 1
    shape_err = (pred / pred.mean()) / (meas_s / meas_s.mean()) - 1
    return {
        f"{prefix}rel_error": err.tolist(),
        f"{prefix}rel_error_max_abs": float(np.abs(err).max()),
        f"{prefix}rel_error_mean_abs": float(np.abs(err).mean()),
        f"{prefix}shape_error_max_abs": float(np.abs(shape_err).max()),
    }


def add_stats(out_methods: dict[str, Any]) -> None:
    """Every method's max / mean, step ratio against tokens and prediction errors: the errors
    (rel_error, shape_error) of the proxy prediction (the measured layers, as measured), and
    all_layers_* of mtrain.balance_batch's prediction over every layer."""
    tok = out_methods["tokens"]
    tok_meas, tok_pred, tok_proxy = (max(tok[k]) for k in ("measured_s", "predicted_s", "proxy_s"))
    for m in out_methods.values():
        pred, meas_s = np.asarray(m["predicted_s"]), np.asarray(m["measured_s"])
        proxy = np.asarray(m["proxy_s"])
        m.update(
            {
                "predicted": _stats(pred.tolist()),
                "proxy": _stats(proxy.tolist()),
                "measured": _stats(meas_s.tolist()),
                "predicted_step_ratio_vs_tokens": tok_pred / pred.max(),
                "proxy_step_ratio_vs_tokens": tok_proxy / proxy.max(),
                "measured_step_ratio_vs_tokens": tok_meas / meas_s.max(),
                **_errors(proxy, meas_s, ""),
                **_errors(pred, meas_s, "all_layers_"),
            }
        )


def print_tables(
    a: argparse.Namespace,
    out_methods: dict[str, Any],
    factor: float,
    grid_report: list[dict[str, Any]],
    say: Callable[[str], None],
) -> None:
    """The per-rank lines, the summary table, the split note and the grid's checks."""
    say("")
    say(
        "per rank: predicted seconds (mtrain.balance_batch, all layers) | proxy (the predictor's "
        f"seconds of what is measured: layers {a.layers} x {factor:.3g}"
        + (" + linear" if a.linear else "")
        + ", at the rank's head scales) | measured seconds (the same layers timed"
        + (" + linear" if a.linear else ", attention only")
        + ") | error = proxy / measured - 1 (all layers: predicted / measured - 1)"
    )
    for method, m in out_methods.items():
        say(f"{method}:")
        for r in range(a.world):
            say(
                f"  rank {r:3d}: {m['documents'][r]:5d} docs {m['tokens'][r]:9d} tokens  predicted "
                f"{m['predicted_s'][r]:10.4f} s  proxy {m['proxy_s'][r]:10.4f} s  measured "
                f"{m['measured_s'][r]:10.4f} s  error {100 * m['rel_error'][r]:+7.1f}% (all "
                f"layers {100 * m['all_layers_rel_error'][r]:+7.1f}%)"
            )
    say("")
    say(
        "| method | predicted max/mean | predicted step ratio | proxy max/mean | proxy step ratio "
        "| measured max/mean | measured step ratio | error mean abs | error max abs | shape error "
        "max abs | all-layers error max abs | split documents |"
    )
    say("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for method, m in out_methods.items():
        say(
            f"| {method} | {m['predicted']['max_over_mean']:.3f} | "
            f"{m['predicted_step_ratio_vs_tokens']:.3f}x | {m['proxy']['max_over_mean']:.3f} | "
            f"{m['proxy_step_ratio_vs_tokens']:.3f}x | {m['measured']['max_over_mean']:.3f} | "
            f"{m['measured_step_ratio_vs_tokens']:.3f}x | {100 * m['rel_error_mean_abs']:.1f}% | "
            f"{100 * m['rel_error_max_abs']:.1f}% | {100 * m['shape_error_max_abs']:.1f}% | "
            f"{100 * m['all_layers_rel_error_max_abs']:.1f}% | {m['split_documents']} |"
        )
    if any(m["split_documents"] for m in out_methods.values()):
        say(
            "split documents: each of their k ranks is charged the document's measured time / k; "
            "the ring's overhead (transfers, waits inside the ring) is NOT measured by this tool "
            "(nor in the proxy; the all-layers prediction has the ring overhead factor)"
        )
    for g in grid_report:
        for c in g["checks"]:
            say(
                f"grid layer {g['layer']} ({g['lengths']} lengths, {len(g['grid'])} measured): "
                f"N {c['tokens']} interpolated {c['interpolated_s']:.4g} s measured "
                f"{c['measured_s']:.4g} s error {100 * c['rel_error']:+.1f}%"
            )


def per_document_spread(
    a: argparse.Namespace, meas: dict[tuple, dict[str, Any]], say: Callable[[str], None]
) -> dict[str, Any]:
    """Top-p: every measured layer's spread of the documents' seconds and densities."""
    spread = {}
    for layer in a.layers:
        ts = [r["step_s"] for k, r in meas.items() if k[2] == layer]
        ds = [r["density"] for k, r in meas.items() if k[2] == layer]
        spread[str(layer)] = {
            "documents": len(ts),
            "seconds_min": min(ts),
            "seconds_median": statistics.median(ts),
            "seconds_max": max(ts),
            "seconds_cv": statistics.pstdev(ts) / statistics.mean(ts),
            "density_min": min(ds),
            "density_median": statistics.median(ds),
            "density_max": max(ds),
            "pearson_seconds_density": float(np.corrcoef(ts, ds)[0, 1])
            if len(ts) > 1 and np.std(ds) > 0 and np.std(ts) > 0
            else float("nan"),
        }
        s = spread[str(layer)]
        say(
            f"per-document spread, layer {layer}: {len(ts)} documents, seconds "
            f"{s['seconds_min']:.4g} / {s['seconds_median']:.4g} / {s['seconds_max']:.4g} "
            f"(min / median / max, cv {s['seconds_cv']:.3f}), density {s['density_min']:.4f} / "
            f"{s['density_median']:.4f} / {s['density_max']:.4f}; Pearson(seconds, density) "
            f"{s['pearson_seconds_density']:.2f}"
        )
    return spread
