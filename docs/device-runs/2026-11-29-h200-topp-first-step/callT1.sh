#!/usr/bin/env bash
# device call T1 (2026-11-29d): the training protocol's weights up to dense-16384, then the
# top-p first-step diagnostic at 32K and 16K; then the StageTiles zero-init forward tests.
set -uo pipefail
T0=$SECONDS
DEADLINE=${DEADLINE:-580}
for f in .device/debs/*.deb; do dpkg -x $f /tmp/deps; done
deps=/tmp/deps/usr/lib/x86_64-linux-gnu
export CMAKE_LIBRARY_PATH=$deps/openblas-pthread
export LD_LIBRARY_PATH=$deps/openblas-pthread:$deps${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
export PATH=$PATH:/usr/local/cuda/bin PYTHONUNBUFFERED=1
B=build-cuda
L=$OUT/callT1.log
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
step protocol 330 env CALL_S=320 MARGIN_S=20 ARMS=dense EVAL_SEQS=32 bash scripts/device_train.sh pretrain,extend,arms-16k $R
step diag32k 90 python3 .device/topp_diag.py $R/dense-16384.pt 32768 2 $OUT/diag-32768.json
step diag16k 60 python3 .device/topp_diag.py $R/extended.pt 16384 4 $OUT/diag-16384.json
step fwd_persistent 30 $B/tests/test_cuda_fwd_persistent
step xb_cuda3 60 $B/tests/test_cross_backend cuda 3
printf '%s\n' "${summary[@]}"
grep -E "^(dense|lib|ref)" $L
grep -E "FAIL|passed|failed" $L | tail -6
cp $R/extended.pt $R/dense-16384.pt $OUT/ 2>/dev/null
(cd $R && tar czf $OUT/runs.tgz *.json *.log 2>/dev/null)
echo "total $((SECONDS - T0)) s"
