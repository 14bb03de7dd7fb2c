#!/usr/bin/env bash
# Measured rank times of SparseBalance's assignments on one GPU (docs/BALANCE.md, "Measured rank
# times (tool)"; tools/balance_measure.py): the CUDA build (scripts/device_cuda.sh build, skipped
# when MTRAIN_LIBRARY is set or build-cuda/libmtrain.so exists), then the runs of RUNS, each
# under its own timeout, each writing NAME.json and NAME.log under OUT_DIR:
#   longtail  the long-tail mix of `mtrain-balance batch --long-tail --world WORLD` at full size
#             (SCALE 1), the Qwen2.5-3B budgets as given, 16:2 heads, d 128, bf16, the
#             calibration CALIBRATION (the derived H200 table whose predictions docs/BALANCE.md
#             publishes); methods METHODS; layers LAYERS measured (the rest extrapolated); the
#             lengths on a log grid of GRID points with 3 off-grid checks; the linear layers
#             timed; VALIDATE ranks run whole.
#   tuned     the same mix, tokens and cost+tuned (every rank has its own budgets: a grid per
#             rank and layer), at TUNED_LAYERS only.
#   topp      EQUAL_COUNT documents of EQUAL_N tokens with the top-p budgets (TOPP_BUDGETS):
#             every document measured on its own inputs (sparsity heterogeneity alone).
#   measured  the tuned run priced by the measured pairs (--spread measured) with the methods
#             tokens, cost and cost+tuned, at TUNED_LAYERS.
#   grid      the long-tail mix priced by the measured table on a length grid ROW_PAIRS
#             (--row-pairs; tools/balance_row_pairs.py), methods GRID_METHODS at LAYERS.
# Then the summary lines of every run that finished (from its log).
#
#   bash scripts/device_balance_measure.sh [OUT_DIR]     (default runs/balance-measure)
#
# One call (about 10 minutes at most): the build and RUNS="longtail" (the default). A second
# call on the still-warm machine (the build is kept): RUNS="tuned topp measured".
# Environment (defaults): BACKEND (cuda; cpu: the same runs on the CPU backend for a dry run,
# with SCALE 64, budgets divided by SCALE, 4:1 heads, d 64, no linear layers, one thread,
# process CPU clock), RUNS (longtail), WORLD (8), SCALE (1), METHODS (tokens,cost,cost+split),
# LAYERS (0,15,31), GRID (8), REPS (2), VALIDATE (1), TUNED_LAYERS (15), EQUAL_N (65536),
# EQUAL_COUNT (16), TOPP_BUDGETS (data/budgets/Qwen2.5_3B_flex_0.90.json), CALIBRATION
# (data/calibration/h200-derived.json), RUN_S (timeout of one run: 330), CALL_S (the whole
# call's budget, build included: 560; a run is not started with less than MIN_S = 30 left),
# PYTHON (python3), FIT (0; 1: the longtail run fits pair_s, row_s, seq_s and linear_flops on its
# own untuned calls first, --fit-calibration, and balances with the fitted table; the table is in
# its JSON under calibration_fit; also for the grid run), FIT_OBJECTIVE (relative; the fit's
# --fit-objective: relative, log, seconds or share), ROW_PAIRS
# (data/calibration/qwen2.5-3b-row-pairs.json), GRID_METHODS (tokens,cost,cost+tuned), TARGET
# (the grid run's tuner target in predicted seconds; 0: the mean rank time).
# Exit status: 0 when every run wrote its JSON, 1 when one did not (its log says why), 2 when
# the preflight failed.
set -uo pipefail
# shellcheck source=scripts/device_lib.sh
. "$(dirname "$0")/device_lib.sh" || exit 2

out=${1:-runs/balance-measure}
PY=${PYTHON:-python3}
BACKEND=${BACKEND:-cuda}
WORLD=${WORLD:-8}
METHODS=${METHODS:-tokens,cost,cost+split}
LAYERS=${LAYERS:-0,15,31}
GRID=${GRID:-8}
REPS=${REPS:-2}
VALIDATE=${VALIDATE:-1}
TUNED_LAYERS=${TUNED_LAYERS:-15}
EQUAL_N=${EQUAL_N:-65536}
EQUAL_COUNT=${EQUAL_COUNT:-16}
TOPP_BUDGETS=${TOPP_BUDGETS:-data/budgets/Qwen2.5_3B_flex_0.90.json}
CALIBRATION=${CALIBRATION:-data/calibration/h200-derived.json}
RUN_S=${RUN_S:-330}
CALL_S=${CALL_S:-560}
MIN_S=${MIN_S:-30}
RUNS=${RUNS:-longtail}
FIT=${FIT:-0}
FIT_OBJECTIVE=${FIT_OBJECTIVE:-relative}
ROW_PAIRS=${ROW_PAIRS:-data/calibration/qwen2.5-3b-row-pairs.json}
GRID_METHODS=${GRID_METHODS:-tokens,cost,cost+tuned}
TARGET=${TARGET:-0}
t_end=$(($(date +%s) + CALL_S))

cd "$(dirname "$0")/.." || exit 2
export PYTHONPATH=python${PYTHONPATH:+:$PYTHONPATH}
mkdir -p "$out"

if [ "$BACKEND" = cuda ]; then
  SCALE=${SCALE:-1}
  shape=(--heads 16 --kv-heads 2 --head-dim 128 --dtype bfloat16 --linear)
  dev_ensure_library "$out"
else
  SCALE=${SCALE:-64}
  shape=(--heads 4 --kv-heads 1 --head-dim 64 --scale-budgets --threads 1 --clock process)
  export MTRAIN_LIBRARY=${MTRAIN_LIBRARY:-build/libmtrain.so}
fi

# preflight: the device and the library
"$PY" - "$BACKEND" <<'EOF' 2>&1 | tee "$out/preflight.log"
import sys

import torch

import mtrain

backend = sys.argv[1]
print(f"torch {torch.__version__}; libmtrain {mtrain.library_path()}, backends "
      f"{', '.join(mtrain.backends())}")
if backend == "cuda":
    if not torch.cuda.is_available() or "cuda" not in mtrain.backends():
        sys.exit("preflight: no CUDA device or a library without the cuda backend")
    print(f"cuda:0 {torch.cuda.get_device_name(0)}")
EOF
if [ "${PIPESTATUS[0]}" -ne 0 ]; then
  echo "preflight failed: $out/preflight.log" >&2
  exit 2
fi

common=(--calibration "$CALIBRATION" --world "$WORLD" --backend "$BACKEND" --scale "$SCALE"
  --reps "$REPS" --warmup 1 "${shape[@]}")
static=(--budgets data/budgets/Qwen2.5_3B_kv_out_v32_fit_o_best_pattern.json --long-tail)

failed=0
done_runs=()
for name in $RUNS; do
  case $name in
  longtail)
    args=("${static[@]}" --methods "$METHODS" --layers "$LAYERS" --grid "$GRID"
      --validate "$VALIDATE")
    [ "$FIT" = 1 ] && args+=(--fit-calibration --fit-objective "$FIT_OBJECTIVE") ;;
  tuned)
    args=("${static[@]}" --methods tokens,cost+tuned --layers "$TUNED_LAYERS" --grid "$GRID") ;;
  topp)
    args=(--budgets "$TOPP_BUDGETS" --equal "$EQUAL_N" --count "$EQUAL_COUNT"
      --methods tokens --layers "$LAYERS" --validate "$VALIDATE") ;;
  measured)
    args=("${static[@]}" --methods tokens,cost,cost+tuned --layers "$TUNED_LAYERS" --grid "$GRID"
      --spread measured) ;;
  grid)
    args=("${static[@]}" --methods "$GRID_METHODS" --layers "$LAYERS" --grid "$GRID"
      --row-pairs "$ROW_PAIRS" --target "$TARGET")
    [ "$FIT" = 1 ] && args+=(--fit-calibration --fit-objective "$FIT_OBJECTIVE") ;;
  *)
    echo "unknown run $name (RUNS: longtail tuned topp measured grid)"
    failed=1
    continue ;;
  esac
  if ! dev_run_limit "$name"; then
    failed=1
    continue
  fi
  echo "$name: $PY tools/balance_measure.py ${common[*]} ${args[*]} --json $out/$name.json"
  if dev_timed_run "$name" "$PY" tools/balance_measure.py "${common[@]}" "${args[@]}" \
    --json "$out/$name.json"; then
    done_runs+=("$name")
  else
    echo "$name: failed or timed out (exit status $run_rc, limit $to s); the end of $out/$name.log:"
    tail -8 "$out/$name.log" | sed 's/^/    /'
  fi
done

for name in "${done_runs[@]}"; do
  echo
  echo "== $name ($out/$name.log)"
  grep -E '^\| |^grid |^validate |^per-document|^balance_measure:|^device ' "$out/$name.log"
done
exit $failed
