#!/usr/bin/env bash
# test_nccl_fault.sh: runs test_nccl_fault under mpiexec with W ranks (2 by
# default; one GPU each) in the given mode (kill | kill-fwd | kill-bwd |
# stall-fwd | stall-bwd) and passes when every surviving rank (all but rank
# 1, the faulty one) reported PASS: its call failed with a clear error within
# the timeout and its destroys returned. mpiexec runs with --enable-recovery
# where it has it, so that a killed rank does not take the survivors down
# before they report. Exit 77 (skipped) where fewer than W GPUs are visible;
# a hang (killed by timeout) fails.
# usage: test_nccl_fault.sh MPIEXEC BINARY MODE [W]
set -u
mpiexec=$1 bin=$2 mode=$3 world=${4:-2}
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMP_NUM_THREADS=1
export NCCL_NVLS_ENABLE=0 NCCL_DEBUG=${NCCL_DEBUG:-WARN}
flags=(-n "$world" --oversubscribe --bind-to none)
if timeout 30 "$mpiexec" --enable-recovery -n 1 true > /dev/null 2>&1; then
  flags+=(--enable-recovery)
else
  echo "note: $mpiexec has no --enable-recovery: a killed rank may end the job before the survivor reports"
fi
log=$(mktemp)
done_dir=$(mktemp -d) # where the survivors of a ring of more than 2 leave their verdicts
start=$(date +%s)
timeout 180 "$mpiexec" "${flags[@]}" "$bin" "$mode" "$done_dir" > "$log" 2>&1
rc=$?
elapsed=$(( $(date +%s) - start ))
rm -rf "$done_dir"
echo "mode $mode, $world ranks: mpiexec exit status $rc after ${elapsed}s"
grep -E "^rank [0-9]+: " "$log"
if grep -q "^SKIPPED" "$log"; then grep "^SKIPPED" "$log"; rm -f "$log"; exit 77; fi
fail() { echo "FAIL: $*"; echo "---- log"; cat "$log"; rm -f "$log"; exit 1; }
[ "$rc" -eq 124 ] && fail "the job hung (killed by timeout after ${elapsed}s)"
grep -q "FAIL" "$log" && fail "a rank reported a failure"
for ((r = 0; r < world; r++)); do
  [ "$r" -eq 1 ] && continue
  grep -q "^rank $r: PASS" "$log" || fail "surviving rank $r did not report PASS"
done
rm -f "$log"
echo "PASS: mode $mode, $world ranks"
