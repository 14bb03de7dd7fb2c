#!/usr/bin/env bash
# device_kernel_ab.sh: a kernel change against the tree before it, on the GPU machine in one call
# (docs/PERFORMANCE.md, "Variant 3's forward": the method of its three comparisons). From the
# repository root, with the tree before the change packed beside it:
#
#   git archive REV | gzip > .device/base.tar.gz      # here, before the call (REV: the base)
#   bash scripts/device_kernel_ab.sh                   # there, carry [".device"]
#
# runs, each step under `timeout` cut to what is left of CALL_S (default 560 s), the most
# important first, so that a call that runs out of time loses the base's rounds, not the tests:
#   1. build this tree (scripts/device_cuda.sh build);
#   2. tests of this tree: test_cuda_fwd_persistent, test_cross_backend cuda 3,
#      test_cuda_kv_split, test_cuda_wgmma_layout;
#   3. compute-sanitizer memcheck, racecheck and synccheck on the quick test_cross_backend cuda 3;
#   4. the base: BASE (default .device/base.tar.gz) unpacked into /tmp/kernel-ab-base and built;
#   5. ROUNDS (default 2) rounds of mtrain-bench-cuda (variant 3, 32768 tokens, 16:2 heads,
#      bf16, causal, dense and vertical-slash) at each head_dim of DIMS (default "128 64"), this
#      tree then the base, interleaved; SDPA cuDNN and flash (tools/bench_cuda_peers.py) once
#      per head_dim in the same call;
#   6. the table: forward and forward+backward medians per tree, head_dim and round.
# Logs and JSON to $OUT (default build-cuda/device-out): kernel_ab.log, ab-*.json.
set -uo pipefail
# shellcheck source=scripts/device_lib.sh
. "$(dirname "$0")/device_lib.sh" || exit 1
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root" || exit 1
dev_call_start kernel_ab 560 10
BASE=${BASE:-.device/base.tar.gz}
ROUNDS=${ROUNDS:-2}
DIMS=${DIMS:-128 64}
[[ $ROUNDS =~ ^[1-9][0-9]*$ ]] || { echo "device_kernel_ab.sh: ROUNDS='$ROUNDS': expected a positive integer" >&2; exit 2; }
for d in $DIMS; do
  [ "$d" = 64 ] || [ "$d" = 128 ] || { echo "device_kernel_ab.sh: DIMS='$DIMS': head_dims 64 and 128 only" >&2; exit 2; }
done
base_dir=/tmp/kernel-ab-base
dev_deps_openblas
step() { dev_limited_step "$@"; } # NAME LIMIT CMD...
bench() { # TREE_BUILD D TAG: mtrain-bench-cuda of one tree at head_dim D into ab-TAG.json
  step "bench-$3" 40 "$1/tools/mtrain-bench-cuda" --seq-len 32768 --heads 16 --kv-heads 2 \
    --head-dim "$2" --variants 3 --reps 10 --warmup 3 --validate-len 2048 --json "$OUT/ab-$3.json"
}

step build 150 bash scripts/device_cuda.sh build || { tail -30 "$log"; exit 1; }
B=$root/build-cuda
step fwd_persistent 60 "$B/tests/test_cuda_fwd_persistent"
step cross_backend_v3 120 "$B/tests/test_cross_backend" cuda 3
step kv_split 60 "$B/tests/test_cuda_kv_split"
step wgmma_layout 20 "$B/tests/test_cuda_wgmma_layout"
cs=$(dev_sanitizer)
for tool in memcheck racecheck synccheck; do
  step "$tool" 60 env MTRAIN_DETERMINISTIC=1 MTRAIN_TEST_QUICK=1 "$cs" --tool "$tool" \
    --error-exitcode 99 "$B/tests/test_cross_backend" cuda 3
done
have_base=0
if [ -f "$BASE" ]; then
  rm -rf "$base_dir" && mkdir -p "$base_dir" && tar xzf "$BASE" -C "$base_dir" &&
    ln -sfn "$root/.device" "$base_dir/.device"
  step build_base 150 env OUT="$base_dir/out" bash -c \
    "mkdir -p \"\$OUT\" && cd '$base_dir' && bash scripts/device_cuda.sh build" && have_base=1
else
  echo "no base tree ($BASE): this tree only" | tee -a "$log"
fi
export PYTHONPATH=$root/python
for d in $DIMS; do
  for r in $(seq 1 "$ROUNDS"); do
    bench "$B" "$d" "new-d$d-r$r"
    [ "$have_base" = 1 ] && bench "$base_dir/build-cuda" "$d" "base-d$d-r$r"
  done
  step "cudnn-d$d" 60 python3 tools/bench_cuda_peers.py --seq-len 32768 --heads 16 --kv-heads 2 \
    --head-dim "$d" --peers sdpa-cudnn,sdpa-flash --reps 10 --warmup 3 --json "$OUT/ab-peers-d$d.json"
done
echo "==== summary" | tee -a "$log"
printf '  %s\n' "${summary[@]}" | tee -a "$log"
grep -E "ERROR SUMMARY|RACECHECK SUMMARY" "$log"
python3 - "$OUT" <<'EOF' | tee -a "$log"
"""The table: forward and forward+backward medians of every ab-*.json."""
import glob
import json
import os
import sys

print("| run | pattern | fwd ms | fwd+bwd ms |")
print("|---|---|---|---|")
for path in sorted(glob.glob(os.path.join(sys.argv[1], "ab-*.json"))):
    doc = json.load(open(path))
    rows = doc["results"] if isinstance(doc, dict) and "results" in doc else doc.get("rows", doc)
    for r in rows:
        name = r.get("peer") or os.path.basename(path)[3:-5]
        fb = r.get("forward_backward_ms")
        print(f"| {name} | {r.get('pattern')} | {r['forward_ms']:.3f} | {fb:.3f} |"
              if fb else f"| {name} | {r.get('pattern')} | {r['forward_ms']:.3f} | - |")
EOF
