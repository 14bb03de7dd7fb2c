#!/usr/bin/env bash
# test_tool_mpi_faults.sh: the MPI tools' own communication (their gathers,
# reductions and barriers, outside the library's calls) is timed by the
# communicator's timeout, and a failure on one rank ends the job on every
# rank with the reason printed once:
#  - mtrain-run on 3 ranks with an unwritable --out ends non-zero within
#    seconds, the error naming the directory printed once;
#  - a rank stalled before the report (MTRAIN_RUN_FAULT=stall-report:1,
#    --timeout 3) or while the inputs are made (stall-inputs:2): the job ends
#    with MTRAIN_ERR_TIMEOUT naming the operation and the phase, printed once,
#    within the timeout plus a margin;
#  - a rank killed before the report (kill-report:1): the job ends, non-zero;
#  - a write that fails on rank 0 while the ranks gather the outputs
#    (fail-write:dk): every rank stops, exit 1, the error printed once, no
#    output file and no temporary left;
#  - mtrain-bench with a rank stalled before the figures are combined
#    (stall-report:1, --timeout 3): ends with the timeout.
# MTRAIN_RUN_FAULT is the tools' test hook (docs/USAGE.md).
# usage: test_tool_mpi_faults.sh MPIEXEC MTRAIN_RUN MTRAIN_BENCH TMPDIR
set -uo pipefail
mpiexec=$1 run=$2 bench=$3 work=$4/tool_mpi_faults
rm -rf "$work"
mkdir -p "$work"
export OMP_NUM_THREADS=1 OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
unset MTRAIN_RUN_FAULT MTRAIN_COMM_TIMEOUT
failures=0
fail() {
  echo "test_tool_mpi_faults: FAIL: $*" >&2
  failures=$((failures + 1))
}
shape=(--seq-len 512 --heads 2 --kv-heads 1 --head-dim 16 --granularity 64)
log=$work/log.txt

# job NAME FAULT LIMIT cmd...: runs cmd on 3 ranks under `timeout LIMIT` with
# MTRAIN_RUN_FAULT=FAULT (empty: none); sets rc and elapsed, output in $log
job() {
  local name=$1 fault=$2 limit=$3
  shift 3
  local start
  start=$(date +%s.%N)
  rc=0
  MTRAIN_RUN_FAULT=$fault timeout "$limit" "$mpiexec" -n 3 --oversubscribe --bind-to none "$@" \
    > "$log" 2>&1 || rc=$?
  elapsed=$(awk -v s="$start" -v e="$(date +%s.%N)" 'BEGIN { printf "%.1f", e - s }')
  echo "test_tool_mpi_faults: $name: exit status $rc after ${elapsed}s"
  [ "$rc" != 124 ] || fail "$name: the job hung (killed by timeout $limit): $(tail -n 20 "$log")"
  [ "$rc" != 0 ] || fail "$name: the job reported success: $(tail -n 20 "$log")"
}

# within SECONDS NAME: the job ended within SECONDS
within() {
  awk -v e="$elapsed" -v l="$1" 'BEGIN { exit !(e <= l) }' ||
    fail "$2: ended after ${elapsed}s, more than $1 s"
}

# once NAME REGEX: exactly one line of the output matches REGEX
once() {
  local n
  n=$(grep -cE -- "$2" "$log")
  [ "$n" = 1 ] || fail "$1: $n lines match '$2', expected exactly 1: $(tail -n 30 "$log")"
}

# ---- an unwritable --out on 3 ranks --------------------------------------------
touch "$work/a-file"
job unwritable-out "" 60 "$run" "${shape[@]}" --out "$work/a-file/out"
within 30 unwritable-out
once unwritable-out "^mtrain-run: .*$work/a-file/out"
grep -q "Not a directory" "$log" || fail "unwritable-out: no system error: $(cat "$log")"
grep -E "$work/a-file/out" "$log" | head -n 1

# ---- a rank stalled outside the library -----------------------------------------
for spec in stall-report:1 stall-inputs:2; do
  job "$spec" "$spec" 90 "$run" "${shape[@]}" --timeout 3
  within 30 "$spec"
  point=${spec#stall-}
  point=${point%:*}
  once "$spec" "^mtrain-run: rank [0-9]+: .*MTRAIN_ERR_TIMEOUT"
  line=$(grep -E "^mtrain-run: rank [0-9]+: .*MTRAIN_ERR_TIMEOUT" "$log" | head -n 1)
  echo "$line" | grep -qE "all-gather|all-reduce|barrier|receive|send" ||
    fail "$spec: the timeout does not name the operation: $line"
  echo "$line" | grep -q "$point" || fail "$spec: the timeout does not name the phase ($point): $line"
  echo "$line" | grep -q "within 3.0 s" || fail "$spec: not the 3 s timeout: $line"
  grep -q "MTRAIN_RUN_FAULT" "$log" || fail "$spec: the stalled rank did not say so"
  echo "  $line"
done

# ---- a rank killed outside the library ----------------------------------------
job kill-report:1 kill-report:1 90 "$run" "${shape[@]}" --timeout 3
within 30 kill-report:1

# ---- a write that fails on rank 0 while the outputs are gathered ----------------
job fail-write:dk fail-write:dk 90 "$run" "${shape[@]}" --timeout 10 --out "$work/out"
within 30 fail-write:dk
[ "$rc" = 1 ] || fail "fail-write:dk: exit status $rc, expected 1 (every rank stops cleanly)"
once fail-write:dk "^mtrain-run: .*dk\.npy.*MTRAIN_ERR_IO"
left=$(find "$work/out" -mindepth 1 2> /dev/null | head -n 5)
[ -z "$left" ] || fail "fail-write:dk: files left in --out: $left"
grep -E "dk\.npy" "$log" | head -n 2

# ---- mtrain-bench: a rank stalled before the figures are combined -----------------
job bench-stall-report:1 stall-report:1 90 "$bench" --tokens-list 512 --v-size 64 --s-size 64 \
  --heads 2 --kv-heads 1 --head-dim 16 --granularity 64 --warmup 0 --timeout 3
within 30 bench-stall-report:1
once bench-stall-report:1 "^mtrain-bench: rank [0-9]+: .*MTRAIN_ERR_TIMEOUT"
grep -E "^mtrain-bench: rank [0-9]+: .*MTRAIN_ERR_TIMEOUT" "$log" | head -n 1

if [ "$failures" != 0 ]; then
  echo "test_tool_mpi_faults: $failures failure(s)" >&2
  exit 1
fi
echo "test_tool_mpi_faults: all checks passed"
