#!/usr/bin/env bash
# device_multi_gpu.sh: the ring on every GPU of one host (4 or 8 H200s), for
# the GPU machine, from the repository root. Builds (device_cuda.sh build),
# then with W = the GPUs on the host and bf16, 16:2 heads, d 128, the
# Qwen2.5-3B budgets (layer 31, estimated on the GPUs):
#  1. correctness against the fp64 reference (mtrain-run --check, 16K tokens):
#     flat striped, the dense ring (zigzag), and the hierarchical ring with
#     each ranks-per-node in $MTRAIN_HIER_RPN (default "2" for W = 4, "2 4" for
#     W = 8: 2 x 2; 4 x 2 and 2 x 4);
#  2. the token layouts at $MTRAIN_MG_SEQ tokens (default 524288): striped,
#     zigzag and balanced (forward+backward, --repeat 2), each with the
#     report's pair and forward-time imbalance (max/mean over ranks);
#  3. flat against hierarchical (striped) at the same length;
#  4. mtrain-bench: the sparse ring against the dense ring at 512K and 1M
#     (--repeat 1 after one warm-up), and the same at 2 GPUs (W = 2, 256K and
#     512K: the same tokens per GPU) for the scaling.
# Each step has its own timeout; logs in $OUT (mg-*.log), a summary printed.
set -u
# shellcheck source=scripts/device_lib.sh
. "$(dirname "$0")/device_lib.sh" || exit 1
OUT=${OUT:-build-cuda/device-out}
export OUT
mkdir -p "$OUT"
dev_no_nvls
dev_mpi_root
timeout 120 bash scripts/device_cuda.sh build > /dev/null 2>&1
echo "build rc $?"
B=build-cuda/tools
W=$(nvidia-smi -L | wc -l)
data=data/budgets
[ -f "$data/Qwen2.5_3B_kv_out_v32_fit_o_best_pattern.json" ] || { echo "no budget files in $data"; exit 1; }
BUD=(--budgets "$data/Qwen2.5_3B_kv_out_v32_fit_o_best_pattern.json" --layer 31)
COM=(--backend cuda --dtype bf16 --heads 16 --kv-heads 2 --head-dim 128)
rpns=${MTRAIN_HIER_RPN:-$([ "$W" -ge 8 ] && echo "2 4" || echo "2")}
seq=${MTRAIN_MG_SEQ:-524288}
echo "GPUs: $W; hierarchical ranks per node: $rpns"
nvidia-smi topo -m > "$OUT/mg-topo.log" 2>&1

run() { # name timeout ranks args...
  local name=$1 to=$2 n=$3
  shift 3
  echo "== mpiexec -n $n mtrain-run $*" > "$OUT/mg-$name.log"
  timeout "$to" mpiexec -n "$n" --bind-to none $B/mtrain-run "$@" >> "$OUT/mg-$name.log" 2>&1
  local rc=$?
  printf '%-22s rc %3d  %s | %s | %s\n' "$name" $rc \
    "$(grep -m1 -E '^  total' "$OUT/mg-$name.log" | sed 's/^ *//')" \
    "$(grep -m1 -E '^  imbalance' "$OUT/mg-$name.log" | sed 's/^ *//')" \
    "$(grep -m1 -E '^  check' "$OUT/mg-$name.log" | sed 's/^ *check *//' | cut -c1-70)"
}

# 1. correctness
run check-flat 150 "$W" "${COM[@]}" --seq-len 16384 --layout striped --check "${BUD[@]}"
run check-dense 150 "$W" "${COM[@]}" --seq-len 16384 --layout zigzag --check
for r in $rpns; do
  run "check-hier-$((W / r))x$r" 150 "$W" "${COM[@]}" --seq-len 16384 --layout striped --check \
    --schedule hier --ranks-per-node "$r" "${BUD[@]}"
done
# 2, 3. layouts, flat against hierarchical
for lay in striped zigzag balanced; do
  run "layout-$lay" 120 "$W" "${COM[@]}" --seq-len "$seq" --layout "$lay" --repeat 2 "${BUD[@]}"
done
for r in $rpns; do
  run "hier-$((W / r))x$r" 120 "$W" "${COM[@]}" --seq-len "$seq" --layout striped --repeat 2 \
    --schedule hier --ranks-per-node "$r" "${BUD[@]}"
done
# 4. sparse against dense, and the scaling at fixed tokens per GPU
bench() { # name timeout ranks tokens
  local name=$1 to=$2 n=$3 toks=$4
  echo "== mpiexec -n $n mtrain-bench --tokens-list $toks" > "$OUT/mg-$name.log"
  timeout "$to" mpiexec -n "$n" --bind-to none $B/mtrain-bench "${COM[@]}" \
    --budgets "$data/Qwen2.5_3B_kv_out_v32_fit_o_best_pattern.json" --layers 31 \
    --tokens-list "$toks" --warmup 1 --repeat 1 --json "$OUT/mg-$name.json" \
    >> "$OUT/mg-$name.log" 2>&1
  echo "$name rc $?"
  sed -n '/^mtrain-bench: backend/,$p' "$OUT/mg-$name.log"
}
bench "bench-w$W" 200 "$W" 524288,1048576
bench "bench-w2" 150 2 262144,524288
