"""The training run: one arm, one model, one data stream; writes the results
JSON (config, per-step loss and time, tokens/s, attention share and pattern
statistics on probed steps, peak memory, accuracy per bucket)."""

from __future__ import annotations

import contextlib
import datetime
import json
import math
import os
import platform
import statistics
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
import transformers

import mtrain

from . import model as M
from .arms import Arm, Budget
from .config import RunConfig
from .evaluate import answer_loss, evaluate
from .probe import PROBE, sync
from .tasks import Task, Vocab, batch, make_task

EVAL_SEED_OFFSET = 10**6


def device_of(cfg: RunConfig) -> torch.device:
    if cfg.device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(cfg.device)


def tasks_of(cfg: RunConfig, vocab: Vocab) -> tuple[list[Task], list[str]]:
    names = ["mqar", "passkey"] if cfg.task == "mix" else [cfg.task]
    kw = {
        "num_pairs": cfg.mqar_pairs,
        "num_queries": cfg.mqar_queries,
        "digits": cfg.passkey_digits,
        "num_buckets": cfg.depth_buckets,
    }
    return [make_task(n, cfg.seq_len, vocab, **kw) for n in names], names


def lr_at(cfg: RunConfig, step: int) -> float:
    if step < cfg.warmup:
        return cfg.lr * (step + 1) / cfg.warmup
    t = (step - cfg.warmup) / max(1, cfg.steps - cfg.warmup)
    return cfg.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * t)))


def measured_density(path: str) -> float:
    """The mean pattern density over the probes of a results JSON (0: none)."""
    if not path:
        return 0.0
    r = json.loads(Path(path).read_text())
    layers = [x["density"] for p in r["probes"] for x in p["layers"].values()]
    if not layers:
        raise ValueError(f"{path} has no pattern density (a dense run?)")
    return statistics.mean(layers)


def probe_steps(cfg: RunConfig) -> set[int]:
    every = cfg.probe_every or max(1, cfg.steps // 8)
    return {s for s in range(cfg.steps) if s % every == every - 1}


def run(cfg: RunConfig, log: Any = print) -> dict[str, Any]:
    dev = device_of(cfg)
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    dtype = cfg.dtype if cfg.dtype != "auto" else ("bfloat16" if dev.type == "cuda" else "float32")
    autocast: Any = (
        torch.autocast(dev.type, dtype=torch.bfloat16)
        if dtype == "bfloat16"
        else contextlib.nullcontext()
    )
    g = cfg.granularity or (128 if dev.type == "cuda" else 64)
    size = M.SIZES[cfg.size]
    vocab = Vocab(cfg.num_keys, cfg.num_values, cfg.num_filler)
    tasks, names = tasks_of(cfg, vocab)
    budget = Budget(
        granularity=g, sinks=cfg.sinks, local_window=cfg.local_window, last_q=cfg.last_q,
        v_frac=cfg.v_frac, s_frac=cfg.s_frac, p_v=cfg.p_v, p_s=cfg.p_s,
        window_blocks=cfg.window_blocks, match_density=measured_density(cfg.match),
    )  # fmt: skip
    arm = Arm(cfg.arm, size.heads, budget)
    arm.set_length(cfg.seq_len)
    model = M.build(size, vocab.size, cfg.seq_len, cfg.rope_theta, arm.attn_name, cfg.seed)
    if cfg.init_from:
        state = torch.load(cfg.init_from, map_location="cpu", weights_only=True)
        model.load_state_dict(state)
        M.set_rope_theta(model, cfg.rope_theta, cfg.seq_len)
    model.to(dev).train()
    decay = [p for n, p in model.named_parameters() if p.ndim >= 2]
    other = [p for n, p in model.named_parameters() if p.ndim < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": other, "weight_decay": 0}],
        lr=cfg.lr,
        betas=(0.9, 0.95),
    )
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats(dev)
    probes = probe_steps(cfg)
    steps: list[dict[str, Any]] = []
    probed: list[dict[str, Any]] = []
    history: list[dict[str, Any]] = []
    tokens = cfg.batch * cfg.seq_len
    log(
        f"arm {cfg.arm}, task {cfg.task}, {cfg.size} ({M.parameters(model) / 1e6:.1f}M "
        f"parameters), {cfg.seq_len} tokens x {cfg.batch}, {cfg.steps} steps, {dev}, {dtype}"
    )
    for step in range(cfg.steps):
        ids, labels, _, _ = _batch(tasks, cfg, step)
        ids, labels = ids.to(dev), labels.to(dev)
        for group in opt.param_groups:
            group["lr"] = lr_at(cfg, step)
        watch = step in probes
        if watch:
            PROBE.start(stats=cfg.arm != "dense")
        sync(dev)
        t0 = time.perf_counter()
        with autocast:
            loss = answer_loss(model, ids, labels)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        value = float(loss.detach())  # synchronises
        sync(dev)
        dt = time.perf_counter() - t0
        steps.append({"step": step, "loss": value, "time_s": dt, "probed": watch})
        if watch:
            PROBE.stop()
            attn = PROBE.fwd_s + PROBE.bwd_s
            net = dt - PROBE.stats_s
            probed.append({
                "step": step,
                "step_s": net,
                "attention_fwd_s": PROBE.fwd_s,
                "attention_bwd_s": PROBE.bwd_s,
                "attention_share": attn / net if net > 0 else None,
                "layers": {str(k): v for k, v in sorted(PROBE.layers.items())},
            })  # fmt: skip
            layers = PROBE.layers.values()
            extra = (
                f", density {statistics.mean(x['density'] for x in layers):.3f}, recall "
                f"{statistics.mean(x['recall'] for x in layers):.3f}"
                if PROBE.layers
                else ""
            )
            log(f"step {step}: loss {value:.4f}, {dt:.3f} s, attention {attn / net:.0%}{extra}")
        if cfg.eval_every and (step + 1) % cfg.eval_every == 0 and step + 1 < cfg.steps:
            ev = evaluate(
                model, tasks, names, cfg.data_seed + EVAL_SEED_OFFSET, cfg.eval_seqs,
                cfg.eval_batch, dev, autocast,
            )  # fmt: skip
            history.append({"step": step + 1, "eval": ev})
            log(f"step {step + 1}: " + ", ".join(f"{k} {v['overall']:.3f}" for k, v in ev.items()))
    final = evaluate(
        model, tasks, names, cfg.data_seed + EVAL_SEED_OFFSET, cfg.eval_seqs, cfg.eval_batch,
        dev, autocast,
    )  # fmt: skip
    log("final accuracy: " + ", ".join(f"{k} {v['overall']:.3f}" for k, v in final.items()))
    plain = [s["time_s"] for s in steps[min(3, len(steps) - 1) :] if not s["probed"]]
    step_s = statistics.median(plain) if plain else None
    results: dict[str, Any] = {
        "config": asdict(cfg),
        "command": [sys.executable, "-m", "examples.train", *sys.argv[1:]],
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "device": torch.cuda.get_device_name(dev)
        if dev.type == "cuda"
        else platform.processor() or platform.machine(),
        "cpu_threads": torch.get_num_threads(),
        "dtype": dtype,
        "versions": {
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "python": platform.python_version(),
            "libmtrain": mtrain.library_path(),
        },
        "model": {**M.describe(size), "parameters": M.parameters(model), "vocab": vocab.size},
        "arm": arm.describe(),
        "tasks": names,
        "tokens_per_step": tokens,
        "steps": steps,
        "step_s_median": step_s,
        "tokens_per_s": tokens / step_s if step_s else None,
        "probes": probed,
        "eval_history": history,
        "eval": final,
        "final_loss": statistics.mean(s["loss"] for s in steps[-max(1, len(steps) // 10) :]),
    }
    if dev.type == "cuda":
        results["peak_memory_bytes"] = torch.cuda.max_memory_allocated(dev)
    if cfg.out:
        Path(cfg.out).parent.mkdir(parents=True, exist_ok=True)
        Path(cfg.out).write_text(json.dumps(results, indent=1) + "\n")
    if cfg.save:
        Path(cfg.save).parent.mkdir(parents=True, exist_ok=True)
        torch.save(model.state_dict(), cfg.save)
    return results


def _batch(tasks: list[Task], cfg: RunConfig, step: int) -> tuple[torch.Tensor, ...]:
    return batch(tasks, cfg.data_seed, step * cfg.batch, cfg.batch)


def main(argv: list[str] | None = None) -> int:
    from .config import from_args

    cfg = from_args(argv)
    os.environ.setdefault("MTRAIN_NUM_THREADS", str(cfg.threads or torch.get_num_threads()))
    run(cfg)
    return 0
