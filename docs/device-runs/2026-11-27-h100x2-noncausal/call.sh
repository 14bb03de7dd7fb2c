#!/usr/bin/env bash
# Issue 23 (non-causal plans on cuda) and the estimate change on GPUs: build, the CUDA ctests
# (cross-backend rows incl. non-causal, test_noncausal_cuda, select, block scores, async, faults),
# test_nccl_ring on 2 GPUs (non-causal ring patterns; the estimate combined on the GPUs), the
# package's CUDA tests for non-causal masks and block selection, and a dense/sparse timing.
set -u
export OUT=${OUT:-/tmp/out}
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
t0=$SECONDS
nvidia-smi -L
bash scripts/device_cuda.sh build 2>&1 | tail -2
export LD_LIBRARY_PATH=/tmp/deps/usr/lib/x86_64-linux-gnu:/tmp/deps/usr/lib:${LD_LIBRARY_PATH:-}
echo "== ctest cuda at $((SECONDS - t0)) s"
(cd build-cuda && timeout 240 ctest -j4 -R "cuda|noncausal" -E emu --output-on-failure > "$OUT/ctest-cuda.log" 2>&1
 echo "rc $?"; grep -E "Test +#|tests passed|tests failed|Skipped|Failed" "$OUT/ctest-cuda.log" | tail -22)
echo "== test_nccl_ring -n 2 at $((SECONDS - t0)) s"
T=build-cuda/tests/test_nccl_ring
timeout 100 mpiexec -n 2 --oversubscribe --bind-to none "$T" 1 2 > "$OUT/nccl-ring-w2.log" 2>&1
echo "rc $?"; grep -E "FAILED|pattern 5|estimate|passed, " "$OUT/nccl-ring-w2.log" | grep -vE "^passed: .*pattern [0-4] " | tail -12
echo "== pytest at $((SECONDS - t0)) s"
MTRAIN_LIBRARY=$PWD/build-cuda/libmtrain.so PYTHONPATH=python timeout 90 python3 -m pytest -q \
  tests/python/test_cuda.py -k "noncausal or block_selection" > "$OUT/pytest.log" 2>&1
echo "rc $?"; tail -4 "$OUT/pytest.log"
left=$((570 - (SECONDS - t0)))
if [ "$left" -gt 60 ]; then
  echo "== mtrain-bench-cuda variant 3 at $((SECONDS - t0)) s"
  timeout $((left - 20)) build-cuda/tools/mtrain-bench-cuda --variants 3 --reps 5 --json "$OUT/bench.json" > "$OUT/bench.log" 2>&1
  echo "rc $?"; grep -E "dense|vertical|variant|ms" "$OUT/bench.log" | tail -14
fi
echo "== end at $((SECONDS - t0)) s"
