#!/usr/bin/env bash
# device call T3 (2026-11-29d): data seeds 2 and 3 of the 32K arms (mtrain-topp with the sinks and
# the window forced, dense) and seed 2 of the 16K arms, from call T1's weights (.device/wA).
set -uo pipefail
T0=$SECONDS
DEADLINE=${DEADLINE:-585}
for f in .device/debs/*.deb; do dpkg -x $f /tmp/deps; done
deps=/tmp/deps/usr/lib/x86_64-linux-gnu
export CMAKE_LIBRARY_PATH=$deps/openblas-pthread
export LD_LIBRARY_PATH=$deps/openblas-pthread:$deps${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
export PATH=$PATH:/usr/local/cuda/bin PYTHONUNBUFFERED=1
B=build-cuda
L=$OUT/callT3.log
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
R=$B/train-runs
step seed2_32k 190 env DATA_SEED=2 CALL_S=185 MARGIN_S=20 ARMS="mtrain-topp dense" FROM_DIR=.device/wA bash scripts/device_train.sh arms-32k $R-s2
step seed3_32k 190 env DATA_SEED=3 CALL_S=185 MARGIN_S=20 ARMS="mtrain-topp dense" FROM_DIR=.device/wA bash scripts/device_train.sh arms-32k $R-s3
step seed2_16k 150 env DATA_SEED=2 CALL_S=145 MARGIN_S=20 ARMS="mtrain-topp dense" FROM_DIR=.device/wA bash scripts/device_train.sh arms-16k $R-s2
printf '%s\n' "${summary[@]}"
grep -E "FAIL|passed|failed|final accuracy" $L | tail -10
(cd $B && tar czf $OUT/runsC.tgz train-runs-s*/*.json train-runs-s*/*.log 2>/dev/null)
echo "total $((SECONDS - T0)) s"
