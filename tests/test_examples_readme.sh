#!/usr/bin/env bash
# test_examples_readme.sh: examples/patterns/README.md says what is true:
# every repository path it cites exists (so the budget files it names are
# the repository's own, under data/budgets; scripts/check_standalone.sh
# checks that no tracked file points outside the repository), what it says of the main job matches
# scripts/main_job.sh (the main job estimates its pattern from --budgets and
# does not read the example file), and the example pattern is what it says
# (4096 tokens, granularity 128, 16 heads), drawn by mtrain-pattern as the
# README shows.
# usage: test_examples_readme.sh SOURCE_DIR MTRAIN_PATTERN TMPDIR
set -euo pipefail
root=$1 viewer=$2 work=$3/examples_readme
readme=$root/examples/patterns/README.md
rm -rf "$work"
mkdir -p "$work"
fail() {
  echo "test_examples_readme: FAIL: $*" >&2
  exit 1
}
[ -f "$readme" ] || fail "no $readme"
# the paths it cites
paths=$(grep -oE '(^|[^./A-Za-z0-9_-])(data|tools|examples|scripts|docs)/[A-Za-z0-9_./-]*[A-Za-z0-9_]' \
  "$readme" | sed -E 's/^[^a-z]//' | sort -u)
[ -n "$paths" ] || fail "no repository path found in $readme"
for p in $paths; do
  [ -e "$root/$p" ] || fail "$readme cites $p, which is not in the repository"
done
# the main job
job=$root/scripts/main_job.sh
if grep -q "examples/patterns" "$job"; then
  grep -q "main job uses" "$readme" || fail "main_job.sh reads examples/patterns; the README denies it"
else
  grep -q "main job does not use" "$readme" || fail "the README does not say the main job skips the file"
fi
if ! grep -q -- "--budgets" "$job" || ! grep -q -- "--budgets" "$readme"; then
  fail "the README does not say where the main job's pattern comes from (--budgets)"
fi
# the example file, drawn as the README shows
"$viewer" --pattern "$root/examples/patterns/qwen2.5-3b-layer3-n4096.json" --head 0 \
  --out "$work/head0.png" > "$work/out.txt"
grep -q "32 x 32 blocks of 128" "$work/out.txt" ||
  fail "the example is not 4096 tokens at granularity 128: $(cat "$work/out.txt")"
rc=0
"$viewer" --pattern "$root/examples/patterns/qwen2.5-3b-layer3-n4096.json" --head 16 \
  --out "$work/x.png" > /dev/null 2>&1 || rc=$?
[ "$rc" = 1 ] || fail "the example does not have 16 heads (head 16 did not fail)"
echo "test_examples_readme: all checks passed"
