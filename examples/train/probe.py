"""Measurements inside the attention, on the steps the trainer asks for
(PROBE.active): the wall time of the attention's forward and backward
(synchronised timing hooks around every attention call; the rest of the step
is the remainder), and the pattern of each layer (density, and the recall of
the dense attention mass by the pattern on sampled query rows; for a block
selection also its own recall of its scores). Off, the
wrapper costs one flag test per call."""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch

import mtrain


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@dataclass
class Probe:
    active: bool = False
    rows: int = 64  # query rows sampled for the recall
    fwd_s: float = 0.0
    bwd_s: float = 0.0
    stats_s: float = 0.0  # spent on the pattern statistics (not part of the step)
    stats: bool = True
    _fwd_t0: float = 0.0
    _bwd_t0: list[float] = field(default_factory=list)
    layers: dict[int, dict[str, float]] = field(default_factory=dict)

    def start(self, stats: bool) -> None:
        self.active, self.stats = True, stats
        self.fwd_s = self.bwd_s = self.stats_s = 0.0
        self._bwd_t0 = []
        self.layers = {}

    def stop(self) -> None:
        self.active = False

    # -- timing ------------------------------------------------------------
    def enter(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> Any:
        sync(q.device)
        self._fwd_t0 = time.perf_counter()
        return _BwdEnd.apply(self, q, k, v)

    def leave(self, out: torch.Tensor) -> torch.Tensor:
        sync(out.device)
        self.fwd_s += time.perf_counter() - self._fwd_t0
        return _BwdStart.apply(self, out)

    # -- the pattern ---------------------------------------------------------
    @torch.no_grad()
    def pattern_stats(
        self,
        arm: Any,
        module: torch.nn.Module,
        q: torch.Tensor,
        k: torch.Tensor,
        scale: Any,
        info: Any = None,
    ) -> None:
        """q, k: [B, H, N, d] as transformers hands them; under context
        parallel this rank's slots, ``info`` their mtrain DispatchInfo (every
        rank makes the same collective calls here)."""
        if not self.stats:
            return
        sync(q.device)
        t0 = time.perf_counter()
        try:
            self._pattern_stats(arm, module, q, k, scale, info)
        finally:
            sync(q.device)
            self.stats_s += time.perf_counter() - t0

    def _pattern_stats(
        self,
        arm: Any,
        module: torch.nn.Module,
        q: torch.Tensor,
        k: torch.Tensor,
        scale: Any,
        info: Any,
    ) -> None:
        qt = q.transpose(1, 2).contiguous()
        kt = k.transpose(1, 2).contiguous()
        patterns = arm.plan_of(qt, kt, info)
        if patterns is None:
            return
        if info is not None:
            # the recall reads whole sequences: every rank's slots, in global order
            qt, kt = mtrain.undispatch(qt, info), mtrain.undispatch(kt, info)
        layer = int(getattr(module, "layer_idx", len(self.layers)))
        density = sum(p.density() for p in patterns) / len(patterns)
        sc = float(scale) if scale is not None else q.shape[-1] ** -0.5
        rec = recall(qt[0], kt[0], patterns[0], self.rows, sc)
        self.layers[layer] = {"density": density, "recall": rec}
        scored = getattr(arm, "scored_recall", None)
        if scored is not None:
            # the block selection's own recall of its scores (antidiag: of its estimate)
            self.layers[layer]["scored_recall"] = scored


class Capture:
    """Hands each layer's post-RoPE q and k ([N, H, d], float32 on the CPU, the first sequence of
    the batch) to whoever asked, while ``taking()`` is open (the tuner's mass curves, tune.py).
    Off, the attention wrapper pays one flag test."""

    def __init__(self) -> None:
        self.active = False
        self.taken: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    @contextmanager
    def taking(self) -> Iterator[dict[int, tuple[torch.Tensor, torch.Tensor]]]:
        self.active, self.taken = True, {}
        try:
            yield self.taken
        finally:
            self.active = False

    def take(self, module: torch.nn.Module, q: torch.Tensor, k: torch.Tensor) -> None:
        """q, k: [B, H, N, d] as transformers hands them."""
        layer = int(getattr(module, "layer_idx", len(self.taken)))
        self.taken[layer] = (
            q[0].transpose(0, 1).detach().float().cpu().contiguous(),
            k[0].transpose(0, 1).detach().float().cpu().contiguous(),
        )


CAPTURE = Capture()


def recall(q: torch.Tensor, k: torch.Tensor, pattern: Any, rows: int, scale: float) -> float:
    """The share of the dense causal attention mass that falls inside the
    pattern, averaged over heads and over `rows` query rows spread evenly over
    the sequence (q [N, Hq, d], k [N, Hkv, d], one sequence)."""
    n, hq, _ = q.shape
    g = pattern.granularity
    group = hq // k.shape[1]
    i = torch.linspace(0, n - 1, min(rows, n), device=q.device).round().long().unique()
    j = torch.arange(n, device=q.device)
    qb, kb = (i // g)[:, None], (j // g)[None, :]
    causal = j[None, :] <= i[:, None]
    total = 0.0
    for h in range(hq):
        if pattern.is_block_mask(h):
            blocks = pattern.block_mask(h).to(q.device)
            allowed = blocks[qb, kb] & (qb >= kb)
        else:
            diagonals, verticals = pattern.head(h)
            on = torch.zeros(pattern.num_blocks + 1, dtype=torch.bool, device=q.device)
            on[torch.tensor(diagonals, dtype=torch.long, device=q.device)] = True
            allowed = on[(qb - kb).clamp(min=0, max=pattern.num_blocks)] & (qb >= kb)
            if verticals:
                vert = torch.zeros(n, dtype=torch.bool, device=q.device)
                vert[torch.tensor(verticals, dtype=torch.long, device=q.device)] = True
                allowed |= vert[None, :] & (kb < qb)
        s = (q[i, h].float() @ k[:, h // group].float().T) * scale
        p = torch.softmax(s.masked_fill(~causal, float("-inf")), dim=-1)
        total += float((p * (allowed & causal)).sum(-1).mean())
    return total / hq


class _BwdEnd(torch.autograd.Function):
    """Identity on q, k, v; its backward runs when their gradients are ready:
    the end of the attention's backward."""

    @staticmethod
    def forward(ctx: Any, probe: Probe, *xs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        ctx.probe = probe
        return tuple(x.view_as(x) for x in xs)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[Any, ...]:
        p: Probe = ctx.probe
        g = next(x for x in grads if x is not None)
        sync(g.device)
        if p._bwd_t0:
            p.bwd_s += time.perf_counter() - p._bwd_t0.pop()
        return (None, *grads)


class _BwdStart(torch.autograd.Function):
    """Identity on the attention's output; its backward marks the start of
    the attention's backward."""

    @staticmethod
    def forward(ctx: Any, probe: Probe, out: torch.Tensor) -> torch.Tensor:
        ctx.probe = probe
        return out.view_as(out)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[None, torch.Tensor]:
        sync(grad.device)
        ctx.probe._bwd_t0.append(time.perf_counter())
        return None, grad


PROBE = Probe()
