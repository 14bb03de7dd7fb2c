#!/usr/bin/env bash
# The training step's speed, dense against mtrain, on one GPU (issue 19's target: the whole step
# at 32K at least 2x dense; docs/TRAINING.md, "The training step's speed"): for every model size
# of SIZES, length of LENS and arm of ARMS, one short run of the training program alone on the
# GPU (python -m examples.train, --steps STEPS from random weights, TOKENS tokens a step: batch
# TOKENS / length, at least 1), then a table of tokens/s (the median step; the first 3 steps and
# the probed ones left out), the speed against the dense arm of the same size and length, the
# attention's share of the probed steps and the pattern's density. Accuracy is not measured
# (one evaluation sequence per task). Builds nothing unless no library is found.
#
#   MTRAIN_LIBRARY=build-cuda/libmtrain.so scripts/device_train_speed.sh [OUT_DIR]
#
# Environment (defaults): SIZES ("small base"), LENS ("16384 32768 65536"), ARMS ("dense
# mtrain-static mtrain-topp"), TOKENS (65536), STEPS (20), PROBE_EVERY (5), RUN_S (timeout of
# one run, 120), CALL_S (the whole call's budget, 540: a run is not started with less than
# MIN_S = 30 left), PYTHON (python3), DEVICE (cuda; cpu: a dry run with one thread),
# DENSE_ABOVE and DENSE_RECHECK (empty and 1: the estimating arms' dense fallback, --dense-above
# and --dense-recheck; with DENSE_ABOVE set those arms' runs are named ARM+fallback).
# Exit status: 0 when every run wrote its results, 1 when one did not (its log says why).
set -uo pipefail
# shellcheck source=scripts/device_lib.sh
. "$(dirname "$0")/device_lib.sh" || exit 1

out=${1:-runs/train-speed}
PY=${PYTHON:-python3}
DEVICE=${DEVICE:-cuda}
SIZES=${SIZES:-small base}
LENS=${LENS:-16384 32768 65536}
ARMS=${ARMS:-dense mtrain-static mtrain-topp}
TOKENS=${TOKENS:-65536}
STEPS=${STEPS:-20}
RUN_S=${RUN_S:-120}
CALL_S=${CALL_S:-540}
MIN_S=${MIN_S:-30}
t_end=$(($(date +%s) + CALL_S))

cd "$(dirname "$0")/.." || exit 1
export PYTHONPATH=python${PYTHONPATH:+:$PYTHONPATH}
mkdir -p "$out"
if [ "$DEVICE" = cuda ]; then
  dev_ensure_library "$out"
fi
extra=()
[ "$DEVICE" = cpu ] && extra=(--threads 1)

failed=0
for size in $SIZES; do
  for n in $LENS; do
    b=$((TOKENS / n))
    [ "$b" -lt 1 ] && b=1
    for arm in $ARMS; do
      name=$size-$n-$arm
      fallback=()
      case "$arm" in
      mtrain-static | mtrain-topp | mtrain-full)
        if [ -n "${DENSE_ABOVE:-}" ]; then
          fallback=(--dense-above "$DENSE_ABOVE" --dense-recheck "${DENSE_RECHECK:-1}")
          name=$name+fallback
        fi
        ;;
      esac
      if ! dev_run_limit "$name"; then
        failed=1
        continue
      fi
      if ! dev_timed_run "$name" "$PY" -m examples.train --size "$size" --arm "$arm" --task mix \
        --seq-len "$n" --batch "$b" --steps "$STEPS" --probe-every "${PROBE_EVERY:-5}" \
        --eval-seqs 1 --eval-batch 1 --device "$DEVICE" "${extra[@]}" "${fallback[@]}" \
        --out "$out/$name.json"; then
        echo "$name: no results (exit status $run_rc; timeout $to s); the end of $out/$name.log:"
        tail -5 "$out/$name.log" | sed 's/^/    /'
      fi
    done
  done
done

"$PY" - "$out" <<'PY'
import json
import statistics
import sys
from pathlib import Path

out = Path(sys.argv[1])
runs = {}
for p in sorted(out.glob("*.json")):
    size, n, arm = p.stem.split("-", 2)
    runs[(size, int(n), arm)] = json.loads(p.read_text())
head = ["size", "tokens/seq", "batch", "arm", "tokens/s", "step s", "vs dense", "attention share",
        "density"]
print("\n| " + " | ".join(head) + " |\n|" + "---|" * len(head))
for (size, n, arm), r in sorted(runs.items()):
    dense = runs.get((size, n, "dense"))
    tps = r.get("tokens_per_s")
    ref = dense.get("tokens_per_s") if dense else None
    shares = [p["attention_share"] for p in r["probes"] if p.get("attention_share")]
    dens = [x["density"] for p in r["probes"] for x in p["layers"].values() if "density" in x]
    cells = [size, str(n), str(r["config"]["batch"]), arm,
             f"{tps:,.0f}" if tps else "-", f"{r['step_s_median']:.4f}" if r["step_s_median"] else "-",
             f"{tps / ref:.2f}x" if tps and ref else "-",
             f"{statistics.median(shares):.0%}" if shares else "-",
             f"{statistics.mean(dens):.3f}" if dens else "1 (dense)" if arm == "dense" else "-"]
    print("| " + " | ".join(cells) + " |")
print(f"\nresults and logs: {out}/ (one JSON and one log per run)")
PY
exit $failed
