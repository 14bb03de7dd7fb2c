#!/usr/bin/env bash
# GPU validation of the kept blocks and of the merged work (one call).
cd .device/src || exit 1
export OUT=${OUT:-/tmp/out}
t0=$SECONDS
bash scripts/device_cuda.sh build 2>&1 | tail -4
MTRAIN_TEST_FILTER='cross_backend_cuda_v3_det1|cuda_async|cuda_select|cuda_faults$|cuda_block_scores|noncausal' \
  bash scripts/device_cuda.sh test 2>&1 | tail -14
cp build-cuda/Testing/Temporary/LastTest.log "$OUT/LastTest.log" 2>/dev/null
grep -E "kept blocks|synchronous call" "$OUT/LastTest.log" | head -6
export LD_LIBRARY_PATH=/tmp/deps/usr/lib/x86_64-linux-gnu:/tmp/deps/usr/lib:${LD_LIBRARY_PATH:-}
echo "== elapsed $((SECONDS - t0)) s; mtrain-bench-cuda, MTRAIN_REUSE_LIMIT 0 against the default, one round"
for round in 1; do
  for lim in 0 peak; do
    echo "-- round $round MTRAIN_REUSE_LIMIT=$lim"
    MTRAIN_REUSE_LIMIT=$lim timeout 120 build-cuda/tools/mtrain-bench-cuda --variants 3 --reps 5 \
      --json "$OUT/bench-reuse-$lim-$round.json" 2>&1 | grep -v "^  *$" | tail -8
  done
done
echo "== elapsed $((SECONDS - t0)) s"
