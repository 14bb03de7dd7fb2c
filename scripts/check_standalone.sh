#!/usr/bin/env bash
# check_standalone.sh: proves that the repository stands alone, that a user who
# clones it and has nothing beside it can build, test and run it.
#  1. No tracked file may point outside the repository to the developers'
#     shared folder (the patterns below; the budget files are in data/budgets,
#     the specification is docs/SPEC.md).
#  2. The current commit is cloned into an empty temporary folder (mktemp -d:
#     nothing beside the clone), configured and built there without CUDA
#     (Release, tests on), and there run: the ctest tests that read the budget
#     files (the test sources that use MTRAIN_PATTERN_DATA_DIR, ts_data_path or
#     the TS_PATTERN_BUDGETS patterns) and the main job, `bash
#     scripts/main_job.sh`, which must find its budget file inside the clone.
# What is checked is the commit (HEAD), not uncommitted changes. Both parts
# always run; the script fails if either found a problem. Run from anywhere;
# the clone is removed at the end (MTRAIN_KEEP_STANDALONE=1 keeps it).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
git=(git -c safe.directory='*' -C "$root")
"${git[@]}" rev-parse --verify -q HEAD > /dev/null ||
  { echo "check_standalone: $root is not a git checkout with a commit"; exit 1; }
failed=()

# ---- the current commit, cloned alone into an empty folder -----------------
commit=$("${git[@]}" rev-parse HEAD)
[ -z "$("${git[@]}" status --porcelain --untracked-files=no 2>/dev/null)" ] ||
  echo "check_standalone: note: uncommitted changes are not part of the check (commit $commit is)"
tmp=$(mktemp -d "${TMPDIR:-/tmp}/mtrain-standalone.XXXXXX")
if [ "${MTRAIN_KEEP_STANDALONE:-0}" = 1 ]; then
  echo "check_standalone: keeping $tmp"
else
  trap 'rm -rf "$tmp"' EXIT
fi
clone=$tmp/mtrain
git -c safe.directory='*' clone -q --no-checkout "$root" "$clone"
git -C "$clone" checkout -q --detach "$commit"
echo "check_standalone: commit $commit cloned alone into $clone"

# ---- 1. no reference to the shared folder in a tracked file ----------------
# (the pattern is written so that this file does not match it itself)
pattern='\.\./shared|shared/(design|data)'
rc=0
hits=$(git -C "$clone" grep -n -I -E "$pattern" -- .) || rc=$?
case $rc in
0) echo "check_standalone: tracked files that point outside the repository:"
   printf '%s\n' "$hits" | sed 's/^/  /'
   failed+=("tracked files cite the shared folder") ;;
1) echo "check_standalone: no tracked file points outside the repository" ;;
*) echo "check_standalone: git grep failed ($rc)"; exit 1 ;;
esac

# ---- 2. build, the tests that read the budget files, the main job ----------
build=$clone/build
t0=$SECONDS
cmake -S "$clone" -B "$build" -DCMAKE_BUILD_TYPE=Release -DMTRAIN_WITH_CUDA=OFF \
  -DMTRAIN_BUILD_TESTS=ON > "$tmp/configure.log" 2>&1 || { cat "$tmp/configure.log"; exit 1; }
cmake --build "$build" -j "$(nproc)" > "$tmp/build.log" 2>&1 || { tail -n 60 "$tmp/build.log"; exit 1; }
echo "check_standalone: configured and built in $((SECONDS - t0)) s"

# The tests' budget folder must be the clone's own.
data_dir=$(sed -n 's/^MTRAIN_PATTERN_DATA_DIR:PATH=//p' "$build/CMakeCache.txt")
if [ "$data_dir" != "$clone/data/budgets" ]; then
  echo "check_standalone: the tests read their budget files from '$data_dir', not $clone/data/budgets"
  failed+=("MTRAIN_PATTERN_DATA_DIR outside the clone")
fi

# The tests that read the budget files, found by what their sources use.
names=$(cd "$clone/tests" &&
  grep -l -E 'MTRAIN_PATTERN_DATA_DIR|ts_data_path|TS_PATTERN_BUDGETS' -- *.c |
  sed 's/\.c$//' | sort | paste -s -d '|')
[ -n "$names" ] || { echo "check_standalone: found no test that reads the budget files"; exit 1; }
echo "check_standalone: the tests that read the budget files: ${names//|/ }"
t0=$SECONDS
if (cd "$build" && ctest --output-on-failure --no-tests=error --timeout 900 -j 1 -R "^($names)\$"); then
  echo "check_standalone: those tests passed in the clone in $((SECONDS - t0)) s"
else
  failed+=("ctest in the clone")
fi

# The main job from the clone (it builds in the clone's build/, already done).
t0=$SECONDS
if (cd "$clone" && bash scripts/main_job.sh) > "$tmp/main_job.log" 2>&1; then
  tail -n 25 "$tmp/main_job.log"
  echo "check_standalone: the main job passed in the clone in $((SECONDS - t0)) s"
else
  tail -n 60 "$tmp/main_job.log"
  failed+=("the main job in the clone")
fi

if [ ${#failed[@]} -gt 0 ]; then
  printf 'check_standalone: FAILED: %s\n' "${failed[@]}"
  exit 1
fi
echo "check_standalone: the repository stands alone (commit $commit)"
