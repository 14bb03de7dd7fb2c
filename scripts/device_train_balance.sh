#!/usr/bin/env bash
# Balancing on and off in the training program (docs/TRAINING.md, "Data parallel with
# balancing"): the same data-parallel run (--mix long-tail: every step a long-tail mix of packed
# documents up to SEQ_LEN tokens, at least BATCH x SEQ_LEN tokens a step, W ranks under torchrun,
# one GPU each, NCCL) with every --balance of BALANCES for every arm of ARMS; then the table of
# tokens/s, measured and predicted max/mean over the ranks, loss and accuracy
# (python -m examples.train.dp). Builds nothing unless no library is found.
#
#   MTRAIN_LIBRARY=build-cuda/libmtrain.so scripts/device_train_balance.sh [OUT_DIR]
#
# Environment (defaults): DP_WORLD (the host's GPUs, at most 8), SEQ_LEN (16384), BATCH (8),
# STEPS (60), SIZE (mini), ARMS ("dense mtrain-static"), BALANCES ("off tokens cost cost+tune";
# cost+tune: --balance cost --balance-tune TUNE_EVERY (10), mtrain-static only; also cost+fit:
# --balance cost --balance-fit FIT_EVERY (10), the predictor's table refitted every FIT_EVERY
# steps from the ranks' measured compute seconds, any arm; not in the default), LR
# (1e-3), WARMUP (5), EVAL_SEQS (8 per task), INIT_FROM (none: random weights, seed 0),
# CALIBRATION (none: data/calibration/h200-derived.json on GPUs, cpu-2core.json on the CPU),
# SPREAD (even: the predictor's placement of the budgets, --balance-spread even|local|measured;
# measured applies to the cost+tune runs, the others keep even),
# RUN_S (timeout of one run, 150), CALL_S (the whole call's budget, 540: a run is not started
# with less than MIN_S = 45 left), PYTHON (python3), DEVICE (cuda; cpu: gloo processes, one
# thread each, for a dry run or the CPU measurement).
# Exit status: 0 when every run wrote its results, 1 when one did not (its log says why), 2 when
# the preflight failed (no GPU, fewer GPUs than DP_WORLD).
set -uo pipefail
# shellcheck source=scripts/device_lib.sh
. "$(dirname "$0")/device_lib.sh" || exit 2

out=${1:-runs/train-balance}
PY=${PYTHON:-python3}
DEVICE=${DEVICE:-cuda}
SEQ_LEN=${SEQ_LEN:-16384}
BATCH=${BATCH:-8}
STEPS=${STEPS:-60}
SIZE=${SIZE:-mini}
ARMS=${ARMS:-dense mtrain-static}
BALANCES=${BALANCES:-off tokens cost cost+tune}
RUN_S=${RUN_S:-150}
CALL_S=${CALL_S:-540}
MIN_S=${MIN_S:-45}
t_end=$(($(date +%s) + CALL_S))

cd "$(dirname "$0")/.." || exit 2
export PYTHONPATH=python:.${PYTHONPATH:+:$PYTHONPATH}
dev_no_nvls
mkdir -p "$out"

if [ "$DEVICE" = cuda ]; then
  dev_ensure_library "$out"
fi

# preflight: the GPUs and the library; the world size
W=$("$PY" - "$DEVICE" "${DP_WORLD:-0}" <<'EOF'
import sys

import torch

import mtrain

device, want = sys.argv[1], int(sys.argv[2])
gpus = torch.cuda.device_count() if device == "cuda" else 0
print(f"torch {torch.__version__}, {gpus} GPUs"
      + "".join(f"\n  cuda:{i} {torch.cuda.get_device_name(i)}" for i in range(gpus)),
      file=sys.stderr)
print(f"libmtrain {mtrain.library_path()}, backends {', '.join(mtrain.backends())}",
      file=sys.stderr)
if device == "cuda":
    if gpus < 2:
        sys.exit(f"preflight: {gpus} GPUs, data parallel needs 2 or more")
    if want > gpus:
        sys.exit(f"preflight: DP_WORLD={want} but {gpus} GPUs")
print(want or min(gpus, 8) or 2)
EOF
)
rc=$?
if [ $rc -ne 0 ] || [ -z "$W" ]; then
  echo "preflight failed (exit $rc)" >&2
  exit 2
fi
echo "data parallel over W=$W; $SIZE, --mix long-tail up to $SEQ_LEN tokens, >= $BATCH x $SEQ_LEN tokens a step, $STEPS steps"

common=(--size "$SIZE" --task mix --num-keys 32 --num-values 32 --num-filler 256
  --mqar-pairs 4 --mqar-queries 24 --passkey-digits 5 --seed 0 --data-seed 1
  --mix long-tail --seq-len "$SEQ_LEN" --batch "$BATCH" --steps "$STEPS" --lr "${LR:-1e-3}"
  --warmup "${WARMUP:-5}" --eval-seqs "${EVAL_SEQS:-8}" --eval-batch 2 --device "$DEVICE")
if [ "$DEVICE" = cpu ]; then
  common+=(--threads 1)
fi
if [ -n "${INIT_FROM:-}" ]; then
  common+=(--init-from "$INIT_FROM")
fi
if [ -n "${CALIBRATION:-}" ]; then
  common+=(--balance-calibration "$CALIBRATION")
fi
# SPREAD=measured prices by the pairs the tuner measures: the runs without tuning keep even
if [ -n "${SPREAD:-}" ] && [ "$SPREAD" != measured ]; then
  common+=(--balance-spread "$SPREAD")
fi

failed=0
names=()
for arm in $ARMS; do
  for bal in $BALANCES; do
    name="dp$W-$arm-$bal"
    balance=(--balance "$bal")
    if [ "$bal" = cost+tune ]; then
      if [ "$arm" != mtrain-static ]; then
        echo "$name: skipped (tuning scales mtrain-static's budgets)"
        continue
      fi
      balance=(--balance cost --balance-tune "${TUNE_EVERY:-10}")
      if [ "${SPREAD:-}" = measured ]; then
        balance+=(--balance-spread measured)
      fi
    fi
    if [ "$bal" = cost+fit ]; then
      balance=(--balance cost --balance-fit "${FIT_EVERY:-10}")
    fi
    if ! dev_run_limit "$name"; then
      failed=1
      continue
    fi
    if dev_timed_run "$name" "$PY" -m torch.distributed.run --standalone --nproc_per_node "$W" \
      -m examples.train "${common[@]}" --arm "$arm" "${balance[@]}" --out "$out/$name.json"; then
      names+=("$out/$name.json")
    else
      echo "$name: failed or timed out (exit status $run_rc, limit $to s); the end of $out/$name.log:"
      grep -E 'Error|error:|MTRAIN_ERR|exitcode' "$out/$name.log" | head -8 | sed 's/^/    /'
      tail -8 "$out/$name.log" | sed 's/^/    /'
    fi
  done
done

if [ ${#names[@]} -gt 0 ]; then
  "$PY" -m examples.train.dp "${names[@]}" | tee "$out/table.md"
  echo "results and logs: $out/; tokens/s: the step's global tokens over the slowest rank's step,"
  echo "summed over the steps (the first 3 left out); max/mean: over the ranks, mean over steps"
fi
exit $failed
