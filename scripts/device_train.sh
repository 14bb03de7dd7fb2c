#!/usr/bin/env bash
# Issue 19's training experiment on one GPU, one named phase per call, each call within one
# 10-minute device command (docs/TRAINING.md, "The GPU protocol"). Every run is resumable
# (--resume): a phase that runs out of its call's time stops with a checkpoint, and calling the
# same phase again continues it; finished runs are skipped. Builds nothing: the caller gives the
# CUDA build of libmtrain in MTRAIN_LIBRARY, and a python with torch and transformers.
#
#   MTRAIN_LIBRARY=build-cuda/libmtrain.so scripts/device_train.sh PHASE OUT_DIR
#
# PHASE: curriculum dense, MQAR alone at CURRICULUM=LENGTH:BATCH:STEPS (default 128:32:2000),
#                   from random weights (weights: OUT_DIR/curriculum.pt): the setting in which the
#                   CPU study learned MQAR (docs/TRAINING.md, "What learns"); optional
#        pretrain   dense, short sequences, from random weights, or from curriculum.pt when the
#                   curriculum phase ran in OUT_DIR (weights: OUT_DIR/pretrain.pt)
#        extend     dense, 2K then 8K tokens (LADDER), from pretrain.pt (weights: extended.pt)
#        arms-16k   dense, mtrain-static, window (matched to static's density), mtrain-topp at
#                   16K tokens, each continuing from extended.pt
#        arms-32k   the same at 32K tokens, from the dense 16K run (dense-16384.pt)
#        report     report.py over OUT_DIR/*.json: OUT_DIR/report.md and the charts
#        status     which runs are done, which are partial, at what step
#        A comma-separated list (pretrain,extend) runs them in order in one call.
# Environment: PYTHON (default python3), CALL_S (seconds this call may use, default 540),
# MARGIN_S (left for start-up, final evaluation and writing, default 75), ARMS (the arms of the
# arms-* phases, in order; default "dense mtrain-static window mtrain-topp"; any arm of
# examples/train/arms.py, e.g. ARMS="dense mtrain-static window mtrain-topp mtrain-block" adds
# the block-sparse selection, antidiag top-p 0.9; window needs mtrain-static before it).
# TOPP_FORCED: 1 (default) or 0, given as --topp-forced to the mtrain-topp runs: 1 forces the
# sinks and the local window into its top-p patterns (the program's default since 2026-11-29),
# 0 is the arm as the runs of 2026-11-27 ran it. A finished OUT_DIR/mtrain-topp-LENGTH.json is
# skipped whatever its setting (its config records it), and a checkpoint written with another
# setting is refused on resume: give forced and unforced runs different OUT_DIRs.
# TOPP_P: the mass (0, 1] the mtrain-topp runs keep, given as --p-v and --p-s (default: the
# program's 0.9); as with TOPP_FORCED, give runs of other masses their own OUT_DIRs.
# DETERMINISTIC: 1 (default) or 0, given as --deterministic to the arms-* runs (0: mtrain's
# fused backward); their own OUT_DIRs too.
# BLOCK_ARGS: extra options of the mtrain-block runs (e.g. "--block-method meanpool
# --block-top-k 4"; default none: --block-top-p 0.9 --block-stride 8).
# The arm name mtrain-block-cached (ARMS="... mtrain-block mtrain-block-cached") runs mtrain-block
# with BLOCK_ARGS through the pattern cache (issue 23): --block-refresh BLOCK_REFRESH (default 8),
# the recall drop measured on the last step of every BLOCK_MEASURE_EVERY-th window (default 4) on
# BLOCK_MEASURE_ROWS query rows (default 256; 0: the exact fp64 measure on the host, minutes per
# layer at 16K tokens); results OUT_DIR/mtrain-block-cached-LENGTH.json.
# ARM_GPUS=G (default 1): the arms-* phases run their arms at once, one per GPU, in waves of G
# (window after mtrain-static, on GPU 0); each arm's output in OUT_DIR/ARM-LENGTH.stdout. Each
# process gets OMP_NUM_THREADS = the host's cores over G unless set (before 2026-11-27 they
# started a thread per core each, and the mtrain arms' tokens/s measured that contention).
# Context parallel (docs/TRAINING.md, "Context parallel"): CP_WORLD=W (default 1: one GPU, the
# phases as they were) launches every run with torchrun on W GPUs of this host (one rank per
# GPU, NCCL; every arm on mtrain's ring), CP_LAYOUT its token layout (default striped);
# FROM_DIR (default OUT_DIR) is where the arms-* phases take their starting weights
# (extended.pt, dense-16384.pt), so that W GPUs continue from the single-GPU run's weights:
#
#   scripts/device_train.sh pretrain,extend,arms-16k runs/gpu              # one GPU
#   CP_WORLD=2 FROM_DIR=runs/gpu scripts/device_train.sh arms-16k runs/gpu-cp2
#   python -m examples.train.report runs/gpu/*-16384.json runs/gpu-cp2/*-16384.json \
#     --out-dir runs/cmp        # the same runs side by side; the W-GPU ones labelled (cpW)
set -euo pipefail
# shellcheck source=scripts/device_lib.sh
. "$(dirname "$0")/device_lib.sh"

phase=${1:?usage: device_train.sh PHASE OUT_DIR}
out=${2:?usage: device_train.sh PHASE OUT_DIR}
PY=${PYTHON:-python3}
CALL_S=${CALL_S:-540}
MARGIN_S=${MARGIN_S:-75}
ARMS=${ARMS:-dense mtrain-static window mtrain-topp}
CP_WORLD=${CP_WORLD:-1}
ARM_GPUS=${ARM_GPUS:-1}
if [ "$ARM_GPUS" -gt 1 ] && [ "$CP_WORLD" -gt 1 ]; then
  echo "ARM_GPUS=$ARM_GPUS and CP_WORLD=$CP_WORLD: give one of them" >&2
  exit 2
fi
CP_LAYOUT=${CP_LAYOUT:-striped}
t_end=$(($(date +%s) + CALL_S))
KNOWN_ARMS=" dense mtrain-full mtrain-static mtrain-topp mtrain-block mtrain-block-cached window "
for arm in $ARMS; do
  if [[ $KNOWN_ARMS != *" $arm "* ]]; then
    echo "ARMS: unknown arm $arm (one of$KNOWN_ARMS)" >&2
    exit 2
  fi
done

cd "$(dirname "$0")/.."
export PYTHONPATH=python${PYTHONPATH:+:$PYTHONPATH}
mkdir -p "$out"
FROM_DIR=${FROM_DIR:-$out}
# how a run is launched: one process, or torchrun with one rank per GPU
launch=("$PY" -m examples.train)
if [ "$CP_WORLD" -gt 1 ]; then
  dev_no_nvls
  launch=("$PY" -m torch.distributed.run --standalone --nproc_per_node "$CP_WORLD"
    -m examples.train --cp-layout "$CP_LAYOUT")
fi

# The settings the CPU study supports (docs/TRAINING.md, "Learnability study on the CPU").
SIZE=${SIZE:-mini}
# DATA_SEED (default 1): the training sequences and, through data_seed + 10**6, the evaluation
# ones; another seed in another OUT_DIR repeats a phase on other data from the same weights.
DATA_SEED=${DATA_SEED:-1}
if ! [[ $DATA_SEED =~ ^[0-9]+$ ]]; then
  echo "device_train.sh: DATA_SEED='$DATA_SEED': expected a non-negative integer" >&2
  exit 2
fi
# MQAR_PAIRS, MQAR_QUERIES (default 4, 24) and MQAR_DISTINCT (1: every query a distinct key,
# which needs MQAR_QUERIES <= MQAR_PAIRS; docs/TRAINING.md, "The tasks") set the MQAR half.
task=(--task mix --num-keys 32 --num-values 32 --num-filler 256
  --mqar-pairs "${MQAR_PAIRS:-4}" --mqar-queries "${MQAR_QUERIES:-24}"
  --passkey-digits 5 --eval-seqs "${EVAL_SEQS:-64}" --eval-batch 4 --seed 0 --data-seed "$DATA_SEED")
case ${MQAR_DISTINCT:-0} in
  0) ;;
  1) task+=(--mqar-distinct 1) ;;
  *) echo "device_train.sh: MQAR_DISTINCT='$MQAR_DISTINCT': expected 0 or 1" >&2; exit 2 ;;
esac
TOPP_FORCED=${TOPP_FORCED:-1}
case $TOPP_FORCED in
  0 | 1) ;;
  *) echo "device_train.sh: TOPP_FORCED='$TOPP_FORCED': expected 0 or 1" >&2; exit 2 ;;
esac
# DETERMINISTIC: 1 (default) or 0, given as --deterministic to the arms-* runs: 0 runs
# mtrain's fused backward (on GPUs faster, not reproducible bit for bit); as with TOPP_FORCED,
# give such runs their own OUT_DIRs (a checkpoint of the other setting is refused on resume)
DETERMINISTIC=${DETERMINISTIC:-1}
case $DETERMINISTIC in
  0 | 1) ;;
  *) echo "device_train.sh: DETERMINISTIC='$DETERMINISTIC': expected 0 or 1" >&2; exit 2 ;;
esac
# TOPP_P (default: the program's 0.9): the mass p_v = p_s the mtrain-topp runs keep
TOPP_P=${TOPP_P:-}
if [ -n "$TOPP_P" ] && ! [[ $TOPP_P =~ ^(0\.[0-9]*[1-9][0-9]*|1(\.0*)?)$ ]]; then
  echo "device_train.sh: TOPP_P='$TOPP_P': expected a decimal in (0, 1] written as 0.95 or 1" >&2
  exit 2
fi
PRE_LEN=${PRE_LEN:-512}
PRE_BATCH=${PRE_BATCH:-64}
# 1500: on an H100 passkey was at 1.000 from step 1250 of a 1500-step schedule (2026-11-27;
# MQAR did not move in 3000 steps of an earlier run)
PRE_STEPS=${PRE_STEPS:-1500}
PRE_LR=${PRE_LR:-1e-3}
EXT_STEPS=${EXT_STEPS:-300}
EXT_LR=${EXT_LR:-1e-3}
EXT_EVAL=${EXT_EVAL:-100}
# the extend phase: dense rungs LENGTH:BATCH:STEPS, each continuing from the one before
LADDER=${LADDER:-2048:16:400 8192:4:300}

# train NAME ARGS...: one resumable run with what is left of this call; 0 when its results JSON
# exists at the end, 1 when it stopped at the time limit (call the phase again), 3 when it failed
train() {
  local name=$1
  shift
  if [ -f "$out/$name.json" ]; then
    echo "$name: done"
    return 0
  fi
  local left=$((t_end - $(date +%s) - MARGIN_S))
  if [ "$left" -lt 30 ]; then
    echo "$name: not started, no time left in this call: call the phase again"
    return 1
  fi
  echo "$name: training for at most $left s"
  "${launch[@]}" --size "$SIZE" "${task[@]}" "$@" --resume "$out/$name.ckpt" \
    --ckpt-every 200 --time-limit "$left" --out "$out/$name.json" 2>&1 | tee -a "$out/$name.log"
  local rc=${PIPESTATUS[0]}
  if [ -f "$out/$name.json" ]; then
    return 0
  fi
  if [ "$rc" -ne 0 ]; then
    echo "$name: failed (exit status $rc), see $out/$name.log" >&2
    return 3
  fi
  echo "$name: stopped at the time limit: call the phase again"
  return 1
}

arms() { # arms LENGTH BATCH WEIGHTS: every arm continues from WEIGHTS at LENGTH tokens
  local n=$1 b=$2 from=$3
  if [ ! -f "$from" ]; then
    echo "no $from: run the phase before this one first" >&2
    return 3
  fi
  local arm extra
  # the starting weights at this length before any step: how much of the skill carries over
  train "zeroshot-$n" --arm dense --seq-len "$n" --batch "$b" --steps 0 --init-from "$from" ||
    return $?
  if [ "$ARM_GPUS" -gt 1 ]; then
    arms_parallel "$n" "$b" "$from"
    return $?
  fi
  for arm in $ARMS; do
    arm_run "$arm" "$n" "$b" "$from" || return $?
  done
}

arm_run() { # arm_run ARM LENGTH BATCH WEIGHTS: one arm's run
  local arm=$1 n=$2 b=$3 from=$4 extra real=$1
  {
    extra=()
    if [ "$arm" = window ]; then
      if [ ! -f "$out/mtrain-static-$n.json" ]; then
        echo "window-$n: needs mtrain-static-$n.json first (ARMS order)" >&2
        return 3
      fi
      extra=(--match "$out/mtrain-static-$n.json")
    fi
    # the dense arm keeps its weights: the next length continues from them
    if [ "$arm" = dense ]; then
      extra=(--save "$out/dense-$n.pt")
    fi
    if [[ $arm == mtrain-block* ]] && [ -n "${BLOCK_ARGS:-}" ]; then
      read -r -a extra <<<"$BLOCK_ARGS"
    fi
    if [ "$arm" = mtrain-topp ]; then
      extra=(--topp-forced "$TOPP_FORCED")
      [ -n "$TOPP_P" ] && extra+=(--p-v "$TOPP_P" --p-s "$TOPP_P")
    fi
    if [ "$arm" = mtrain-block-cached ]; then # the block arm through the pattern cache
      real=mtrain-block
      extra+=(--block-refresh "${BLOCK_REFRESH:-8}" --block-measure-every
        "${BLOCK_MEASURE_EVERY:-4}" --block-measure-rows "${BLOCK_MEASURE_ROWS:-256}")
    fi
    train "$arm-$n" --arm "$real" --seq-len "$n" --batch "$b" --steps "$EXT_STEPS" \
      --lr "$EXT_LR" --warmup 20 --init-from "$from" --eval-every "$EXT_EVAL" \
      --deterministic "$DETERMINISTIC" "${extra[@]}"
  }
}

# ARM_GPUS=G > 1: the arms run at once, one process per GPU (CUDA_VISIBLE_DEVICES), in waves of
# G; window, which needs mtrain-static's result, runs after them. The phase's status: 3 when a
# run failed, else 1 when one stopped at the time limit, else 0.
arms_parallel() {
  local n=$1 b=$2 from=$3 arm slot=0 worst=0 rc pids=() late=()
  # the host's cores shared by the G processes: each OpenMP runtime would otherwise start a
  # thread per core, and G of them oversubscribe the host (the plans are built there)
  local omp=$(($(nproc) / ARM_GPUS))
  [ "$omp" -lt 1 ] && omp=1
  export OMP_NUM_THREADS=${OMP_NUM_THREADS:-$omp}
  for arm in $ARMS; do
    if [ "$arm" = window ]; then
      late+=("$arm")
      continue
    fi
    echo "$arm-$n: on GPU $slot"
    CUDA_VISIBLE_DEVICES=$slot arm_run "$arm" "$n" "$b" "$from" > "$out/$arm-$n.stdout" 2>&1 &
    pids+=($!)
    slot=$((slot + 1))
    if [ "$slot" -ge "$ARM_GPUS" ]; then
      for p in "${pids[@]}"; do
        wait "$p"
        rc=$?
        [ "$rc" -gt "$worst" ] && worst=$rc
      done
      pids=()
      slot=0
    fi
  done
  for p in "${pids[@]}"; do
    wait "$p"
    rc=$?
    [ "$rc" -gt "$worst" ] && worst=$rc
  done
  for arm in $ARMS; do
    [ -f "$out/$arm-$n.stdout" ] && [ "$arm" != window ] && tail -n 3 "$out/$arm-$n.stdout"
  done
  for arm in "${late[@]}"; do
    arm_run "$arm" "$n" "$b" "$from"
    rc=$?
    [ "$rc" -gt "$worst" ] && worst=$rc
  done
  return "$worst"
}

extend() { # dense, each rung of LADDER from the one before; the last rung's weights: extended.pt
  local from=$out/pretrain.pt rung n b k
  if [ ! -f "$from" ]; then
    echo "no $from: run the pretrain phase first" >&2
    return 3
  fi
  for rung in $LADDER; do
    IFS=: read -r n b k <<<"$rung"
    train "extend-$n" --arm dense --seq-len "$n" --batch "$b" --steps "$k" --lr "$EXT_LR" \
      --warmup 20 --init-from "$from" --eval-every "$EXT_EVAL" --save "$out/extend-$n.pt" ||
      return $?
    from=$out/extend-$n.pt
  done
  cp "$from" "$out/extended.pt"
}

run_phase() {
  case "$1" in
  curriculum)
    local n b k
    IFS=: read -r n b k <<<"${CURRICULUM:-128:32:2000}"
    if ! [[ $n =~ ^[1-9][0-9]*$ && $b =~ ^[1-9][0-9]*$ && $k =~ ^[1-9][0-9]*$ ]]; then
      echo "device_train.sh: CURRICULUM='${CURRICULUM:-}': expected LENGTH:BATCH:STEPS" >&2
      exit 2
    fi
    train curriculum --arm dense --task mqar --seq-len "$n" --batch "$b" --steps "$k" \
      --lr "$PRE_LR" --warmup 100 --eval-every 500 --save "$out/curriculum.pt"
    ;;
  pretrain)
    local init=()
    [ -f "$out/curriculum.pt" ] && init=(--init-from "$out/curriculum.pt")
    train pretrain --arm dense --seq-len "$PRE_LEN" --batch "$PRE_BATCH" --steps "$PRE_STEPS" \
      --lr "$PRE_LR" --warmup 100 --eval-every 250 --save "$out/pretrain.pt" "${init[@]}"
    ;;
  extend) extend ;;
  arms-16k) arms "${LEN_16K:-16384}" "${BATCH_16K:-4}" "$FROM_DIR/extended.pt" ;;
  arms-32k) arms "${LEN_32K:-32768}" "${BATCH_32K:-2}" "$FROM_DIR/dense-${LEN_16K:-16384}.pt" ;;
  report)
    "$PY" -m examples.train.report "$out"/*.json --out-dir "$out" | tee "$out/report.md"
    ;;
  status)
    for f in "$out"/*.ckpt; do
      [ -e "$f" ] || continue
      name=$(basename "$f" .ckpt)
      if [ -f "$out/$name.json" ]; then
        echo "$name: done"
      else
        "$PY" -c "import sys, torch; c = torch.load(sys.argv[1], weights_only=False); \
  print(sys.argv[2] + ':', 'step', c['step'], 'of', c['config']['steps'])" "$f" "$name"
      fi
    done
    ;;
  *)
    echo "unknown phase $1 (curriculum, pretrain, extend, arms-16k, arms-32k, report, status)" >&2
    exit 2
    ;;
  esac
}

# PHASE may be a comma-separated list (pretrain,extend): run in order, stop at the first that
# is not complete
IFS=, read -r -a phases <<<"$phase"
for p in "${phases[@]}"; do
  run_phase "$p" || exit $?
done
