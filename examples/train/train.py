"""The training run: one arm, one model, one data stream; writes the results
JSON (config, per-step loss and time, tokens/s, attention share and pattern
statistics on probed steps, peak memory, accuracy per bucket). Under context
parallel (cp.py; torchrun) every rank runs this with the same configuration:
the same weights and batches, each its slots of every sequence, the loss and
the gradients summed over the ranks; rank 0 logs and writes the files. With --mix the
launcher's ranks are data parallel instead (dp.py): each step's long-tail mix of documents is
dealt to the ranks (--balance), each rank trains on its documents packed into one varlen
sequence, and the gradients are summed over the ranks."""

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
import traceback
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
import transformers

import mtrain

from . import cp as CP
from . import dp as DP
from . import fit as FIT
from . import model as M
from . import tune as TUNE
from .arms import Arm, Budget
from .config import RunConfig
from .evaluate import answer_loss, evaluate, shard_loss_sum
from .probe import PROBE, sync
from .tasks import Task, Vocab, batch, make_task

EVAL_SEED_OFFSET = 10**6


def device_of(cfg: RunConfig, cp: CP.Cp | None = None) -> torch.device:
    """The run's device; under context parallel on GPUs cuda:LOCAL_RANK (one GPU per rank)."""
    if cfg.device == "auto":
        dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    else:
        dev = torch.device(cfg.device)
    if cp is not None and cp.on and dev.type == "cuda":
        return torch.device("cuda", cp.local_rank)
    return dev


def granularity_of(cfg: RunConfig, dev: torch.device) -> int:
    return cfg.granularity or (128 if dev.type == "cuda" else 64)


def open_cp(cfg: RunConfig) -> CP.Cp:
    """The run's context-parallel state (cp.start), after the checks every rank makes before
    the process group exists (cp.check): single-process unless --cp on or WORLD_SIZE > 1.
    With --mix the group is data parallel (dp.py; checked by check_mix first)."""
    world = CP.env_world()
    check_mix(cfg)
    check_options(cfg)
    if cfg.mix != "none":
        if cfg.cp == "off" and world > 1:
            raise ValueError(
                f"--mix {cfg.mix} with --cp off under a launcher (WORLD_SIZE={world}): the "
                "launcher's ranks are data parallel under --mix; use --cp auto"
            )
        if cfg.balance_fit and cfg.balance_fit * world < FIT.MIN_SAMPLES:
            raise ValueError(
                f"--balance-fit {cfg.balance_fit} on {world} rank{'s' * (world != 1)}: a window "
                f"holds {cfg.balance_fit * world} samples (one per rank and step), the fit needs "
                f"at least {FIT.MIN_SAMPLES} (the intercept and {len(FIT.FEATURES)} columns); "
                f"give K >= {-(-FIT.MIN_SAMPLES // world)}"
            )
        return CP.start(cfg.cp, cfg.device, cfg.cp_layout)
    if CP.wanted(cfg.cp, world):
        g = granularity_of(cfg, device_of(cfg))
        CP.check(cfg.arm, cfg.seq_len, g, cfg.cp_layout, world)
    return CP.start(cfg.cp, cfg.device, cfg.cp_layout)


def check_mix(cfg: RunConfig) -> None:
    """Refuses bad --mix / --balance settings before any process group exists."""
    if cfg.mix not in DP.MIXES:
        raise ValueError(f"--mix {cfg.mix!r}: one of {', '.join(DP.MIXES)}")
    if cfg.balance not in DP.BALANCES:
        raise ValueError(f"--balance {cfg.balance!r}: one of {', '.join(DP.BALANCES)}")
    if cfg.mix == "none":
        tuning = cfg.balance_tune or cfg.balance_tune_bounds
        if (
            cfg.balance != "off"
            or cfg.balance_calibration
            or cfg.balance_spread != "even"
            or tuning
            or cfg.balance_fit
        ):
            raise ValueError(
                "--balance, --balance-calibration, --balance-spread, --balance-fit and "
                "--balance-tune deal the documents of --mix long-tail: "
                "give --mix long-tail (fixed-length batches are not dealt, every rank holds "
                "the same batch)"
            )
        return
    if cfg.arm in DP.REFUSED:
        raise ValueError(f"--mix: the {cfg.arm} arm is not supported: {DP.REFUSED[cfg.arm]}")
    if cfg.batch < 1:
        raise ValueError(f"--batch {cfg.batch}: the step holds at least --batch x --seq-len tokens")
    long_tail(cfg)  # the distribution's own checks
    if cfg.balance != "off":
        DP.calibration_of(cfg.balance_calibration, device_of(cfg))
    if cfg.balance_tune or cfg.balance_tune_bounds:
        if cfg.balance_tune < 1:
            raise ValueError(
                f"--balance-tune {cfg.balance_tune}: refresh the mass curves every M >= 1 steps"
                + (" (--balance-tune-bounds needs --balance-tune)" if cfg.balance_tune == 0 else "")
            )
        if cfg.balance != "cost":
            raise ValueError(
                f"--balance-tune tunes after the cost deal: give --balance cost, not {cfg.balance}"
            )
        if cfg.arm != "mtrain-static":
            raise ValueError(
                f"--balance-tune scales the static top-k budgets of the mtrain-static arm; the "
                f"{cfg.arm} arm has none to scale"
            )
        TUNE.parse_bounds(cfg.balance_tune_bounds)
    if cfg.balance_fit < 0:
        raise ValueError(
            f"--balance-fit {cfg.balance_fit}: refit the pricing every K >= 1 steps, or 0 (off)"
        )
    if cfg.balance_fit and cfg.balance != "cost":
        raise ValueError(
            f"--balance-fit fits the cost predictor's table: give --balance cost, not {cfg.balance}"
        )
    if cfg.balance_spread == "measured" and not cfg.balance_tune:
        raise ValueError(
            "--balance-spread measured prices the heads by the pairs the tuner measures: give "
            "--balance-tune M"
        )


def check_options(cfg: RunConfig) -> None:
    """Refuses bad --block-refresh, --block-measure-every and --mqar-distinct settings before
    any process group exists."""
    if cfg.block_refresh < 0:
        raise ValueError(
            f"--block-refresh {cfg.block_refresh}: must be >= 1 (select every K steps through "
            "the pattern cache), or 0 (the default: select in every attention call, no cache)"
        )
    if cfg.block_refresh and cfg.arm != "mtrain-block":
        raise ValueError(
            f"--block-refresh {cfg.block_refresh}: the pattern cache is the mtrain-block arm's, "
            f"not {cfg.arm}'s"
        )
    if cfg.block_refresh and cfg.mix != "none":
        raise ValueError(
            "--block-refresh with --mix: the cache holds one sequence per layer and batch slot; "
            "packed documents of varying lengths are not supported"
        )
    if cfg.block_measure_every < 0:
        raise ValueError(f"--block-measure-every {cfg.block_measure_every}: must be >= 0")
    if cfg.block_measure_rows < 0:
        raise ValueError(f"--block-measure-rows {cfg.block_measure_rows}: must be >= 0")
    if cfg.mqar_distinct not in (0, 1):
        raise ValueError(f"--mqar-distinct {cfg.mqar_distinct}: 0 or 1")
    if cfg.topp_forced not in (0, 1):
        raise ValueError(f"--topp-forced {cfg.topp_forced}: 0 or 1")
    if cfg.deterministic not in (0, 1):
        raise ValueError(f"--deterministic {cfg.deterministic}: 0 or 1")
    check_dense_fallback(cfg)
    if cfg.mqar_distinct and cfg.task in ("mqar", "mix") and cfg.mqar_queries > cfg.mqar_pairs:
        raise ValueError(
            f"--mqar-distinct 1 queries each pair at most once: --mqar-queries {cfg.mqar_queries} "
            f"must be <= --mqar-pairs {cfg.mqar_pairs}"
        )


ESTIMATING_ARMS = ("mtrain-static", "mtrain-topp", "mtrain-full")


def dense_above_of(cfg: RunConfig) -> float | str | None:
    """--dense-above as mtrain.attention takes it: None (off), "auto" or a density."""
    text = cfg.dense_above.strip()
    if not text:
        return None
    if text == "auto":
        return "auto"
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not 0.0 <= value <= 1.0:
        raise ValueError(
            f'--dense-above {cfg.dense_above!r}: a density in [0, 1], "auto" (the device\'s '
            "measured threshold) or empty (never)"
        )
    return value


def check_dense_fallback(cfg: RunConfig) -> None:
    """Refuses --dense-above and --dense-recheck where they cannot apply."""
    if cfg.dense_recheck < 1:
        raise ValueError(f"--dense-recheck {cfg.dense_recheck}: must be >= 1")
    if dense_above_of(cfg) is None:
        if cfg.dense_recheck != 1:
            raise ValueError(f"--dense-recheck {cfg.dense_recheck} needs --dense-above")
        return
    if cfg.arm not in ESTIMATING_ARMS:
        raise ValueError(
            f"--dense-above: the fallback runs after an estimate, which the {cfg.arm} arm does "
            f"not make (arms: {', '.join(ESTIMATING_ARMS)})"
        )
    if cfg.mix == "none" and cfg.cp in CP.MODES and CP.wanted(cfg.cp, CP.env_world()):
        raise ValueError(
            "--dense-above with context parallel: the fallback is one GPU's dense attention, "
            "not a ring (use it on one rank or with --mix data parallel)"
        )


def long_tail(cfg: RunConfig) -> DP.LongTail:
    m = DP.min_doc_len(cfg.mqar_pairs, cfg.mqar_queries, cfg.passkey_digits, cfg.depth_buckets)
    return DP.LongTail(cfg.seq_len, cfg.batch * cfg.seq_len, m, cfg.mix_long_prob)


def tasks_of(cfg: RunConfig, vocab: Vocab) -> tuple[list[Task], list[str]]:
    names = ["mqar", "passkey"] if cfg.task == "mix" else [cfg.task]
    kw = {
        "num_pairs": cfg.mqar_pairs,
        "num_queries": cfg.mqar_queries,
        "digits": cfg.passkey_digits,
        "num_buckets": cfg.depth_buckets,
        "distinct": cfg.mqar_distinct,
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


def run(
    cfg: RunConfig,
    log: Any = print,
    cp: CP.Cp | None = None,
    state: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """One run (or one call of a resumed run). ``cp``: the context-parallel state (open_cp;
    None: opened here from cfg, single-process without a launcher). ``state``: when given, the
    final weights (a state dict) are put in state["model"] (the tests compare ranks)."""
    if cp is None:
        cp = open_cp(cfg)
    mix = cfg.mix != "none"
    check_mix(cfg)
    check_options(cfg)
    par = cp.on and not mix  # context parallel (with --mix the group is data parallel)
    if par and cp.layout != cfg.cp_layout:
        raise ValueError(f"--cp-layout {cfg.cp_layout} but the process group runs {cp.layout}")
    if not cp.main:
        log = _silent
    dev = device_of(cfg, cp)
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    dtype = cfg.dtype if cfg.dtype != "auto" else ("bfloat16" if dev.type == "cuda" else "float32")
    if dtype not in ("float32", "bfloat16", "float64"):
        raise ValueError(f"--dtype {cfg.dtype!r}: auto, float32, bfloat16 or float64")
    if dtype == "float64" and dev.type != "cpu":
        raise ValueError("--dtype float64 runs on the CPU only (mtrain's cpu-ref oracle)")
    autocast: Any = (
        torch.autocast(dev.type, dtype=torch.bfloat16)
        if dtype == "bfloat16"
        else contextlib.nullcontext()
    )
    g = granularity_of(cfg, dev)
    size = M.SIZES[cfg.size]
    vocab = Vocab(cfg.num_keys, cfg.num_values, cfg.num_filler)
    tasks, names = tasks_of(cfg, vocab)
    budget = Budget(
        granularity=g, sinks=cfg.sinks, local_window=cfg.local_window, last_q=cfg.last_q,
        v_frac=cfg.v_frac, s_frac=cfg.s_frac, p_v=cfg.p_v, p_s=cfg.p_s,
        topp_forced=bool(cfg.topp_forced),
        window_blocks=cfg.window_blocks, match_density=measured_density(cfg.match),
        block_method=cfg.block_method, block_top_p=cfg.block_top_p, block_top_k=cfg.block_top_k,
        block_stride=cfg.block_stride, block_sinks=cfg.block_sinks, block_local=cfg.block_local,
        block_refresh=cfg.block_refresh, block_measure_every=cfg.block_measure_every,
        block_measure_rows=cfg.block_measure_rows, dense_above=dense_above_of(cfg),
        dense_recheck=cfg.dense_recheck, deterministic=bool(cfg.deterministic),
    )  # fmt: skip
    arm = Arm(cfg.arm, size.heads, budget, cp=par, packed=mix)
    arm.set_length(cfg.seq_len)
    model = M.build(size, vocab.size, cfg.seq_len, cfg.rope_theta, arm.attn_name, cfg.seed)
    ckpt = load_checkpoint(cfg)
    if cfg.init_from:
        if ckpt is None:  # resuming: the weights come from the checkpoint
            weights = torch.load(cfg.init_from, map_location="cpu", weights_only=True)
            model.load_state_dict(weights)
        M.set_rope_theta(model, cfg.rope_theta, cfg.seq_len)
    model.to(dev).train()
    if dtype == "float64":  # the tests' exact comparisons: weights, optimiser and attention
        model.double()
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
    segments: list[dict[str, Any]] = []
    first = 0
    if ckpt is not None:
        model.load_state_dict(ckpt["model"])
        opt.load_state_dict(ckpt["optimizer"])
        set_rng(ckpt["rng"], dev)
        first = ckpt["step"]
        steps, probed, history = ckpt["steps"], ckpt["probes"], ckpt["eval_history"]
        segments = ckpt["segments"]
        log(f"resumed from {cfg.resume} at step {first} of {cfg.steps}")
    segment = len(segments)
    segments.append({"first_step": first, "date": _now(), **cp.describe()})
    tokens = cfg.batch * cfg.seq_len  # the whole job's (every rank holds its slots of them)
    ranks = f"{cp.world} rank" + "s" * (cp.world != 1)
    where = f", context parallel over {ranks} ({cp.backend}, {cp.layout})" * par
    dealer: DP.Dealer | None = None
    tuner: TUNE.Tuner | None = None
    refit: FIT.Refit | None = None
    dp_info: dict[str, Any] = {}
    summary: dict[str, Any] = {}
    scratch = DP.scratch() if mix else None
    if mix:
        assert scratch is not None
        where = (
            f", --mix {cfg.mix} (at least {cfg.batch * cfg.seq_len} tokens a step), data parallel "
            f"over {ranks}{f' ({cp.backend})' * cp.on}, --balance {cfg.balance}"
        )
        topk = arm.budgets if isinstance(arm.budgets, mtrain.TopK) else mtrain.TopK(0, 0)
        bfile = DP.budget_file(
            cfg.arm, size.heads, size.layers, cfg.seq_len, topk.v_size, topk.s_size,
            Path(scratch.name) / "budgets.json",
        )  # fmt: skip
        cal_path, cal = DP.calibration_of(cfg.balance_calibration, dev)
        dims = {"hidden": size.hidden, "intermediate": size.intermediate, "vocab": 0}
        dims.update(kv_heads=size.kv_heads, head_dim=size.head_dim)
        dealer = DP.Dealer(
            cfg.balance, cp.world, bfile, cal, g, dims, cfg.sinks, cfg.local_window,
            cfg.balance_spread,
        )  # fmt: skip
        dp_info = {
            "world_size": cp.world,
            "backend": cp.backend or None,
            "balance": cfg.balance,
            "mix": long_tail(cfg).describe(),
            "calibration": {
                "file": cal_path,
                **cal,
                "seq_s_note": "set to 0 (packed: one call per rank)",
            },
            "predictor_budgets": json.loads(bfile.read_text())[0]["0"][1:3],
            "granularity": g,
            "spread": cfg.balance_spread,
        }
        if cfg.balance_tune:
            tuner = TUNE.Tuner(
                cfg.balance_tune, TUNE.parse_bounds(cfg.balance_tune_bounds), bfile,
                topk.v_size, topk.s_size, size.layers, size.heads, g,
                {"last_q": cfg.last_q, "num_sinks": cfg.sinks, "window": cfg.local_window},
                Path(scratch.name), measure_pairs=cfg.balance_spread == "measured",
            )  # fmt: skip
            dp_info["tune"] = {
                "every": cfg.balance_tune,
                "bounds": list(tuner.bounds) if tuner.bounds else None,
                "levels": list(TUNE.LEVELS),
                "curves": "mtrain.mass_curve on the step's longest document's q, k (rank 0)",
                "pricing": "measured pairs per query row (row_pairs at refresh steps)"
                if cfg.balance_spread == "measured"
                else f"position model ({cfg.balance_spread})",
            }
        if cfg.balance_fit:
            refit = FIT.Refit(cfg.balance_fit, cal)
            dp_info["fit"] = {
                "every": cfg.balance_fit,
                "model": "compute_s = a + x pairs + y rows + z flops (NNLS, a free): pair_s x, "
                "row_s y, seq_s 0, linear_flops 1/z",
                "samples": "every rank with a document, every step of the window (ranks dealt "
                "none left out)",
                "features": "untuned budgets" if cfg.balance_tune else "the predictor's budgets",
                "fits": refit.fits,  # filled as the run goes
            }
            replay_fits(refit, steps, dealer)
    log(
        f"arm {cfg.arm}, task {cfg.task}, {cfg.size} ({M.parameters(model) / 1e6:.1f}M "
        f"parameters), {cfg.seq_len} tokens x {cfg.batch}, {cfg.steps} steps, {dev}, {dtype}"
        + where
    )
    if par and cfg.arm == "dense":
        log(
            "dense arm under context parallel: mtrain's dense causal attention on the ring (SDPA"
            " has no ring); on one process the dense arm is SDPA"
        )
    params = list(model.parameters())

    def checkpoint(step: int) -> None:
        segments[-1].update(last_step=step - 1, wall_s=time.perf_counter() - t_call)
        if cp.main:
            save_checkpoint(cfg, model, opt, dev, step, steps, probed, history, segments)
        cp.barrier()  # the next call (or the next run in this process) reads it

    def evaluation() -> dict[str, Any]:
        return evaluate(
            model, tasks, names, cfg.data_seed + EVAL_SEED_OFFSET, cfg.eval_seqs,
            cfg.eval_batch, dev, autocast, cp if par else None, g, cp if mix else None,
        )  # fmt: skip

    t_call = time.perf_counter()
    for step in range(first, cfg.steps):
        if mix:
            assert dealer is not None
            for group in opt.param_groups:
                group["lr"] = lr_at(cfg, step)
            rec = dp_step(
                cfg, step, model, opt, params, names, dealer, cp, dev, autocast, arm, tuner,
                refit,
            )  # fmt: skip
            rec.update(segment=segment)
            steps.append(rec)
            d = rec["dp"]
            if step % max(1, cfg.steps // 10) == 0 or step + 1 == cfg.steps:
                log(
                    f"step {step}: loss {rec['loss']:.4f}, {d['docs']} documents, "
                    f"{d['tokens']} tokens, {rec['time_s']:.3f} s, compute max/mean "
                    f"{_fmt(d['compute_max_over_mean'])}, predicted "
                    f"{_fmt(d['predicted_max_over_mean'])}"
                )
            if refit is not None and d["fit"]["refit"] is not None:
                f = refit.fits[-1]
                log(
                    f"step {step + 1}: pricing fitted on steps {f['steps'][0]}-{f['steps'][-1]} "
                    f"({f['samples']} samples): "
                    + (
                        f"table {f['index']}: pair_s {f['table']['pair_s']:.3e}, row_s "
                        f"{f['table']['row_s']:.3e}, linear_flops "
                        f"{f['table']['linear_flops']:.3e}, R^2 {_fmt(f['r2'])}"
                        if f["table"]
                        else f"kept table {f['index']} ({f['degenerate']})"
                    )
                )
        else:
            ids, labels, _, _ = _batch(tasks, cfg, step)
            if par:
                shard = cp.shard(ids, labels, g, dev)
                answers = int((labels[:, 1:] != CP.IGNORE).sum())  # of the whole batch
            else:
                ids, labels = ids.to(dev), labels.to(dev)
            for group in opt.param_groups:
                group["lr"] = lr_at(cfg, step)
            watch = step in probes
            if arm.refresh is not None:
                arm.refresh.begin_step(step)
            if watch:
                PROBE.start(stats=cfg.arm != "dense")
            sync(dev)
            t0 = time.perf_counter()
            if par:
                # this rank's share of the batch's mean answer loss; the shares' gradients and
                # loss sums are summed over the ranks: the single-process step's
                with autocast:
                    loss_sum, mine = shard_loss_sum(model, shard)
                (loss_sum / answers).backward()
                local = torch.stack(
                    [loss_sum.detach().float(), torch.tensor(float(mine), device=dev)]
                )
                total = cp.sync_gradients(params, local)
                if round(float(total[1])) != answers:
                    raise RuntimeError(
                        f"step {step}: the ranks hold {total[1]} answers of {answers}"
                    )
                loss = total[0] / answers
            else:
                with autocast:
                    loss = answer_loss(model, ids, labels)
                loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
            opt.step()
            opt.zero_grad(set_to_none=True)
            value = float(loss.detach())  # synchronises
            sync(dev)
            dt = time.perf_counter() - t0
            steps.append(
                {"step": step, "loss": value, "time_s": dt, "probed": watch, "segment": segment}
            )
            measure_s = 0.0
            if arm.refresh is not None:
                steps[-1]["block_cache"] = arm.refresh.record()
                measure_s = arm.refresh.step_measure_s
            if watch:
                PROBE.stop()
                attn = PROBE.fwd_s + PROBE.bwd_s
                net = dt - PROBE.stats_s - measure_s
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
            ev = evaluation()
            history.append({"step": step + 1, "eval": ev})
            log(f"step {step + 1}: " + ", ".join(f"{k} {v['overall']:.3f}" for k, v in ev.items()))
        done = step + 1
        if cfg.resume and cfg.ckpt_every and done % cfg.ckpt_every == 0 and done < cfg.steps:
            checkpoint(done)
        late = bool(cfg.time_limit) and time.perf_counter() - t_call >= cfg.time_limit
        if cfg.resume and cfg.time_limit and done < cfg.steps:
            late = cp.any(late, dev)  # every rank stops after the same step
        if cfg.resume and late and done < cfg.steps:
            checkpoint(done)
            log(f"time limit: stopped after step {done} of {cfg.steps}; checkpoint {cfg.resume}")
            return {"complete": False, "step": done, "steps": steps}
    if cfg.resume:
        checkpoint(cfg.steps)
    # every rank must hold the same weights (the same summed gradients, the same update)
    replica_diff = cp.replica_diff(model)
    if replica_diff:
        log(f"warning: the ranks' weights differ by up to {replica_diff:.3e}")
    final = evaluation()
    log("final accuracy: " + ", ".join(f"{k} {v['overall']:.3f}" for k, v in final.items()))
    # the first 3 steps of every call (warm-up, allocations) and probed steps are left out
    starts = {g["first_step"] for g in segments}
    plain = [
        s["time_s"]
        for s in steps
        if not s["probed"]
        and not any(0 <= s["step"] - f < 3 for f in starts)
        and not s.get("block_cache", {}).get("measures")
    ]
    step_s = statistics.median(plain) if plain else None
    cache_info = block_cache_summary(arm, steps, starts, tokens, log)
    if mix:
        summary = dp_summary(steps, segments)
        step_s = None
        tokens = summary.get("tokens_per_step_mean") or tokens
        log(
            f"data parallel: tokens/s {_fmt(summary.get('tokens_per_s'))}, compute max/mean "
            f"{_fmt(summary.get('compute_max_over_mean'))}, predicted "
            f"{_fmt(summary.get('predicted_max_over_mean'))}"
        )
    results: dict[str, Any] = {
        "config": asdict(cfg),
        "command": [sys.executable, "-m", "examples.train", *sys.argv[1:]],
        "date": _now(),
        "complete": True,
        "segments": segments,
        "device": (f"{cp.world} x " * cp.on)
        + (
            torch.cuda.get_device_name(dev)
            if dev.type == "cuda"
            else platform.processor() or platform.machine()
        ),
        "world_size": cp.world,
        "cp": {**cp.describe(), "replica_max_diff": replica_diff} if par else None,
        "block_cache": cache_info,
        "dp": {**dp_info, **summary, "replica_max_diff": replica_diff} if mix else None,
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
        "tokens_per_step": tokens,  # the whole job's, as tokens_per_s
        "steps": steps,
        "step_s_median": step_s,
        "tokens_per_s": (summary.get("tokens_per_s") if mix else tokens / step_s)
        if mix or step_s
        else None,
        "probes": probed,
        "eval_history": history,
        "eval": final,
        # --steps 0 evaluates the initial (or --init-from) weights only: no loss
        "final_loss": statistics.mean(s["loss"] for s in steps[-max(1, len(steps) // 10) :])
        if steps
        else None,
    }
    if dev.type == "cuda":
        results["peak_memory_bytes"] = torch.cuda.max_memory_allocated(dev)
    if cfg.out and cp.main:
        Path(cfg.out).parent.mkdir(parents=True, exist_ok=True)
        Path(cfg.out).write_text(json.dumps(results, indent=1) + "\n")
    if cfg.save and cp.main:
        Path(cfg.save).parent.mkdir(parents=True, exist_ok=True)
        torch.save(model.state_dict(), cfg.save)
    if state is not None:
        state["model"] = {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}
    if scratch is not None:
        scratch.cleanup()
    cp.barrier()  # rank 0's files are written before any rank goes on
    return results


def block_cache_summary(
    arm: Arm, steps: list[dict[str, Any]], starts: set[int], tokens: int, log: Any
) -> dict[str, Any] | None:
    """--block-refresh: the cache's refreshes and recall drops (arms.BlockRefresh.summary), and
    tokens/s amortised over the refresh windows: the step's tokens over the mean step time
    (less measure()'s seconds) of the steps tokens_per_s counts plus the measured ones, so
    that refresh steps weigh by their share. None without the cache."""
    if arm.refresh is None:
        return None
    out = arm.refresh.summary(steps)
    counted = [
        s["time_s"] - s["block_cache"]["measure_s"]
        for s in steps
        if not s["probed"] and not any(0 <= s["step"] - f < 3 for f in starts)
    ]
    out["tokens_per_s_mean"] = tokens / statistics.mean(counted) if counted else None
    out["counted_steps"] = len(counted)
    log(
        f"block cache: refresh every {out['refresh_every']}, {out['steps']} steps, "
        f"{out['refreshes']} refreshes, {len(out['measures'])} measures, recall drop mean "
        f"{_fmt(out['drop_mean'])}, worst {_fmt(out['drop_max'])}, tokens/s (amortised) "
        f"{_fmt(out['tokens_per_s_mean'])}"
    )
    return out


def dp_step(
    cfg: RunConfig,
    step: int,
    model: torch.nn.Module,
    opt: torch.optim.Optimizer,
    params: list[torch.nn.Parameter],
    names: list[str],
    dealer: DP.Dealer,
    cp: CP.Cp,
    dev: torch.device,
    autocast: Any,
    arm: Arm | None = None,
    tuner: TUNE.Tuner | None = None,
    refit: FIT.Refit | None = None,
) -> dict[str, Any]:
    """One data-parallel step of --mix (dp.py): the step's documents drawn (the same on every
    rank), dealt by the dealer (with a tuner: and each rank's per-head budgets tuned, tune.py;
    with a refit: after the last step of every window the dealer's table refitted, fit.py),
    this rank's packed and trained on; its answer-loss sum over the
    whole batch's answer count is back-propagated, and the gradients, the loss sums, the answer
    counts and every rank's compute and attention seconds are summed over the ranks in one
    all-reduce, so the update is the single-process one on the whole batch. A rank dealt no
    document runs no forward and contributes zero gradients, but joins every collective.
    Returns the step's record."""
    lengths = long_tail(cfg).draw(cfg.data_seed, step)
    kw = {
        "num_pairs": cfg.mqar_pairs, "num_queries": cfg.mqar_queries, "digits": cfg.passkey_digits,
        "num_buckets": cfg.depth_buckets, "num_keys": cfg.num_keys, "num_values": cfg.num_values,
        "num_filler": cfg.num_filler, "distinct": cfg.mqar_distinct,
    }  # fmt: skip
    tuned: dict[str, Any] | None = None
    if tuner is None:
        rank_of, report = dealer.deal(lengths)
    else:
        assert arm is not None
        tuned = _tune(cfg, step, model, names, lengths, kw, dealer, tuner, arm, cp, dev, autocast)
        rank_of, report = tuned.pop("rank_of"), tuned.pop("report")
    per_task = {"mqar": cfg.mqar_queries, "passkey": cfg.passkey_digits}
    answers = sum(per_task[names[j % len(names)]] for j in range(len(lengths)))
    mine = [j for j, r in enumerate(rank_of) if r == cp.rank]
    docs = DP.documents(names, lengths, mine, step, cfg.data_seed, kw)
    w = cp.world
    PROBE.start(stats=False)  # the attention's forward and backward seconds, every step
    sync(dev)
    t0 = time.perf_counter()
    if docs:
        ids, labels, pos, cu = DP.pack(docs)
        with autocast:
            loss_sum, held = DP.packed_loss_sum(model, ids.to(dev), labels.to(dev), pos.to(dev), cu)
        (loss_sum / answers).backward()
        local = [loss_sum.detach().double(), torch.tensor(float(held), dtype=torch.float64)]
    else:
        zero = torch.zeros((), dtype=torch.float64)
        local = [zero, zero]
    sync(dev)
    compute = time.perf_counter() - t0
    PROBE.stop()
    times = torch.zeros(2 * w, dtype=torch.float64)
    times[cp.rank], times[w + cp.rank] = compute, PROBE.fwd_s + PROBE.bwd_s
    extra = torch.cat([torch.stack([x.cpu() for x in local]), times]).to(dev)
    total = cp.sync_gradients(params, extra).double().cpu()
    if round(float(total[1])) != answers:
        raise RuntimeError(f"step {step}: the ranks hold {float(total[1])} answers of {answers}")
    torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
    opt.step()
    opt.zero_grad(set_to_none=True)
    loss = float(total[0]) / answers
    sync(dev)
    dt = time.perf_counter() - t0
    slowest = float(cp.all_reduce(torch.tensor([dt], device=dev), _max()).item())
    compute_s = [float(x) for x in total[2 : 2 + w]]
    attention_s = [float(x) for x in total[2 + w : 2 + 2 * w]]
    predicted = dealer.predicted(lengths, rank_of)
    fitted: dict[str, Any] | None = None
    if refit is not None:
        feats = dealer.rank_features(lengths, rank_of)
        fitted = {"table": refit.index, "rank_features": feats, "refit": None}
        f = refit.observe(step, feats, compute_s, predicted)
        if f is not None:
            fitted["refit"] = len(refit.fits) - 1
            if f["table"] is not None:
                dealer.set_calibration(refit.table)
    tokens = sum(lengths)
    rank_tokens = [0] * w
    for n, r in zip(lengths, rank_of, strict=True):
        rank_tokens[r] += n
    return {
        "step": step,
        "loss": loss,
        "time_s": dt,
        "probed": False,
        "dp": {
            "docs": len(lengths),
            "tokens": tokens,
            "long_docs": sum(n >= cfg.seq_len // 4 for n in lengths),
            "rank_docs": [rank_of.count(r) for r in range(w)],
            "rank_tokens": rank_tokens,
            "compute_s": compute_s,
            "attention_s": attention_s,
            "compute_max_over_mean": DP.max_over_mean(compute_s),
            "attention_max_over_mean": DP.max_over_mean(attention_s),
            "predicted_s": predicted,
            "predicted_max_over_mean": DP.max_over_mean(predicted),
            "tokens_max_over_mean": DP.max_over_mean([float(x) for x in rank_tokens]),
            "balance_report": {k: report[k] for k in ("max_before", "mean_before", "empty_ranks")}
            if report
            else None,
            "step_s_max": slowest,
            "tokens_per_s": tokens / slowest if slowest > 0 else None,
            "tune": tuned,
            "fit": fitted,
        },
    }


def replay_fits(refit: FIT.Refit, steps: list[dict[str, Any]], dealer: DP.Dealer) -> None:
    """--balance-fit after --resume: the fits of the earlier calls made again from their
    recorded steps (each rank's features, measured and predicted seconds), the same on every
    rank and the same as the first time (fit.py is deterministic), and the dealer given the
    last table."""
    for s in steps:
        f = s["dp"].get("fit")
        if f is None:
            continue
        if f["table"] != refit.index:
            raise RuntimeError(
                f"--balance-fit: step {s['step']} was priced by table {f['table']}, the replayed "
                f"fits give {refit.index}"
            )
        refit.observe(s["step"], f["rank_features"], s["dp"]["compute_s"], s["dp"]["predicted_s"])
    if refit.index > 0:
        dealer.set_calibration(refit.table)


def _tune(
    cfg: RunConfig,
    step: int,
    model: torch.nn.Module,
    names: list[str],
    lengths: list[int],
    kw: dict[str, int],
    dealer: DP.Dealer,
    tuner: TUNE.Tuner,
    arm: Arm,
    cp: CP.Cp,
    dev: torch.device,
    autocast: Any,
) -> dict[str, Any]:
    """--balance-tune: the mass curves refreshed when due (rank 0 runs the model without
    gradient on the step's longest document, the first of the longest), the cost deal with the
    tuner, and this rank's budget file registered with the arm. Returns the deal, the report and
    the step's tuning record."""
    refreshed = tuner.due(step)
    if refreshed:
        longest = min(range(len(lengths)), key=lambda j: (-lengths[j], j))
        doc = DP.documents(names, lengths, [longest], step, cfg.data_seed, kw)

        def forward() -> None:
            ids, _, pos, cu = DP.pack(doc)
            with autocast:
                model.model(
                    input_ids=ids.to(dev), position_ids=pos.to(dev), cu_seq_lens_q=cu,
                    cu_seq_lens_k=cu,
                )  # fmt: skip

        tuner.refresh(step, forward, cp.rank, cp.all_reduce, dev)
        if tuner.row_pairs is not None:
            dealer.set_row_pairs(tuner.row_pairs)
    rank_of, report, scales, after = dealer.deal_tuned(lengths, tuner.mass, tuner.bounds)
    mine = scales[cp.rank]
    arm.set_tuned_budgets(str(tuner.rank_budgets(mine, cp.rank)))
    keys = (
        "max_after", "mean_after", "target_s", "recall_before", "recall_after",
        "worst_recall_before", "worst_recall_after", "ranks_over_target", "moves_down", "moves_up",
    )  # fmt: skip
    return {
        "rank_of": rank_of,
        "report": report,
        "curves_refreshed": refreshed,
        "curves_step": tuner.mass_step,
        "curves_s": tuner.curve_s if refreshed else 0.0,
        "row_pairs": [[float(x) for x in row] for row in tuner.row_pairs]
        if refreshed and tuner.row_pairs is not None
        else None,
        "predicted_tuned_s": after,
        "predicted_tuned_max_over_mean": DP.max_over_mean(after),
        "rank_mean_scale": [float(x) for x in scales.mean(axis=1)],
        "rank_scales": [[float(x) for x in row] for row in scales],
        **{k: float(report[k]) for k in keys},
    }


def dp_summary(steps: list[dict[str, Any]], segments: list[dict[str, Any]]) -> dict[str, Any]:
    """The run's data-parallel figures over the counted steps (the first 3 of every call left
    out, as for tokens/s): global tokens over the summed slowest-rank step times, and the mean
    over steps of each max/mean."""
    starts = {s["first_step"] for s in segments}
    counted = [s for s in steps if not any(0 <= s["step"] - f < 3 for f in starts)]
    out: dict[str, Any] = {"counted_steps": len(counted)}
    if not counted:
        return out
    d = [s["dp"] for s in counted]
    wall = sum(x["step_s_max"] for x in d)
    out["tokens_per_s"] = sum(x["tokens"] for x in d) / wall if wall > 0 else None
    out["tokens_per_step_mean"] = statistics.mean(x["tokens"] for x in d)
    out["step_s_max_mean"] = wall / len(d)
    for key in ("compute", "attention", "predicted", "tokens"):
        vals = [x[f"{key}_max_over_mean"] for x in d if x[f"{key}_max_over_mean"] is not None]
        out[f"{key}_max_over_mean"] = statistics.mean(vals) if vals else None
    w = len(d[0]["compute_s"])
    out["compute_s_sum"] = [sum(x["compute_s"][r] for x in d) for r in range(w)]
    out["steps_with_empty_rank"] = sum(min(x["rank_docs"]) == 0 for x in d)
    tuned = [x["tune"] for x in d if x.get("tune")]
    if tuned:
        # --balance-tune: the tuner's predictions and the attention mass its budgets keep (the
        # curves' share: docs/BALANCE.md, "Tuning"), and the seconds its curves took on rank 0
        # (outside the timed step: not in tokens/s)
        out["tuned"] = {
            "predicted_tuned_max_over_mean": statistics.mean(
                t["predicted_tuned_max_over_mean"] for t in tuned
            ),
            "recall_before": statistics.mean(t["recall_before"] for t in tuned),
            "recall_after": statistics.mean(t["recall_after"] for t in tuned),
            "worst_recall_before": min(t["worst_recall_before"] for t in tuned),
            "worst_recall_after": min(t["worst_recall_after"] for t in tuned),
            "moves_down": sum(t["moves_down"] for t in tuned),
            "moves_up": sum(t["moves_up"] for t in tuned),
            "curves_s_sum": sum(t["curves_s"] for t in tuned),
            "ranks_over_target_steps": sum(t["ranks_over_target"] > 0 for t in tuned),
        }
    fits = [x["fit"] for x in d if x.get("fit")]
    if fits:
        # --balance-fit: the counted steps priced by a fitted table, and their measured and
        # predicted max/mean (against all counted steps' above)
        by_fit = [x for x in d if x.get("fit") and x["fit"]["table"] > 0]
        out["fitted"] = {
            "steps_priced_by_fit": len(by_fit),
            "last_table": max(f["table"] for f in fits),
        }
        for key in ("compute", "predicted"):
            vals = [x[f"{key}_max_over_mean"] for x in by_fit]
            ok = [v for v in vals if v is not None]
            out["fitted"][f"{key}_max_over_mean"] = statistics.mean(ok) if ok else None
    return out


def _max() -> Any:
    import torch.distributed as dist

    return dist.ReduceOp.MAX


def _fmt(x: float | None) -> str:
    return "-" if x is None else f"{x:.3f}"


def _silent(*_: Any) -> None:
    """The log of ranks other than 0."""


def _now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


# options that may change between the calls of one resumed run (where results go, how long a
# call lasts, how the tokens are spread over the ranks: the same steps up to rounding); any
# other difference is refused: the run would no longer be one run
RESUME_FREE = ("out", "save", "resume", "ckpt_every", "time_limit", "threads", "cp", "cp_layout")


def load_checkpoint(cfg: RunConfig) -> dict[str, Any] | None:
    """The checkpoint of --resume when it exists (None otherwise), checked
    against this run's configuration."""
    if not cfg.resume or not Path(cfg.resume).exists():
        return None
    ckpt = torch.load(cfg.resume, map_location="cpu", weights_only=False)
    now = asdict(cfg)
    saved = dict(ckpt["config"])
    if saved.get("arm") == "mtrain-topp":
        # written before --topp-forced: that arm forced nothing (--topp-forced 0)
        saved.setdefault("topp_forced", 0)
    # written before --deterministic: the deterministic backward (the API's default)
    saved.setdefault("deterministic", 1)
    diff = [
        f"{k}: {v!r} (checkpoint) != {now.get(k)!r}"
        for k, v in saved.items()
        if k not in RESUME_FREE and now.get(k) != v
    ]
    if diff:
        raise ValueError(f"{cfg.resume} was written by another run: " + "; ".join(diff))
    return ckpt


def rng_state(dev: torch.device) -> dict[str, Any]:
    """The CPU generator's state and the run's own GPU's (not every visible GPU's: under
    context parallel each rank touches only its device)."""
    state: dict[str, Any] = {"torch": torch.get_rng_state()}
    if dev.type == "cuda":
        state["cuda_device"] = torch.cuda.get_rng_state(dev)
    return state


def set_rng(state: dict[str, Any], dev: torch.device) -> None:
    torch.set_rng_state(state["torch"])
    if dev.type == "cuda" and "cuda_device" in state:
        torch.cuda.set_rng_state(state["cuda_device"], dev)
    elif dev.type == "cuda" and "cuda" in state:  # checkpoints written before context parallel
        torch.cuda.set_rng_state_all(state["cuda"])


def save_checkpoint(
    cfg: RunConfig,
    model: torch.nn.Module,
    opt: torch.optim.Optimizer,
    dev: torch.device,
    step: int,
    steps: list[dict[str, Any]],
    probed: list[dict[str, Any]],
    history: list[dict[str, Any]],
    segments: list[dict[str, Any]],
) -> None:
    """Everything the next call needs to continue as if it had not stopped:
    weights, AdamW's moments and step counts, the step counter (which gives
    the learning rate and the data position, sequences step * batch on), the
    RNG states, and the per-step records. Written to a temporary file and
    renamed, so that a call killed while writing leaves the last checkpoint."""
    path = Path(cfg.resume)
    path.parent.mkdir(parents=True, exist_ok=True)
    state = {
        "version": 1,
        "config": asdict(cfg),
        "step": step,
        "data_position": step * cfg.batch,
        "model": model.state_dict(),
        "optimizer": opt.state_dict(),
        "rng": rng_state(dev),
        "steps": steps,
        "probes": probed,
        "eval_history": history,
        "segments": segments,
    }
    tmp = path.with_name(path.name + ".tmp")
    torch.save(state, tmp)
    os.replace(tmp, path)


def _batch(tasks: list[Task], cfg: RunConfig, step: int) -> tuple[torch.Tensor, ...]:
    return batch(tasks, cfg.data_seed, step * cfg.batch, cfg.batch)


def main(argv: list[str] | None = None) -> int:
    """The command line. Under context parallel the run ends with cp.teardown (barrier,
    mtrain.reset, the group destroyed) and leaves through os._exit, skipping the interpreter's
    teardown (docs/PYTORCH.md, "Context parallel"); an exception is printed first and gives
    exit status 1."""
    from .config import from_args

    cfg = from_args(argv)
    os.environ.setdefault("MTRAIN_NUM_THREADS", str(cfg.threads or torch.get_num_threads()))
    cp = open_cp(cfg)
    if not cp.on:
        run(cfg, cp=cp)
        return 0
    rc = 0
    try:
        run(cfg, cp=cp)
    except BaseException:
        traceback.print_exc()
        rc = 1
    finally:
        CP.finish(cp, rc)
