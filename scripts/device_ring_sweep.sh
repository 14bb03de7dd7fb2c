#!/usr/bin/env bash
# device_ring_sweep.sh: the 2-GPU ring sweep of docs/PERFORMANCE.md ("128K,
# 512K and 1M tokens, three layers"), for the 2-GPU machine, from the
# repository root: build; the NCCL tests; mtrain-bench at 128K and 512K
# (layers 3, 15, 31 and the dense ring, 3 timed runs) and at 1M (layers 15
# and 31 and the dense ring, one timed run); the torch dense ring peer at
# 512K. Outputs in $OUT (rb512.*, rb1m.*, torch512.log, and the stages' logs).
# These are the commands of the call of 2026-11-22 (then run from a copy of
# the tree in .device/src, with the same stage timeouts).
set -u
# shellcheck source=scripts/device_lib.sh
. "$(dirname "$0")/device_lib.sh" || exit 1
OUT=${OUT:-build-cuda/device-out}
export OUT
mkdir -p "$OUT"
S=scripts/device_cuda.sh
timeout 80 bash $S build > /dev/null 2>&1
echo "build rc $?"
timeout 150 bash $S nccl 2>&1 | grep -E "^  |^nccl "
MTRAIN_RING_SEQS=131072,524288 timeout 170 bash $S ringbench2 2>&1 |
  sed -n '/^mtrain-bench: backend/,/^(s:/p'
mv "$OUT/ringbench2.log" "$OUT/rb512.log"
mv "$OUT/ringbench2.json" "$OUT/rb512.json"
MTRAIN_RING_SEQS=1048576 MTRAIN_RING_LAYERS=15,31 MTRAIN_RING_DENSE_MAX=2000000 MTRAIN_RING_REPEAT=1 \
  timeout 150 bash $S ringbench2 2>&1 | sed -n '/^mtrain-bench: backend/,/^(s:/p'
mv "$OUT/ringbench2.log" "$OUT/rb1m.log"
mv "$OUT/ringbench2.json" "$OUT/rb1m.json"
dev_no_nvls
timeout 75 torchrun --nproc_per_node 2 tools/bench_ring_torch_peer.py --seq-len 524288 --reps 3 \
  --warmup 1 --no-check > "$OUT/torch512.log" 2>&1
echo "torch rc $?"
tail -1 "$OUT/torch512.log"
