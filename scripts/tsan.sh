#!/usr/bin/env bash
# tsan.sh: ThreadSanitizer over the OpenMP path (docs/VALIDATION.md). Builds
# build-tsan/ with clang, -fsanitize=thread and LLVM's OpenMP runtime (GCC's
# libgomp is not instrumented: its barriers are invisible to TSan and every
# parallel loop then reports false races), and runs with LLVM's Archer tool
# (libarcher.so, from libomp-dev), which tells TSan about OpenMP's
# synchronisation. Runs the unit tests that reach OpenMP code (2 threads;
# MTRAIN_TEST_QUICK=1 for the cross-backend table), the ring and the memory
# test under mpiexec with 2 OpenMP threads per rank, and a short main job.
# Any report fails the run (TSan exits 66). About 3.5 minutes on 2 cores,
# the build included.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
build="$root/build-tsan"
log="$build/tsan-build.log"
export CC=${CC:-clang}
mkdir -p "$build"
cmake -S "$root" -B "$build" -DCMAKE_BUILD_TYPE=RelWithDebInfo -DMTRAIN_SANITIZE=thread \
  -DMTRAIN_WITH_CUDA=OFF -DMTRAIN_WITH_NCCL=OFF > "$log"
# Archer of the same LLVM as the OpenMP runtime the build links
omp_lib=$(sed -n 's/^OpenMP_omp_LIBRARY:FILEPATH=//p' "$build/CMakeCache.txt")
archer="$(dirname "${omp_lib:-/nonexistent}")/libarcher.so"
if [ ! -f "$archer" ]; then
  echo "tsan.sh: the build links OpenMP runtime '${omp_lib}', next to which there is no" \
    "libarcher.so (needs clang with LLVM's libomp: apt-get install clang libomp-dev)" >&2
  exit 1
fi
unit="status pattern plan io_npy io_pattern gradcheck cross_backend bad_input estimate budgets"
unit="$unit layout cost_model inputs permute determinism env memory"
targets=""
for t in $unit; do targets="$targets test_$t"; done
mpi=$(sed -n 's/^MTRAIN_WITH_MPI:BOOL=//p' "$build/CMakeCache.txt")
[ "$mpi" = ON ] && targets="$targets test_mpi_ring test_memory_mpi mtrain-run"
# shellcheck disable=SC2086
cmake --build "$build" -j "$(nproc)" --target $targets >> "$log" ||
  { cat "$log"; exit 1; }

export OMP_TOOL_LIBRARIES="$archer"
export TSAN_OPTIONS="ignore_noninstrumented_modules=1 ${TSAN_OPTIONS:-}"
export MTRAIN_TEST_QUICK=1
cd "$build"
# Archer must be active, or the OpenMP runtime's barriers show as races
probe=$(ARCHER_OPTIONS=verbose=1 OMP_NUM_THREADS=2 tests/test_determinism 2>&1 || true)
if ! grep -q "Archer detected" <<< "$probe"; then
  echo "tsan.sh: $archer did not load (OMP_TOOL_LIBRARIES)" >&2
  exit 1
fi
echo "== unit tests under ThreadSanitizer (Archer: $archer)"
ctest --output-on-failure --timeout 1800 -j 1 -R "^test_($(echo "$unit" | tr ' ' '|'))\$"
[ "$mpi" = ON ] || { echo "tsan.sh: built without MPI: the ring tests are skipped"; exit 0; }

echo "== the ring under ThreadSanitizer, 2 OpenMP threads per rank"
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMP_NUM_THREADS=2
failed=0
run_mpi() { # ranks, log name, program and arguments
  local n=$1 name=$2 start=$SECONDS
  shift 2
  if mpiexec -n "$n" --oversubscribe --bind-to none "$@" > "tsan_$name.log" 2>&1; then
    echo "passed: $name ($((SECONDS - start)) s)"
  else
    echo "FAILED: $name (log: $build/tsan_$name.log)"
    grep -A30 "WARNING: ThreadSanitizer" "tsan_$name.log" | head -60 || tail -30 "tsan_$name.log"
    failed=1
  fi
}
run_mpi 2 mpi_ring_w2 tests/test_mpi_ring
run_mpi 3 mpi_ring_w3 tests/test_mpi_ring
run_mpi 4 mpi_ring_w4_hier2 tests/test_mpi_ring 2
run_mpi 3 memory_mpi_w3 tests/test_memory_mpi
run_mpi 2 main_job_n1024 tools/mtrain-run --seq-len 1024 --heads 16 --kv-heads 2 --head-dim 128 \
  --budgets "$root/data/budgets/Qwen2.5_3B_kv_out_v32_fit_o_best_pattern.json" \
  --layer 31 --repeat 1 --check
exit $failed
