#!/usr/bin/env bash
# test_run_outputs.sh: what mtrain-run reports and writes.
#  - MTRAIN_BACKEND overrides --backend: the report (text and JSON) names the
#    backend the context uses, a note says so, and --check still compares with
#    cpu-ref (the override never reaches the reference);
#  - flags that have no effect are named in a warning on stderr, once (rank 0
#    under mpiexec): generator flags with input files, --seed with --do, --do
#    with --forward-only, --layout, --schedule and --timeout on one rank,
#    --last-q without an estimate, --top-p-cap without --top-p, --top-p-forced
#    without top-p budgets; --top-p-forced keeps the sinks and the window in
#    every head (pattern.json, JSON report); a run with
#    only effective flags warns about nothing;
#  - --out is all or nothing: a write that fails (MTRAIN_RUN_FAULT=
#    fail-write:dv) or an output name taken by a directory leaves no new file
#    and no temporary behind, and the files of an earlier run unchanged; on
#    one rank and on 3.
# usage: test_run_outputs.sh MTRAIN_RUN TMPDIR [MPIEXEC]
set -uo pipefail
bin=$1 work=$2/run_outputs mpiexec=${3:-}
rm -rf "$work"
mkdir -p "$work"
export OMP_NUM_THREADS=1 OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
unset MTRAIN_RUN_FAULT MTRAIN_BACKEND
failures=0
fail() {
  echo "test_run_outputs: FAIL: $*" >&2
  failures=$((failures + 1))
}
shape=(--seq-len 256 --heads 2 --kv-heads 1 --head-dim 16 --granularity 64)
out=$work/out.txt err=$work/err.txt
mpi=()
# (a hang is killed after 120 s: exit status 124)
[ -z "$mpiexec" ] || mpi=(timeout 120 "$mpiexec" -n 3 --oversubscribe --bind-to none)

# ---- MTRAIN_BACKEND ----------------------------------------------------------------
rc=0
MTRAIN_BACKEND=cpu-ref "$bin" "${shape[@]}" --backend cpu > "$out" 2> "$err" || rc=$?
[ "$rc" = 0 ] || fail "MTRAIN_BACKEND=cpu-ref: exit $rc: $(cat "$err")"
grep -q "^mtrain-run: backend cpu-ref," "$out" ||
  fail "MTRAIN_BACKEND=cpu-ref --backend cpu: the report does not name cpu-ref: $(head -n 1 "$out")"
grep -q "MTRAIN_BACKEND=cpu-ref overrides --backend cpu" "$err" ||
  fail "MTRAIN_BACKEND=cpu-ref --backend cpu: no note on stderr: $(cat "$err")"
head -n 1 "$out"
MTRAIN_BACKEND=cpu-ref "$bin" "${shape[@]}" --json > "$out" 2> "$err" ||
  fail "MTRAIN_BACKEND=cpu-ref --json: $(cat "$err")"
grep -q '"backend": "cpu-ref"' "$out" || fail "the JSON does not name cpu-ref: $(cat "$out")"
rc=0
MTRAIN_BACKEND=cpu "$bin" "${shape[@]}" --backend cpu-ref --check > "$out" 2> "$err" || rc=$?
if [ "$rc" != 0 ] || ! grep -q "^mtrain-run: backend cpu," "$out" ||
  ! grep -q "check .*PASS" "$out"; then
  fail "MTRAIN_BACKEND=cpu --backend cpu-ref --check: exit $rc (the reference must stay cpu-ref):" \
    "$(cat "$out" "$err")"
fi
if [ ${#mpi[@]} -gt 0 ]; then
  MTRAIN_BACKEND=cpu-ref "${mpi[@]}" "$bin" "${shape[@]}" --check > "$out" \
    2> "$err" || fail "3 ranks, MTRAIN_BACKEND=cpu-ref: $(cat "$err")"
  grep -q "^mtrain-run: backend cpu-ref," "$out" ||
    fail "3 ranks, MTRAIN_BACKEND=cpu-ref: the report names $(head -n 1 "$out")"
fi

# ---- flags without effect ----------------------------------------------------------
"$bin" "${shape[@]}" --out "$work/in" > /dev/null 2> "$err" || fail "making input files: $(cat "$err")"
files=(--q "$work/in/o.npy" --k "$work/in/dk.npy" --v "$work/in/dv.npy")
# warns NAME NEEDLE... -- cmd...: exit 0 and each NEEDLE in a warning line, once
warns() {
  local name=$1 rc=0 needles=()
  shift
  while [ "$1" != -- ]; do
    needles+=("$1")
    shift
  done
  shift
  "$@" > "$out" 2> "$err" || rc=$?
  [ "$rc" = 0 ] || fail "$name: exit $rc: $(cat "$err")"
  for n in "${needles[@]}"; do
    local c
    c=$(grep -c -- "warning: $n" "$err")
    [ "$c" = 1 ] || fail "$name: $c warnings naming '$n', expected 1: $(cat "$err")"
  done
}
warns "generator flags with files" "--seq-len" "--heads" "--kv-heads" "--head-dim" "--input " \
  "--input-scale" -- "$bin" "${files[@]}" --seq-len 999 --heads 3 --kv-heads 3 --head-dim 8 \
  --input normal --input-scale 2 --granularity 64
warns "--seed with --do" "--seed" -- "$bin" "${files[@]}" --do "$work/in/o.npy" --seed 5 \
  --granularity 64
warns "--do with --forward-only" "--do" -- "$bin" "${files[@]}" --do "$work/in/o.npy" \
  --forward-only --granularity 64
warns "ring flags on one rank" "--layout" "--schedule" "--timeout" -- "$bin" "${shape[@]}" \
  --layout zigzag --schedule flat --timeout 5
warns "--last-q without an estimate" "--last-q" -- "$bin" "${shape[@]}" --last-q 32
warns "--top-p-cap without --top-p" "--top-p-cap" -- "$bin" "${shape[@]}" --v-size 64 \
  --s-size 64 --top-p-cap 100
warns "--top-p-forced without top-p budgets" "--top-p-forced" -- "$bin" "${shape[@]}" \
  --v-size 64 --s-size 64 --top-p-forced
# --top-p-forced: every head keeps the 30 sinks and the window's block diagonals (0, 1, 2 at
# G 64), where top-p 0.3 alone keeps fewer on these inputs; the report says so
for forced in 0 1; do
  flag=()
  [ $forced = 1 ] && flag=(--top-p-forced)
  rm -rf "$work/forced$forced"
  "$bin" "${shape[@]}" --top-p 0.3 "${flag[@]}" --out "$work/forced$forced" --json > "$out" \
    2> "$err" || fail "--top-p 0.3 ${flag[*]}: $(cat "$err")"
  grep -q "\"top_p_forced\": $([ $forced = 1 ] && echo true || echo false)" "$out" ||
    fail "the JSON does not say top_p_forced $forced: $(cat "$out")"
  python3 - "$work/forced$forced/pattern.json" $forced <<'PY' || fail "--top-p-forced $forced: the pattern"
import json, sys
heads = json.load(open(sys.argv[1]))["heads"]
full = [set(range(30)) <= set(h.get("verticals", [])) and {0, 1, 2} <= set(h["diagonals"])
        for h in heads]
sys.exit(0 if (all(full) if sys.argv[2] == "1" else not all(full)) else 1)
PY
done
sed -n 's/^/  /p' "$err"
"$bin" "${files[@]}" --seed 5 --granularity 64 --v-size 64 --s-size 64 --last-q 32 > "$out" \
  2> "$err" || fail "effective flags: $(cat "$err")"
[ ! -s "$err" ] || fail "a run whose flags all have an effect printed: $(cat "$err")"
if [ ${#mpi[@]} -gt 0 ]; then
  warns "3 ranks, --seq-len with files" "--seq-len" -- "${mpi[@]}" "$bin" "${files[@]}" \
    --seq-len 999
  "${mpi[@]}" "$bin" "${shape[@]}" --layout zigzag --timeout 30 > "$out" 2> "$err" ||
    fail "3 ranks, --layout: $(cat "$err")"
  ! grep -q "warning" "$err" || fail "3 ranks: --layout and --timeout have an effect: $(cat "$err")"
  # the ring's estimate with --top-p-forced: the pattern of one rank's run, sinks and window kept
  rm -rf "$work/forced-ring"
  "${mpi[@]}" "$bin" "${shape[@]}" --top-p 0.3 --top-p-forced --out "$work/forced-ring" \
    > "$out" 2> "$err" || fail "3 ranks, --top-p-forced: $(cat "$err")"
  cmp -s "$work/forced-ring/pattern.json" "$work/forced1/pattern.json" ||
    fail "3 ranks, --top-p-forced: the pattern differs from one rank's"
fi

# ---- --out all or nothing ----------------------------------------------------------
# sums DIR: checksums of the files in DIR, sorted by name
sums() { (cd "$1" && find . -type f -print0 | sort -z | xargs -0 -r md5sum); }
# atomic NAME DIR cmd...: the run fails (exit 1), naming the output, and DIR
# holds exactly what it held before, no temporary
atomic() {
  local name=$1 dir=$2 rc=0 before
  shift 2
  before=$(sums "$dir")
  "$@" > "$out" 2> "$err" || rc=$?
  [ "$rc" = 1 ] || fail "$name: exit $rc, expected 1: $(cat "$err")"
  grep -q "dv\.npy" "$err" || fail "$name: the error does not name dv.npy: $(cat "$err")"
  [ "$(sums "$dir")" = "$before" ] || fail "$name: --out changed: $(ls -la "$dir")"
  grep "dv\.npy" "$err" | head -n 1
}
for where in one ring; do
  run=("$bin")
  if [ $where = ring ]; then
    [ ${#mpi[@]} -gt 0 ] || continue
    run=("${mpi[@]}" "$bin")
  fi
  mkdir -p "$work/$where-empty" "$work/$where-dir/dv.npy"
  MTRAIN_RUN_FAULT=fail-write:dv atomic "$where: a failed write into an empty --out" \
    "$work/$where-empty" "${run[@]}" "${shape[@]}" --out "$work/$where-empty"
  [ -z "$(ls -A "$work/$where-empty")" ] || fail "$where: files left: $(ls -A "$work/$where-empty")"
  atomic "$where: dv.npy taken by a directory" "$work/$where-dir" "${run[@]}" "${shape[@]}" \
    --out "$work/$where-dir"
  "${run[@]}" "${shape[@]}" --out "$work/$where-full" > /dev/null 2> "$err" ||
    fail "$where: --out: $(cat "$err")"
  [ "$(find "$work/$where-full" -type f | wc -l)" = 6 ] ||
    fail "$where: --out did not write 6 files: $(ls -A "$work/$where-full")"
  MTRAIN_RUN_FAULT=fail-write:dv atomic "$where: a failed write over an earlier run" \
    "$work/$where-full" "${run[@]}" "${shape[@]}" --seed 7 --out "$work/$where-full"
done

if [ "$failures" != 0 ]; then
  echo "test_run_outputs: $failures failure(s)" >&2
  exit 1
fi
echo "test_run_outputs: all checks passed"
