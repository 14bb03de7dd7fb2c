#!/usr/bin/env bash
# device_block_scores.sh: the GPU machine's checks and measurements of the
# cuda block scores (SPEC.md section 9: the tensor-core kernels of
# backends/cuda/block_scores_mma.cuh, the default, and the exact fp64 ones,
# MTRAIN_CUDA_BLOCK_SCORES=fp64), in one command. From the repository root,
# after nothing else (it builds):
#
#   bash scripts/device_block_scores.sh [SEQS]
#
#  1. build (scripts/device_cuda.sh build: build-cuda/, sm_90a);
#  2. test_cuda_block_scores (the fp64 kernels within 1e-12 of cpu-ref, the
#     tensor-core kernels within their derived tolerance, subsets bitwise,
#     selections end to end);
#  3. compute-sanitizer memcheck and racecheck on it (MTRAIN_TEST_QUICK=1);
#  4. the Python GPU tests of the block selection (tests/python/test_cuda.py
#     -k block);
#  5. mtrain-block-curves gpucost N for N in SEQS (default 8192,16384,32768):
#     each selection against the cuda dense forward, precise and antidiag
#     on the tensor cores and in fp64.
# STAGES picks a subset (default "build tests sanitize pytest bench"). Logs go
# to $OUT (default build-cuda/device-out); a summary last.
set -uo pipefail
# shellcheck source=scripts/device_lib.sh
. "$(dirname "$0")/device_lib.sh" || exit 1
root=$(cd "$(dirname "$0")/.." && pwd)
OUT=${OUT:-$root/build-cuda/device-out}
mkdir -p "$OUT"
seqs=${1:-8192,16384,32768}
export OUT
dev_deps_openblas # the OpenBLAS that device_cuda.sh unpacks from .device/debs
stages=${STAGES:-build tests sanitize pytest bench}
summary=()
log=$OUT/block_scores.log # every step's output, one after the other (dev_step)
: > "$log"
if dev_want build && ! dev_step build bash "$root/scripts/device_cuda.sh" build; then
  tail -40 "$OUT/build.log" 2>/dev/null
  exit 1
fi
build=$root/build-cuda
dev_want tests && dev_step tests "$build/tests/test_cuda_block_scores"
cs=$(dev_sanitizer)
dev_want sanitize && dev_step sanitize bash -c "MTRAIN_TEST_QUICK=1 $cs --tool memcheck --error-exitcode 99 $build/tests/test_cuda_block_scores && MTRAIN_TEST_QUICK=1 $cs --tool racecheck --error-exitcode 99 $build/tests/test_cuda_block_scores"
export MTRAIN_LIBRARY=$build/libmtrain.so PYTHONPATH=$root/python PYTHONUNBUFFERED=1
dev_want pytest && dev_step pytest bash -c "cd $root && python3 -m pytest -q -p no:cacheprovider -s tests/python/test_cuda.py -k block"
if dev_want bench; then
  for n in ${seqs//,/ }; do
    dev_step "gpucost $n" "$build/tools/mtrain-block-curves" gpucost "$n"
  done
fi
printf '%s\n' "${summary[@]}" | tee -a "$log"
grep -E "^\| |dense forward|largest error / tolerance" "$log" | tail -40
