#!/usr/bin/env bash
# device call T4 (2026-11-29d): the 16K arms (mtrain-topp with the sinks and the window forced,
# dense) of data seeds 2 (dense only: T3 ran out of time) and 3, from call T1's weights.
set -uo pipefail
T0=$SECONDS
DEADLINE=${DEADLINE:-335}
for f in .device/debs/*.deb; do dpkg -x $f /tmp/deps; done
deps=/tmp/deps/usr/lib/x86_64-linux-gnu
export CMAKE_LIBRARY_PATH=$deps/openblas-pthread
export LD_LIBRARY_PATH=$deps/openblas-pthread:$deps${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
export PATH=$PATH:/usr/local/cuda/bin PYTHONUNBUFFERED=1
B=build-cuda
L=$OUT/callT4.log
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
step build 90 bash scripts/device_cuda.sh build
[ -f $B/libmtrain.so ] || { tail -30 $L; exit 1; }
export MTRAIN_LIBRARY=$B/libmtrain.so PYTHONPATH=python:.
R=$B/train-runs
step seed2_16k 80 env DATA_SEED=2 CALL_S=75 MARGIN_S=15 ARMS="dense" FROM_DIR=.device/wA bash scripts/device_train.sh arms-16k $R-s2
step seed3_16k 180 env DATA_SEED=3 CALL_S=175 MARGIN_S=15 ARMS="mtrain-topp dense" FROM_DIR=.device/wA bash scripts/device_train.sh arms-16k $R-s3
printf '%s\n' "${summary[@]}"
grep -E "FAIL|passed|failed|final accuracy" $L | tail -10
(cd $B && tar czf $OUT/runsD.tgz train-runs-s*/*.json train-runs-s*/*.log 2>/dev/null)
echo "total $((SECONDS - T0)) s"
