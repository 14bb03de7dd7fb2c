#!/usr/bin/env bash
# test.sh: the README's test command. Installs the dependencies, builds
# everything (CUDA code too where nvcc is present) and runs the whole test
# suite under ctest; then builds again with AddressSanitizer and
# UndefinedBehaviorSanitizer (build-asan/) and runs the suite once more;
# then the OpenMP tests, the MPI ring tests and the main job under
# ThreadSanitizer (scripts/tsan.sh); last, a short libFuzzer run of the
# readers and the plan builder.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
"$root/scripts/install_deps.sh"
"$root/scripts/build.sh"
(cd "$root/build" && ctest --output-on-failure --timeout 1800 -j 1)
echo "== the same tests under AddressSanitizer + UndefinedBehaviorSanitizer"
cmake -S "$root" -B "$root/build-asan" -DCMAKE_BUILD_TYPE=RelWithDebInfo \
  -DMTRAIN_SANITIZE=address,undefined -DMTRAIN_WITH_CUDA=OFF > "$root/build-asan.log"
cmake --build "$root/build-asan" -j "$(nproc)" >> "$root/build-asan.log" ||
  { cat "$root/build-asan.log"; exit 1; }
cd "$root/build-asan"
# kept blocks off: AddressSanitizer then sees every block freed (docs/MEMORY.md)
MTRAIN_REUSE_LIMIT=0 ctest --output-on-failure --timeout 1800 -j 1
echo "== ThreadSanitizer over the OpenMP path (clang + libomp + Archer; build-tsan/)"
bash "$root/scripts/tsan.sh"
echo "== a short fuzz run of the file readers and the plan builder (libFuzzer)"
bash "$root/scripts/fuzz.sh" 10
echo "== the CPU test suite cross-compiled for aarch64 and run under qemu-user (scripts/test_aarch64.sh; skipped, saying so, where qemu-aarch64 or the cross compiler is absent)"
bash "$root/scripts/test_aarch64.sh"
echo "== the repository stands alone: a clone of this commit, alone in an empty folder, builds without CUDA, passes the tests that read data/budgets and runs the main job (scripts/check_standalone.sh)"
bash "$root/scripts/check_standalone.sh"
echo "== the Python package (docs/PYTORCH.md): pip install . into a virtual environment (build/venv) with torch, transformers and matplotlib (the training report's charts) from PyPI, ruff, then pytest tests/python"
# CPU build of the package (the tests run on the CPU; the CUDA kernels are
# compiled and tested by the ctest build above); the environment is kept
# between runs (torch is large), the package is reinstalled every time.
venv="$root/build/venv"
[ -x "$venv/bin/python" ] || python3 -m venv "$venv"
"$venv/bin/python" -c "import torch, transformers, pytest, ruff, matplotlib" 2>/dev/null ||
  "$venv/bin/python" -m pip install -q torch transformers pytest ruff matplotlib
"$venv/bin/python" -m pip install -q --force-reinstall --no-deps "$root" -C cmake.define.MTRAIN_WITH_CUDA=OFF
lint=(python tests/python examples tools/cp_check.py tools/bench_cp_torch.py tools/cp_launch.py tools/balance_measure.py tools/balance_tool tools/peers_common.py tools/peers_cudnn.py tools/peers_minference.py tools/peers_run.py)
(cd "$root" && "$venv/bin/ruff" check "${lint[@]}" && "$venv/bin/ruff" format --check "${lint[@]}")
# from the repository root, `import mtrain` finds the installed package (the
# sources are under python/); pytest's exit status 5 (no test collected) fails
rc=0
(cd "$root" && "$venv/bin/python" -m pytest tests/python -q) || rc=$?
if [ "$rc" -eq 5 ]; then echo "pytest collected no tests: failure"; exit 1; fi
[ "$rc" -eq 0 ] || exit "$rc"
