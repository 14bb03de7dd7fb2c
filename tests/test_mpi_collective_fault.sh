#!/usr/bin/env bash
# test_mpi_collective_fault.sh: runs test_mpi_collective_fault under mpiexec
# with 3 ranks, rank 1 stalling at the given entry point (create | context |
# plan | estimate | allreduce | allgather | barrier | split), and checks that
#  - the job ends by itself, every rank saying "done" (no abort, no hang);
#  - nothing ended inside MPI (no MPI_Cancel / MPI_ERR_REQUEST);
#  - both waiting ranks (0 and 2) report MTRAIN_ERR_TIMEOUT naming the
#    operation, within the 3 s timeout plus a margin;
#  - their next call on the communicator fails at once (MTRAIN_ERR_COMM,
#    naming the earlier error), except in mode create (no communicator).
# usage: test_mpi_collective_fault.sh MPIEXEC BINARY MODE
set -u
mpiexec=$1 bin=$2 mode=$3
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMP_NUM_THREADS=1
log=$(mktemp)
trap 'rm -f "$log"' EXIT
fail() { echo "FAIL ($mode): $*"; cat "$log"; exit 1; }
start=$(date +%s)
timeout 120 "$mpiexec" -n 3 --oversubscribe --bind-to none "$bin" "$mode" > "$log" 2>&1
rc=$?
elapsed=$(( $(date +%s) - start ))
echo "mode $mode: exit status $rc after ${elapsed}s"
[ "$rc" -eq 124 ] && fail "the job hung (killed by timeout)"
grep -q "MPI_Cancel\|MPI_ERR_REQUEST" "$log" && fail "the job ended inside MPI"
grep -q "returned success" "$log" && fail "a rank reported success"
case $mode in
  create) op="duplication of the communicator" ;;
  context|plan|allgather) op="all-gather" ;;
  estimate|allreduce) op="all-reduce" ;;
  barrier) op="barrier" ;;
  split) op="split: .*all-gather" ;;
  *) fail "unknown mode" ;;
esac
for r in 0 2; do
  line=$(grep "^rank $r: .* failed after" "$log" | grep -v "next call" | head -n 1)
  echo "$line" | grep -q "MTRAIN_ERR_TIMEOUT" || fail "rank $r: no timeout reported"
  echo "$line" | grep -q "$op" || fail "rank $r: the error does not name the operation ($op)"
  secs=$(echo "$line" | sed -n 's/.* failed after \([0-9.]*\) s.*/\1/p')
  awk -v s="$secs" 'BEGIN { exit !(s >= 2.9 && s < 8) }' ||
    fail "rank $r: the timeout came after $secs s, not about 3 s"
  echo "$line"
  if [ "$mode" != create ]; then
    next=$(grep "^rank $r: next call failed after" "$log")
    echo "$next" | grep -q "MTRAIN_ERR_COMM: .*unusable after an earlier error" ||
      fail "rank $r: the next call did not fail with the earlier error"
    secs=$(echo "$next" | sed -n 's/.* failed after \([0-9.]*\) s.*/\1/p')
    awk -v s="$secs" 'BEGIN { exit !(s < 0.5) }' || fail "rank $r: the next call took $secs s"
  fi
done
n=$(grep -c "^rank [0-9]: done$" "$log")
[ "$n" -eq 3 ] || fail "$n of 3 ranks reached the end"
[ "$rc" -eq 0 ] || fail "exit status $rc"
echo "PASS: mode $mode: the waiting ranks reported the timeout and lived on"
