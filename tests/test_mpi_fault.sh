#!/usr/bin/env bash
# test_mpi_fault.sh: runs test_mpi_fault under mpiexec with 3 ranks in the
# given mode (kill | stall | kill-bwd | stall-bwd | wrong-size | kill-mid-fwd |
# kill-mid-bwd) and checks that the job ends with an error well
# within the time limit instead of hanging, and (stall) that the surviving
# ranks report a timeout naming the silent peer.
# usage: test_mpi_fault.sh MPIEXEC BINARY MODE
set -u
mpiexec=$1 bin=$2 mode=$3
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMP_NUM_THREADS=1
log=$(mktemp)
start=$(date +%s)
# the mid-ring kills run with --enable-recovery where mpiexec has it, so that
# the killed rank does not take the others down before they report
recovery=()
case $mode in kill-mid-*)
  timeout 30 "$mpiexec" --enable-recovery -n 1 true > /dev/null 2>&1 && recovery=(--enable-recovery)
  ;;
esac
timeout 120 "$mpiexec" "${recovery[@]}" -n 3 --oversubscribe --bind-to none "$bin" "$mode" > "$log" 2>&1
rc=$?
elapsed=$(( $(date +%s) - start ))
echo "mode $mode: exit status $rc after ${elapsed}s"
# (under --enable-recovery mpiexec exits 0 after an MPI_Abort: the ranks'
# own reports below decide)
if [ "$rc" -eq 0 ] && [ ${#recovery[@]} -eq 0 ]; then
  echo "FAIL: the job reported success"; cat "$log"; exit 1
fi
if [ "$rc" -eq 124 ]; then echo "FAIL: the job hung (killed by timeout)"; cat "$log"; exit 1; fi
if grep -q "returned success" "$log"; then echo "FAIL: a rank reported success"; cat "$log"; exit 1; fi
if [ "$mode" = wrong-size ]; then
  grep -q "expected\|truncat" "$log" || { echo "FAIL: no size error"; cat "$log"; exit 1; }
  grep -q "rank 1" "$log" || { echo "FAIL: the error does not name rank 1"; cat "$log"; exit 1; }
  grep -E "expected|truncat" "$log" | head -n 2
fi
if [ "$mode" = kill-mid-fwd ] || [ "$mode" = kill-mid-bwd ]; then
  grep -q "rank 1: killed at its send 2\|rank 1: killed at its send" "$log" ||
    { echo "FAIL: rank 1 was not killed inside the ring"; cat "$log"; exit 1; }
  grep -E "killed at its send" "$log" | head -n 1
  # with --enable-recovery the survivors live to report their error
  if [ ${#recovery[@]} -gt 0 ]; then
    n=$(grep -cE "rank [02]: (forward|backward) failed: MTRAIN_ERR" "$log")
    [ "$n" -eq 2 ] || { echo "FAIL: $n of the 2 surviving ranks reported an error"; cat "$log"; exit 1; }
    grep -E "rank [02]: (forward|backward) failed" "$log" | head -n 2
  fi
fi
if [ "$mode" = stall-bwd ] || [ "$mode" = kill-bwd ] || [ "$mode" = kill-mid-bwd ]; then
  n=$(grep -c "forward completed" "$log")
  [ "$n" -eq 3 ] || { echo "FAIL: the forward did not complete on every rank first"; cat "$log"; exit 1; }
fi
if [ "$mode" = stall ] || [ "$mode" = stall-bwd ]; then
  grep -q "MTRAIN_ERR_TIMEOUT" "$log" || { echo "FAIL: no timeout error"; cat "$log"; exit 1; }
  grep -q "with rank 1" "$log" || { echo "FAIL: the error does not name rank 1"; cat "$log"; exit 1; }
  grep "MTRAIN_ERR_TIMEOUT" "$log" | head -n 2
fi
echo "PASS: mode $mode ended with an error, no hang"
