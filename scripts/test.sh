#!/usr/bin/env bash
# test.sh: the README's test command. Installs the dependencies, builds
# everything (CUDA code too where nvcc is present) and runs the whole test
# suite under ctest.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
"$root/scripts/install_deps.sh"
"$root/scripts/build.sh"
cd "$root/build"
ctest --output-on-failure --timeout 1800 -j 1
