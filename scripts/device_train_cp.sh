#!/usr/bin/env bash
# The short context-parallel check of the training program on the GPU machine (docs/TRAINING.md,
# "Context parallel"): the same short run (the mini model, SEQ_LEN tokens, STEPS steps, from
# random weights or INIT_FROM) on one GPU and on W GPUs (torchrun, one rank per GPU, NCCL, every
# attention on mtrain's ring), for the dense and mtrain-static arms; then a table of tokens/s
# and losses (first and last step, the largest per-step difference to the one-GPU run) side by
# side. About 4 minutes on 2-4 GPUs with the defaults. Builds nothing unless no library is found.
#
#   MTRAIN_LIBRARY=build-cuda/libmtrain.so scripts/device_train_cp.sh [OUT_DIR]
#
# Environment (defaults): CP_WORLD (the host's GPUs, at most 4), CP_LAYOUT (striped), SEQ_LEN
# (32768), BATCH (2), STEPS (40), SIZE (mini), ARMS ("dense mtrain-static"), LR (1e-3), WARMUP
# (5), EVAL_SEQS (4 per task), PROBE_EVERY (10), INIT_FROM (none: random weights, seed 0),
# RUN_S (timeout of one run, 120), CALL_S (the whole call's budget, 230: a run is not started
# with less than MIN_S = 45 left), PYTHON (python3), DEVICE (cuda; cpu for a dry run with gloo).
# Exit status: 0 when every run wrote its results, 1 when one did not (the table and its log say
# which and why), 2 when the preflight failed (no GPU, fewer GPUs than CP_WORLD, a library
# without the NCCL communicator).
set -uo pipefail
# shellcheck source=scripts/device_lib.sh
. "$(dirname "$0")/device_lib.sh" || exit 2

out=${1:-runs/train-cp}
PY=${PYTHON:-python3}
DEVICE=${DEVICE:-cuda}
SEQ_LEN=${SEQ_LEN:-32768}
BATCH=${BATCH:-2}
STEPS=${STEPS:-40}
SIZE=${SIZE:-mini}
ARMS=${ARMS:-dense mtrain-static}
CP_LAYOUT=${CP_LAYOUT:-striped}
RUN_S=${RUN_S:-120}
CALL_S=${CALL_S:-230}
MIN_S=${MIN_S:-45}
t_end=$(($(date +%s) + CALL_S))

cd "$(dirname "$0")/.." || exit 2
export PYTHONPATH=python${PYTHONPATH:+:$PYTHONPATH}
dev_no_nvls
export MTRAIN_COMM_TIMEOUT=${MTRAIN_COMM_TIMEOUT:-60}         # a stalled ring fails in 60 s
mkdir -p "$out"

if [ "$DEVICE" = cuda ]; then
  dev_ensure_library "$out"
fi

# preflight: the GPUs, the library, its NCCL communicator; the world size
W=$("$PY" - "$DEVICE" "${CP_WORLD:-0}" <<'EOF'
import sys

import torch

import mtrain
from mtrain import _lib as L

device, want = sys.argv[1], int(sys.argv[2])
gpus = torch.cuda.device_count() if device == "cuda" else 0
print(f"torch {torch.__version__}, {gpus} GPUs"
      + "".join(f"\n  cuda:{i} {torch.cuda.get_device_name(i)}" for i in range(gpus)),
      file=sys.stderr)
print(f"libmtrain {mtrain.library_path()}, backends {', '.join(mtrain.backends())}",
      file=sys.stderr)
if device == "cuda":
    if gpus < 2:
        sys.exit(f"preflight: {gpus} GPUs, context parallel needs 2 or more")
    if not L.lib().has("comm_create_nccl"):
        sys.exit("preflight: this libmtrain has no NCCL communicator (built without NCCL)")
    if want > gpus:
        sys.exit(f"preflight: CP_WORLD={want} but {gpus} GPUs")
print(want or min(gpus, 4) or 2)
EOF
)
rc=$?
if [ $rc -ne 0 ] || [ -z "$W" ]; then
  echo "preflight failed (exit $rc)" >&2
  exit 2
fi
echo "context parallel over W=$W ($CP_LAYOUT); $SIZE, $SEQ_LEN tokens x $BATCH, $STEPS steps"

common=(--size "$SIZE" --task mix --num-keys 32 --num-values 32 --num-filler 256
  --mqar-pairs 4 --mqar-queries 24 --passkey-digits 5 --seed 0 --data-seed 1
  --seq-len "$SEQ_LEN" --batch "$BATCH" --steps "$STEPS" --lr "${LR:-1e-3}"
  --warmup "${WARMUP:-5}" --eval-seqs "${EVAL_SEQS:-4}" --eval-batch 2
  --probe-every "${PROBE_EVERY:-10}" --device "$DEVICE")
if [ "$DEVICE" = cpu ]; then
  common+=(--threads 1)
fi
if [ -n "${INIT_FROM:-}" ]; then
  common+=(--init-from "$INIT_FROM")
fi

failed=0
# one NAME RANKS ARM: one run, 1 rank (one process) or RANKS ranks under torchrun
one() {
  local name=$1 ranks=$2 arm=$3 to run_rc
  if ! dev_run_limit "$name"; then
    failed=1
    return
  fi
  local cmd=("$PY" -m examples.train)
  if [ "$ranks" -gt 1 ]; then
    cmd=("$PY" -m torch.distributed.run --standalone --nproc_per_node "$ranks"
      -m examples.train --cp-layout "$CP_LAYOUT")
  fi
  if ! dev_timed_run "$name" "${cmd[@]}" "${common[@]}" --arm "$arm" --out "$out/$name.json"; then
    if [ "$run_rc" -eq 124 ] || [ "$run_rc" -eq 137 ]; then
      echo "$name: timed out after $to s (RUN_S=$RUN_S); the end of $out/$name.log:"
    else
      echo "$name: failed (exit status $run_rc); the end of $out/$name.log:"
    fi
    # the ranks' own errors first (torchrun's traceback comes last in the log), then the end
    grep -E 'Error|error:|MTRAIN_ERR|exitcode' "$out/$name.log" | grep -v 'SignalException' |
      head -8 | sed 's/^/    /'
    echo "    ..."
    tail -8 "$out/$name.log" | sed 's/^/    /'
  fi
}

for arm in $ARMS; do
  one "1gpu-$arm" 1 "$arm"
  one "cp$W-$arm" "$W" "$arm"
done

# shellcheck disable=SC2086 # ARMS: one argument per arm
"$PY" - "$out" "$W" $ARMS <<'EOF'
import json
import statistics
import sys
from pathlib import Path

out, world, arms = Path(sys.argv[1]), int(sys.argv[2]), sys.argv[3:]


def load(name):
    p = out / f"{name}.json"
    return json.loads(p.read_text()) if p.exists() else None


def f(x, fmt):
    return "-" if x is None else format(x, fmt)


head = ["arm", "GPUs", "tokens/s", "vs 1 GPU", "step s", "loss first", "loss last",
        "max rel. loss diff to 1 GPU", "attention share", "density", "peak GiB/GPU",
        "replica diff"]
print("\n| " + " | ".join(head) + " |\n|" + "---|" * len(head))
for arm in arms:
    one = load(f"1gpu-{arm}")
    for name, ranks in ((f"1gpu-{arm}", 1), (f"cp{world}-{arm}", world)):
        r = load(name)
        if r is None:
            print(f"| {arm} | {ranks} | no results ({name}.log) |" + " |" * (len(head) - 3))
            continue
        loss = [s["loss"] for s in r["steps"]]
        diff = None
        if one is not None and ranks > 1:
            ref = [s["loss"] for s in one["steps"]]
            diff = max(abs(a - b) / abs(b) for a, b in zip(loss, ref))
        speed = (r["tokens_per_s"] / one["tokens_per_s"]
                 if one and one["tokens_per_s"] and r["tokens_per_s"] else None)
        shares = [p["attention_share"] for p in r["probes"] if p["attention_share"]]
        dens = [x["density"] for p in r["probes"] for x in p["layers"].values()]
        mem = r.get("peak_memory_bytes")
        cp = r.get("cp") or {}
        cells = [arm, str(ranks), f(r["tokens_per_s"], ".0f"), f(speed, ".2f"),
                 f(r["step_s_median"], ".3f"), f(loss[0] if loss else None, ".4f"),
                 f(loss[-1] if loss else None, ".4f"), f(diff, ".1e"),
                 f(statistics.median(shares) if shares else None, ".0%"),
                 f(statistics.mean(dens) if dens else None, ".3f"),
                 f(mem / 2**30 if mem else None, ".2f"), f(cp.get("replica_max_diff"), ".1e")]
        print("| " + " | ".join(cells) + " |")
print(f"\nresults and logs: {out}/; tokens/s: the whole job's (batch x tokens over the median "
      "step, probed steps and the first 3 left out); loss diff: the W-GPU run against the "
      "1-GPU run, per step (on GPUs in bf16 autocast; dense: SDPA against mtrain's dense ring)")
EOF
exit $failed
