# The budgets of tools/balance_measure.py: the file's heads read, derived (heads picked, counts
# divided) and written back, and the per-head budgets one call runs with (the predictor's scaling).

from __future__ import annotations

import ctypes
import json
import math
import os
from collections.abc import Sequence
from typing import Any

import mtrain
from mtrain import _lib as L


def read_budgets(path: str) -> list[list[L.HeadBudget]]:
    """Every layer's head budgets, as the library reads the file."""
    lib = L.lib()
    handle = ctypes.c_void_p()
    L.check(lib.budgets_read(os.fsencode(path), ctypes.byref(handle)), f"budgets {path}")
    try:
        layers = []
        for layer in range(int(lib.budgets_num_layers(handle))):
            heads = []
            for h in range(int(lib.budgets_num_heads(handle, layer))):
                hb = L.HeadBudget()
                L.check(lib.budgets_get(handle, layer, h, ctypes.byref(hb)), "budgets")
                heads.append(hb)
            layers.append(heads)
        return layers
    finally:
        lib.budgets_destroy(handle)


def _div(x: int, scale: int) -> int:
    return 0 if x <= 0 else max(1, (x + scale // 2) // scale)


def derive_budgets(
    layers: list[list[L.HeadBudget]], heads: int, divide: int
) -> list[list[dict[str, Any]]]:
    """heads evenly spaced heads of every layer (all when heads is the file's count), counts
    (top-k sizes, top-p caps) divided by `divide` (rounded, at least 1)."""
    out = []
    for li, layer in enumerate(layers):
        if heads > len(layer):
            raise SystemExit(
                f"balance_measure: --heads {heads} but layer {li} of the budgets has {len(layer)}"
            )
        pick = [h * len(layer) // heads for h in range(heads)]
        row = []
        for h in pick:
            b = layer[h]
            if b.kind == L.BUDGET_TOP_K:
                row.append(
                    {"kind": "topk", "v": _div(b.v_size, divide), "s": _div(b.s_size, divide)}
                )
            else:
                row.append(
                    {
                        "kind": "topp",
                        "p_v": b.p_v,
                        "p_s": b.p_s,
                        "cap_v": _div(b.cap_v, divide),
                        "cap_s": _div(b.cap_s, divide),
                    }
                )
        out.append(row)
    return out


def write_budgets(budgets: list[list[dict[str, Any]]], path: str) -> None:
    """The MInference budget format (core/formats/budgets.c)."""
    doc = []
    for layer in budgets:
        row: dict[str, Any] = {}
        for h, b in enumerate(layer):
            if b["kind"] == "topk":
                row[str(h)] = ["vertical_and_slash", b["v"], b["s"], 0.0]
            else:
                row[str(h)] = [
                    "flex_vertical_and_slash",
                    [b["p_v"], b["cap_v"]],
                    [b["p_s"], b["cap_s"]],
                    0.0,
                ]
        doc.append(row)
    with open(path, "w") as f:
        json.dump(doc, f)


def _scaled(x: int, scale: float) -> int:
    """core/balance/predict.c's scaled(): x times a level's scale, rounded, at least 1."""
    if x <= 0:
        return 0
    return max(1, math.floor(x * scale + 0.5))


def _context(x: int, n: int, budget_context: int) -> int:
    """position_model.c's scale(): x * n / budget_context rounded to nearest."""
    return int(x * n / budget_context + 0.5) if budget_context > 0 else x


def head_budgets(
    layer: list[dict[str, Any]], scales: Sequence[float], n: int, budget_context: int
) -> list[Any]:
    """The budgets one call runs with: each head's counts times its level's scale (as the
    predictor scales them), then by n / budget_context when that is set."""
    out: list[Any] = []
    for b, s in zip(layer, scales, strict=True):
        if b["kind"] == "topk":
            v = _context(_scaled(b["v"], s), n, budget_context)
            sl = _context(_scaled(b["s"], s), n, budget_context)
            out.append(mtrain.TopK(v, max(sl, 1)))
        else:
            cv = _context(_scaled(b["cap_v"], s), n, budget_context)
            cs = _context(_scaled(b["cap_s"], s), n, budget_context)
            out.append(mtrain.TopP(b["p_v"], b["p_s"], cv, max(cs, 1)))
    return out


def base_scale(levels: Sequence[float], bounds: tuple[float, float] | None) -> float:
    """The level a split document runs at: 1 clamped into the bounds (as the solver does)."""
    if bounds is None or bounds[0] <= 1.0 <= bounds[1]:
        return 1.0
    inside = [s for s in levels if bounds[0] <= s <= bounds[1]]
    return inside[0] if bounds[0] > 1.0 else inside[-1]
