#!/usr/bin/env bash
# device call T2 (2026-11-29d): mtrain-topp with the sinks and the window forced (--topp-forced 1,
# the arm's default) against dense at 32K and 16K, from call T1's weights (.device/wA); then the
# select tests of the new option.
set -uo pipefail
T0=$SECONDS
DEADLINE=${DEADLINE:-585}
for f in .device/debs/*.deb; do dpkg -x $f /tmp/deps; done
deps=/tmp/deps/usr/lib/x86_64-linux-gnu
export CMAKE_LIBRARY_PATH=$deps/openblas-pthread
export LD_LIBRARY_PATH=$deps/openblas-pthread:$deps${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
export PATH=$PATH:/usr/local/cuda/bin PYTHONUNBUFFERED=1
B=build-cuda
L=$OUT/callT2.log
summary=()
step() { # name timeout cmd...
  local name=$1 to=$2; shift 2
  local left=$((DEADLINE - (SECONDS - T0)))
  if [ $left -lt 8 ]; then summary+=("$name: NOT RUN (no time left)"); return; fi
  [ $to -gt $((left - 3)) ] && to=$((left - 3))
  local t0=$SECONDS
  echo "==== $name ($(date +%H:%M:%S), limit $to s): $*" >> $L
  timeout -k 3 $to "$@" >> $L 2>&1
  local rc=$?
  summary+=("$name: rc $rc, $((SECONDS - t0)) s")
  echo "== $name: rc $rc ($((SECONDS - t0)) s)"
}
: > $L
step build 110 bash scripts/device_cuda.sh build
[ -f $B/libmtrain.so ] || { tail -30 $L; exit 1; }
export MTRAIN_LIBRARY=$B/libmtrain.so PYTHONPATH=python:.
step select 40 $B/tests/test_cuda_select
step device_plan 60 $B/tests/test_cuda_device_plan
R=$B/train-runs
left=$((DEADLINE - (SECONDS - T0) - 20))
step arms32k 330 env CALL_S=320 MARGIN_S=25 ARMS="mtrain-topp dense" FROM_DIR=.device/wA bash scripts/device_train.sh arms-32k $R
step arms16k 200 env CALL_S=190 MARGIN_S=20 ARMS="mtrain-topp dense" FROM_DIR=.device/wA bash scripts/device_train.sh arms-16k $R
printf '%s\n' "${summary[@]}"
grep -E "FAIL|passed|failed|final accuracy" $L | tail -10
(cd $R && tar czf $OUT/runsB.tgz *.json *.log 2>/dev/null)
echo "total $((SECONDS - T0)) s"
