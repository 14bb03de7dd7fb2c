#!/usr/bin/env bash
# fuzz.sh: builds the libFuzzer targets with clang (AddressSanitizer and
# UndefinedBehaviorSanitizer on) into build-fuzz/ and runs each for SECONDS
# (default 20) from the seeds in tests/fuzz/corpus; a crash stops the script
# with libFuzzer's report and the crashing input in build-fuzz/.
# usage: scripts/fuzz.sh [SECONDS]
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
seconds=${1:-20}
CC=clang cmake -S "$root" -B "$root/build-fuzz" -DCMAKE_BUILD_TYPE=RelWithDebInfo -DMTRAIN_FUZZ=ON \
  -DMTRAIN_BUILD_TESTS=OFF -DMTRAIN_BUILD_TOOLS=OFF -DMTRAIN_WITH_CUDA=OFF -DMTRAIN_WITH_MPI=OFF \
  -DMTRAIN_WERROR=OFF > "$root/build-fuzz.log"
cmake --build "$root/build-fuzz" -j "$(nproc)" >> "$root/build-fuzz.log" ||
  { cat "$root/build-fuzz.log"; exit 1; }
cd "$root/build-fuzz"
# the inputs that fail (crash-*, leak-*, timeout-*, oom-*) of this run land in
# artifacts/<target>/; earlier runs' are moved to artifacts.old/
rm -rf artifacts.old
[ -d artifacts ] && mv artifacts artifacts.old
for target in fuzz_npy fuzz_pattern_json fuzz_budgets fuzz_plan; do
  corpus="corpus_$target"
  mkdir -p "$corpus" "artifacts/$target"
  [ -d "$root/tests/fuzz/corpus/$target" ] && cp -n "$root/tests/fuzz/corpus/$target"/* "$corpus"/ 2>/dev/null || true
  echo "== $target, ${seconds}s"
  ASAN_OPTIONS=detect_leaks=1 "./tests/fuzz/$target" -max_total_time="$seconds" -max_len=4096 \
    -artifact_prefix="artifacts/$target/" -print_final_stats=1 "$corpus" 2>&1 |
    grep -E "stat::number_of_executed_units|ERROR|SUMMARY|Done" || true
  if [ -n "$(ls -A "artifacts/$target")" ]; then
    echo "fuzz.sh: $target found a failure: $(ls "artifacts/$target" | head -3)"
    exit 1
  fi
done
echo "fuzz.sh: no crash, leak, timeout or out-of-memory found"
