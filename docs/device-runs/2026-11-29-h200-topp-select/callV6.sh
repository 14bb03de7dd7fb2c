#!/usr/bin/env bash
# device call V6 (2026-11-29f, one H200): where the 32K top-p training step's time goes: 8 steps of
# the mtrain-topp, mtrain-static and dense arms from the curriculum run's dense-16384.pt weights
# under torch.profiler (.device/prof_topp.py), the CUDA kernels' self times; the library alone built.
# (kept here as run, from the repository root; it read .device/prof_topp.py, which is
# prof_topp.py beside it, the curriculum run's weights in .device/wB and packages in .device/debs)
set -uo pipefail
T0=$SECONDS
. scripts/device_lib.sh
dev_unpack_debs "$PWD"
dev_deps_openblas
export PYTHONUNBUFFERED=1
B=build-cuda
L=$OUT/callV6.log
{ cmake -S . -B $B -DCMAKE_BUILD_TYPE=Release -DMTRAIN_WITH_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90a &&
  cmake --build $B -j16 --target mtrain; } > $OUT/build.log 2>&1
echo "build: rc $? ($((SECONDS - T0)) s)" | tee $L
export MTRAIN_LIBRARY=$B/libmtrain.so PYTHONPATH=python:.
for arm in mtrain-topp mtrain-static dense; do
  [ $((SECONDS - T0)) -lt 420 ] || break
  echo "==== $arm ($((SECONDS - T0)) s)" >> $L
  timeout -k 3 120 python3 .device/prof_topp.py $arm .device/wB/dense-16384.pt $OUT/prof-$arm.json 8 >> $L 2>&1
  echo "rc $? ($((SECONDS - T0)) s)" >> $L
done
grep -E "^====|Self CUDA time total|rc " $L
(cd $OUT && tar czf profV6.tgz prof-*.json && rm -f prof-*.json)
echo "total $((SECONDS - T0)) s"
