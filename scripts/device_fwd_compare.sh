#!/usr/bin/env bash
# device_fwd_compare.sh: variant 3's two forward kernels on the GPU machine in
# one command (docs/CUDA_KERNELS.md, "The persistent forward"): the persistent
# wgmma_fwd_persistent_kernel (MTRAIN_CUDA_WGMMA_FWD_PERSISTENT=1, the
# default) against one CTA per item (=0), built once, then
#  1. tests: test_cuda_fwd_persistent (the two kernels bit for bit), the
#     cross-backend table of variant 3 (the _bwd1 runs take the one-item
#     forward), the layout test;
#  2. compute-sanitizer racecheck and memcheck on the quick cross-backend cases
#     of variant 3 with the persistent forward (deterministic), and racecheck
#     on test_cuda_fwd_persistent;
#  3. timing: tools/bench_block_kernels.py --queued at 32768 tokens, d 128 and
#     d 64, dense and 4 and 16 key blocks per row, persistent on and off in
#     two interleaved rounds each; mtrain-bench-cuda (dense, vertical-slash)
#     with each kernel. STAGES selects a subset of "build tests sanitize bench".
# Logs to $OUT (default build-cuda/device-out): fwd_compare.log and the JSON files.
set -uo pipefail
# shellcheck source=scripts/device_lib.sh
. "$(dirname "$0")/device_lib.sh" || exit 1
root=$(cd "$(dirname "$0")/.." && pwd)
OUT=${OUT:-$root/build-cuda/device-out}
mkdir -p "$OUT"
export OUT
dev_deps_openblas # the OpenBLAS that device_cuda.sh unpacks from .device/debs
stages=${STAGES:-build tests sanitize bench}
build=$root/build-cuda
log=$OUT/fwd_compare.log
: > "$log"
say() { echo "==== $* ($(date +%H:%M:%S))" | tee -a "$log"; }
if dev_want build; then
  say build
  bash "$root/scripts/device_cuda.sh" build >> "$log" 2>&1 || { tail -40 "$OUT/build.log"; exit 1; }
fi
rc=0
if dev_want tests; then
  say tests
  (cd "$build" && ctest -R "cuda_fwd_persistent|cross_backend_cuda_v3|cuda_wgmma_layout" \
    --output-on-failure --timeout 1500) >> "$log" 2>&1 || rc=1
  grep -E "Test +#|tests passed" "$log" | tail -8
fi
if dev_want sanitize; then
  say sanitize
  cs=$(dev_sanitizer)
  for tool in racecheck memcheck; do
    echo "== $tool, variant 3, persistent forward" >> "$log"
    MTRAIN_CUDA_WGMMA_FWD_PERSISTENT=1 MTRAIN_DETERMINISTIC=1 MTRAIN_TEST_QUICK=1 "$cs" \
      --tool $tool --error-exitcode 99 "$build/tests/test_cross_backend" cuda 3 >> "$log" 2>&1 ||
      rc=1
    grep -E "ERROR SUMMARY|RACECHECK SUMMARY" "$log" | tail -1
  done
  echo "== racecheck, test_cuda_fwd_persistent" >> "$log"
  "$cs" --tool racecheck --error-exitcode 99 "$build/tests/test_cuda_fwd_persistent" \
    >> "$log" 2>&1 || rc=1
  grep -E "RACECHECK SUMMARY" "$log" | tail -1
fi
if dev_want bench; then
  say bench
  blocks() { # persistent d round
    echo "== bench_block_kernels, MTRAIN_CUDA_WGMMA_FWD_PERSISTENT=$1, d $2, round $3" >> "$log"
    MTRAIN_CUDA_WGMMA_FWD_PERSISTENT=$1 MTRAIN_LIBRARY=$build/libmtrain.so \
      PYTHONPATH=$root/python python3 "$root/tools/bench_block_kernels.py" --queued \
      --seq-len 32768 --keep 4,16 --head-dim "$2" \
      --json "$OUT/block_kernels_pers$1_d$2_r$3.json" >> "$log" 2>&1 || rc=1
  }
  for d in 128 64; do
    for r in 1 2; do
      blocks 1 "$d" "$r"
      blocks 0 "$d" "$r"
    done
  done
  for p in 1 0; do
    for d in 64 128; do
      h=$([ "$d" = 64 ] && echo 8 || echo 16)
      echo "== mtrain-bench-cuda, MTRAIN_CUDA_WGMMA_FWD_PERSISTENT=$p, d $d" >> "$log"
      MTRAIN_CUDA_WGMMA_FWD_PERSISTENT=$p "$build/tools/mtrain-bench-cuda" --seq-len 32768 \
        --heads "$h" --kv-heads 2 --head-dim "$d" --variants 3 --reps 7 --warmup 2 \
        --validate-len 2048 >> "$log" 2>&1 || rc=1
    done
  done
fi
echo "rc $rc"
exit $rc
