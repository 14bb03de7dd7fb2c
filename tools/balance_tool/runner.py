# The timed work of tools/balance_measure.py: structured inputs on the device and one layer's
# training-step attention (estimate, forward, backward) or linear layers, timed by the chosen clock.

from __future__ import annotations

import argparse
import ctypes
import math
import statistics
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

import mtrain
from mtrain import _lib as L
from mtrain._lib import StructuredOptions

from .workload import scale_length


def doc_seed(doc: int, layer: int, per_document: bool) -> int:
    """A document's inputs: seed 1 + document; with top-p budgets (every document measured on
    its own inputs) also a different input per layer."""
    return 1 + doc + (1000003 * layer if per_document else 0)


class Runner:
    """Builds inputs and times one layer's training-step attention on the chosen device."""

    def __init__(self, a: argparse.Namespace) -> None:
        # --replay times nothing; what it computes (mass curves) runs on the host
        replay = getattr(a, "replay", None)
        self.device = torch.device("cuda" if a.backend == "cuda" and not replay else "cpu")
        self.dtype = {
            "float32": torch.float32,
            "bfloat16": torch.bfloat16,
            "float16": torch.float16,
        }[a.dtype]
        self.hq, self.hkv, self.d = a.heads, a.kv_heads, a.head_dim
        self.granularity = a.granularity
        self.deterministic = a.deterministic
        self._inputs: dict[tuple[int, int], list[torch.Tensor]] = {}
        # wall: time.perf_counter (synchronised); process: this process's CPU seconds (cpu
        # backend: what the work costs, whatever else runs on the machine)
        self.clock: Callable[[], float] = (
            time.process_time if a.clock == "process" else time.perf_counter
        )

    def sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize()

    def inputs(
        self, n: int, seed: int, vary: bool, keep: bool = True, dout: bool = True
    ) -> list[torch.Tensor]:
        """q, k, v (mtrain_generate_structured, seed; with vary the structure's strengths drawn
        from the seed too) and a dout of normal noise (q, k and v only without dout), on the
        device in the chosen dtype."""
        key = (n, seed if not vary else -seed - 1)
        if key in self._inputs and (len(self._inputs[key]) == 4 or not dout):
            return self._inputs[key]
        if keep:
            self._inputs.clear()  # one input set at a time: device memory
        opts = StructuredOptions(seed, 10000.0, 2.0, 4, 16, 4.0)
        if vary:
            rng = np.random.default_rng(seed)
            opts.mean_strength = float(rng.uniform(0.5, 3.0))
            opts.num_outliers = int(rng.integers(2, 33))
            opts.outlier_strength = float(rng.uniform(2.0, 6.0))
        q = torch.empty(n, self.hq, self.d, dtype=torch.float32)
        k = torch.empty(n, self.hkv, self.d, dtype=torch.float32)
        v = torch.empty(n, self.hkv, self.d, dtype=torch.float32)
        fn = L.lib().dll.mtrain_generate_structured
        fn.restype = ctypes.c_int
        fn.argtypes = [ctypes.c_void_p] * 4
        ts = [
            L.Tensor(t.data_ptr(), L.F32, 3, (ctypes.c_int64 * 4)(*t.shape, 0)) for t in (q, k, v)
        ]
        L.check(fn(ctypes.byref(opts), *(ctypes.byref(t) for t in ts)), "structured inputs")
        parts = [q, k, v]
        if dout:
            g = torch.Generator().manual_seed(seed + 7)
            parts.append(torch.randn(n, self.hq, self.d, generator=g))
        out = [t.to(device=self.device, dtype=self.dtype) for t in parts]
        if keep:
            self._inputs[key] = out
        return out

    def forget(self) -> None:
        self._inputs.clear()

    def step(self, inp: list[torch.Tensor], budgets: list[Any]) -> tuple[float, float, int]:
        """One training-step attention: estimate, forward, backward. Returns (estimate s,
        forward+backward s, computed pairs); synchronised on the device."""
        q, k, v, do = inp
        qg, kg, vg = (t.detach().requires_grad_(True) for t in (q, k, v))
        self.sync()
        t0 = self.clock()
        plan = mtrain.estimate_pattern(
            q, k, budgets, granularity=self.granularity, deterministic=self.deterministic
        )
        self.sync()
        t1 = self.clock()
        out = mtrain.attention(qg, kg, vg, pattern=plan, deterministic=self.deterministic)
        out.backward(do)
        self.sync()
        t2 = self.clock()
        return t1 - t0, t2 - t1, int(plan.computed_pairs)

    def measure(
        self, n: int, budgets: list[Any], seed: int, vary: bool, reps: int, warmup: int
    ) -> dict[str, Any]:
        inp = self.inputs(n, seed, vary)
        runs = [self.step(inp, budgets) for _ in range(warmup + reps)][warmup:]
        tot = [e + f for e, f, _ in runs]
        return {
            "tokens": n,
            "estimate_s": statistics.median(e for e, _, _ in runs),
            "fwdbwd_s": statistics.median(f for _, f, _ in runs),
            "step_s": statistics.median(tot),
            "reps_s": tot,
            "density": runs[-1][2] / (n * (n + 1) / 2 * self.hq),
        }

    def linear(self, n: int, shapes: list[tuple[int, int]], reps: int, warmup: int) -> float:
        """Median seconds of forward + backward of x[n, a] @ W[a, b] for every (a, b)."""
        ws = [torch.randn(a, b, device=self.device, dtype=self.dtype) * a**-0.5 for a, b in shapes]
        xs = {a: torch.randn(n, a, device=self.device, dtype=self.dtype) for a, _ in shapes}

        def once() -> float:
            self.sync()
            t0 = self.clock()
            for (a, _), w in zip(shapes, ws, strict=True):
                x = xs[a].detach().requires_grad_(True)
                wg = w.detach().requires_grad_(True)
                y = x @ wg
                y.backward(torch.ones_like(y))
            self.sync()
            return self.clock() - t0

        times = [once() for _ in range(warmup + reps)][warmup:]
        return statistics.median(times)


def linear_seconds(
    a: argparse.Namespace, runner: Runner, lengths: list[int], nl: int, say: Callable[[str], None]
) -> dict[int, float]:
    """--linear: every distinct length's linear layers (nl layers' projections and MLP, the LM
    head), timed up to --linear-chunk (on --grid's log-spaced points when set, log-log between
    them) and in proportion to the tokens above it."""
    linear_s: dict[int, float] = {}
    h, hq, hkv, d = a.hidden, a.heads, a.kv_heads, a.head_dim
    per_layer = [(h, hq * d), (h, hkv * d), (h, hkv * d), (hq * d, h), (h, a.intermediate)]
    per_layer += [(h, a.intermediate), (a.intermediate, h)]
    ns = sorted(set(lengths))
    top = min(ns[-1], a.linear_chunk)
    pts = [n for n in ns if n <= top] + ([top] if ns[-1] > top else [])
    if a.grid and len(pts) > a.grid:  # log-spaced, as the attention's grid
        lo, hi = math.log(pts[0]), math.log(top)
        ticks = (lo + (hi - lo) * j / (a.grid - 1) for j in range(a.grid))
        pts = sorted({scale_length(round(math.exp(x)), 1, a.granularity) for x in ticks})
        pts = sorted(set(pts) | {ns[0], top})
    lin = {}
    for n in pts:
        one = runner.linear(n, per_layer, a.reps, a.warmup)
        head = runner.linear(n, [(h, a.vocab)], a.reps, a.warmup)
        lin[n] = nl * one + head
        say(f"  linear N {n:7d}: {nl} x {1e3 * one:.2f} ms + LM head {1e3 * head:.2f} ms")
    gx = np.log(np.array(pts, dtype=np.float64))
    gy = np.log(np.array([lin[n] for n in pts]))
    for n in ns:  # log-log between the points; proportional to the tokens above the chunk
        t = lin[n] if n in lin else float(np.exp(np.interp(math.log(min(n, top)), gx, gy)))
        linear_s[n] = t * n / top if n > top else t
    return linear_s
