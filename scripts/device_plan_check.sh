#!/usr/bin/env bash
# device_plan_check.sh: the GPU machine's checks and measurements of plans
# built on the device (mtrain_plan_create_estimated), in one command. From
# the repository root, after nothing else (it builds):
#
#   bash scripts/device_plan_check.sh [LAYERS]
#
#  1. build (scripts/device_cuda.sh build: build-cuda/, sm_90a);
#  2. the CUDA tests that touch the estimate, the plan and the kernels that
#     read it: test_cuda_device_plan (device plan bitwise the host plan),
#     test_cuda_select, test_cuda_async, test_cross_backend cuda 3 (det.);
#  3. compute-sanitizer memcheck and racecheck on test_cuda_device_plan
#     (MTRAIN_TEST_QUICK=1);
#  4. the Python GPU tests of the device plan (tests/python/test_cuda.py);
#  5. tools/bench_model.py --steps on the Qwen2.5-3B budgets at 131072
#     tokens, layers LAYERS (default 3,15,31): the training step's view with
#     the plan built on the GPU and on the host, dense ours and cuDNN.
# Logs and JSON go to $OUT (default build-cuda/device-out); a summary last.
set -uo pipefail
# shellcheck source=scripts/device_lib.sh
. "$(dirname "$0")/device_lib.sh" || exit 1
root=$(cd "$(dirname "$0")/.." && pwd)
OUT=${OUT:-$root/build-cuda/device-out}
mkdir -p "$OUT"
layers=${1:-3,15,31}
export OUT
dev_deps_openblas # the OpenBLAS that device_cuda.sh unpacks from .device/debs
stages=${STAGES:-build tests sanitize pytest bench} # a subset: STAGES="tests sanitize"
summary=()
log=$OUT/check.log # every step's output, one after the other (dev_step)
: > "$log"
if dev_want build && ! dev_step build bash "$root/scripts/device_cuda.sh" build; then
  tail -40 "$OUT/build.log"
  exit 1
fi
build=$root/build-cuda
dev_want tests && dev_step tests bash -c "cd $build && ctest -R 'cuda_device_plan|cuda_select|cuda_async|cross_backend_cuda_v3_det1' --output-on-failure --timeout 900"
cs=$(dev_sanitizer)
dev_want sanitize && dev_step sanitize bash -c "MTRAIN_TEST_QUICK=1 $cs --tool memcheck --error-exitcode 99 $build/tests/test_cuda_device_plan && MTRAIN_TEST_QUICK=1 $cs --tool racecheck --error-exitcode 99 $build/tests/test_cuda_device_plan"
PYTEST_K="device_plan or does_not_wait or estimate or attention_against_reference"
export MTRAIN_LIBRARY=$build/libmtrain.so PYTHONPATH=$root/python PYTHONUNBUFFERED=1
dev_want pytest && dev_step pytest bash -c "cd $root && python3 -m pytest -q -p no:cacheprovider -s tests/python/test_cuda.py -k '$PYTEST_K'"
dev_want bench && dev_step bench python3 "$root/tools/bench_model.py" --layers "$layers" --reps 2 --warmup 1 --dense-above none --steps --json "$OUT/bench_model_steps.json"
printf '%s\n' "${summary[@]}" | tee -a "$log"
grep -A8 "^NVIDIA\|^H200\|dense per layer" "$log" | tail -10
