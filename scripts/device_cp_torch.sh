#!/usr/bin/env bash
# device_cp_torch.sh: issue 24's PyTorch context-parallel runs on every GPU of one host, for the
# GPU machine, from the repository root (docs/PYTORCH.md, "Context parallel on several GPUs: the
# check and the benchmark"). Builds nothing: it assumes `bash scripts/device_cuda.sh build` has
# built build-cuda/libmtrain.so (with the NCCL communicator; MTRAIN_LIBRARY overrides the path)
# and that /tmp/deps holds the unpacked dependencies (device_cuda.sh unpacks .device/debs there);
# python3 (or $PYTHON) with torch and CUDA; torchrun on the PATH (else $PYTHON -m
# torch.distributed.run). With W = the GPUs on the host, the package from python/ (PYTHONPATH),
# one process per GPU:
#  1. tools/cp_check.py on W GPUs (NCCL): mtrain's context parallel against one GPU, a packed
#     batch of 7001 + 5003 + 2950 tokens, 16:2 heads, head dims 128 and 64, bf16 and fp16, the
#     four layouts and the four pattern sources, the fp64 reference, the error paths;
#  2. the same on 2 GPUs when W >= 4;
#  3. tools/bench_cp_torch.py at 131072 and 524288 tokens (bf16, 16:2 heads, d 128, causal):
#     mtrain sparse (striped, the Qwen2.5-3B budgets of layer 31 estimated every iteration),
#     mtrain dense (zigzag), torch's context_parallel with SDPA, the ring-flash-attention-style
#     peer; 1 warm-up, median of 3;
#  4. the same at 1048576 tokens with 1 warm-up and 1 timed run; torch's CP and the ring peer
#     (dense, several seconds per iteration) only when MTRAIN_CP_DENSE_1M=1 (the default);
#     MTRAIN_CP_DENSE_1M=0 leaves them out (mtrain's dense ring stays: it is the baseline of the
#     speed-up).
# MTRAIN_CP_STEPS picks the steps (default "check bench bench1m": 1-2, 3, 4), so that the
# checks and the benchmark can go in two device commands on the same machine.
# MTRAIN_CP_CHECK_ARGS and MTRAIN_CP_BENCH_ARGS are appended to the tools' arguments (a later
# option wins: --seq-lens 8192 makes a short trial). Each step has its own timeout, cut to what
# is left of $MTRAIN_CP_DEADLINE seconds (default 540) since the start; logs in $OUT (default
# build-cuda/device-out), five files: cp-check-wW.log, cp-check-w2.log, cp-bench.log,
# cp-bench.json (128K and 512K), cp-bench-1m.json; a summary is printed last. Expected: about 6
# minutes on 4 H100s. Exit status 0 when every step passed. OMP_NUM_THREADS: the host's cores
# over W, at most 16, unless set (torchrun's own default is 1 thread per rank).
set -u
# shellcheck source=scripts/device_lib.sh
. "$(dirname "$0")/device_lib.sh" || exit 1
cd "$(dirname "$0")/.." || exit 1
OUT=${OUT:-build-cuda/device-out}
mkdir -p "$OUT"
dev_no_nvls
dev_deps_ld_path # what device_cuda.sh unpacked from .device/debs
export MTRAIN_LIBRARY=${MTRAIN_LIBRARY:-$PWD/build-cuda/libmtrain.so}
export PYTHONPATH=python${PYTHONPATH:+:$PYTHONPATH}
export MTRAIN_COMM_TIMEOUT=${MTRAIN_COMM_TIMEOUT:-120}
export TORCH_NCCL_ASYNC_ERROR_HANDLING=${TORCH_NCCL_ASYNC_ERROR_HANDLING:-1}
PY=${PYTHON:-python3}
deadline=${MTRAIN_CP_DEADLINE:-540}
dense_1m=${MTRAIN_CP_DENSE_1M:-1}
if command -v torchrun > /dev/null; then RUN=(torchrun); else RUN=("$PY" -m torch.distributed.run); fi

W=$(nvidia-smi -L 2> /dev/null | wc -l)
[ "$W" -ge 1 ] || { echo "device_cp_torch.sh: no GPU (nvidia-smi -L)"; exit 1; }
# the host cores shared by the ranks (torchrun's default is 1 thread per rank): the plan and the
# cuda step tables are built on the host with OpenMP (docs/PYTORCH.md, "Threads")
omp=$(($(nproc) / W))
[ "$omp" -gt 16 ] && omp=16
[ "$omp" -lt 1 ] && omp=1
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-$omp}
[ -f "$MTRAIN_LIBRARY" ] || { echo "device_cp_torch.sh: no $MTRAIN_LIBRARY: run 'bash scripts/device_cuda.sh build' first"; exit 1; }
"$PY" -c "
import torch, mtrain
from mtrain import _lib
n = torch.cuda.device_count()
print('torch', torch.__version__, 'cuda', torch.version.cuda, '| GPUs', n,
      torch.cuda.get_device_name(0) if n else '-', '| libmtrain', mtrain.library_path(),
      'backends', mtrain.backends(), '| NCCL communicator:', _lib.lib().has('comm_create_nccl'))
" || { echo "device_cp_torch.sh: torch or mtrain does not import"; exit 1; }
methods=mtrain-sparse,mtrain-dense
[ "$dense_1m" = 1 ] && methods=$methods,torch-cp,ring-peer
echo "GPUs: $W; OUT=$OUT; deadline ${deadline} s; methods at 1M: $methods; OMP_NUM_THREADS=$OMP_NUM_THREADS"

summary=()
failed=0
# step NAME TIMEOUT LOG NPROC SCRIPT ARGS...: one torchrun call with what is left of the deadline
step() {
  local name=$1 to=$2 log=$3 n=$4 script=$5
  shift 5
  local left=$((deadline - SECONDS - 5))
  if [ "$left" -lt 30 ]; then
    summary+=("$name|not run|0|no time left of the ${deadline} s deadline")
    failed=1
    return 1
  fi
  [ "$to" -gt "$left" ] && to=$left
  local t0=$SECONDS from
  from=$(($(wc -l < "$log") + 1))
  {
    echo "== $(date -u +%FT%TZ) ${RUN[*]} --standalone --nproc_per_node $n $script $* (timeout $to s)"
    timeout "$to" "${RUN[@]}" --standalone --nproc_per_node "$n" "$script" "$@"
  } >> "$log" 2>&1
  local rc=$?
  local detail new
  new=$(tail -n "+$from" "$log")
  if [ "$script" = tools/cp_check.py ]; then
    detail=$(grep -E "^cp_check: [0-9]+ cases" <<< "$new" | sed 's/^cp_check: //')
  else # "method@N status" of each run that did not end ok
    detail="$(grep -cE "^bench_cp_torch: [a-z-]+ at N=[0-9]+: ok" <<< "$new") ok"
    detail+=$(grep -oE "^bench_cp_torch: [a-z-]+ at N=[0-9]+: (failed|skipped).{0,60}" <<< "$new" |
      sed -E 's/^bench_cp_torch: ([a-z-]+) at N=([0-9]+): /; \1@\2 /' | tr -d '\n')
  fi
  [ $rc -eq 124 ] && detail="TIMEOUT after $to s; $detail"
  if [ $rc -eq 0 ]; then
    summary+=("$name|ok|$((SECONDS - t0))|$detail")
  else
    summary+=("$name|FAILED rc $rc|$((SECONDS - t0))|$detail")
    failed=1
  fi
  return $rc
}

steps=" ${MTRAIN_CP_STEPS:-check bench bench1m} "
chk="$OUT/cp-check-w$W.log"
if [[ $steps == *" check "* ]]; then
: > "$chk"
# shellcheck disable=SC2086 # the extra arguments are words
step "cp_check W=$W" 150 "$chk" "$W" tools/cp_check.py ${MTRAIN_CP_CHECK_ARGS:-}
fi
if [[ $steps == *" check "* ]] && [ "$W" -ge 4 ]; then
  : > "$OUT/cp-check-w2.log"
  # shellcheck disable=SC2086
  CUDA_VISIBLE_DEVICES=0,1 step "cp_check W=2" 120 "$OUT/cp-check-w2.log" 2 tools/cp_check.py \
    ${MTRAIN_CP_CHECK_ARGS:-}
fi

bench="$OUT/cp-bench.log"
{
  echo "== nvidia-smi topo -m"
  nvidia-smi topo -m 2>&1
} > "$bench"
# shellcheck disable=SC2086
[[ $steps == *" bench "* ]] && step "bench 128K, 512K" 200 "$bench" "$W" tools/bench_cp_torch.py --seq-lens 131072,524288 \
  --reps 3 --warmup 1 --json "$OUT/cp-bench.json" ${MTRAIN_CP_BENCH_ARGS:-}
# shellcheck disable=SC2086
[[ $steps == *" bench1m "* ]] && step "bench 1M" 200 "$bench" "$W" tools/bench_cp_torch.py --seq-lens 1048576 \
  --reps 1 --warmup 1 --methods "$methods" --json "$OUT/cp-bench-1m.json" ${MTRAIN_CP_BENCH_ARGS:-}

echo
echo "== the tables (rank 0's, from $bench)"
grep -E "^\|" "$bench"
echo
echo "== device_cp_torch.sh summary ($((SECONDS)) s in all; logs in $OUT)"
for s in "${summary[@]}"; do
  IFS='|' read -r name status secs detail <<< "$s"
  printf '%-18s %-14s %5s s  %s\n' "$name" "$status" "$secs" "$detail"
done
exit $failed
