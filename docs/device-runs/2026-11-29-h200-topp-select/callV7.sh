#!/usr/bin/env bash
# device call V7 (2026-11-29f, one H200): the top-p walk from shared memory (select_kernels.cuh):
# test_cuda_select and test_cuda_device_plan on the GPU, then the 32K top-p training step under
# torch.profiler (as call V6) and the 32K mtrain-topp arm from the curriculum weights (as V3).
# (kept here as run, from the repository root; .device/prof_topp.py is prof_topp.py beside it)
set -uo pipefail
T0=$SECONDS
. scripts/device_lib.sh
dev_unpack_debs "$PWD"
dev_deps_openblas
export PYTHONUNBUFFERED=1
B=build-cuda
L=$OUT/callV7.log
{ cmake -S . -B $B -DCMAKE_BUILD_TYPE=Release -DMTRAIN_WITH_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90a \
    -DMTRAIN_PATTERN_DATA_DIR=$PWD/data/budgets &&
  cmake --build $B -j16 --target mtrain test_cuda_select test_cuda_device_plan; } > $OUT/build.log 2>&1
echo "build: rc $? ($((SECONDS - T0)) s)" | tee $L
for t in test_cuda_select test_cuda_device_plan; do
  echo "==== $t ($((SECONDS - T0)) s)" >> $L
  timeout -k 3 90 $B/tests/$t >> $L 2>&1
  echo "$t: rc $? ($((SECONDS - T0)) s)" | tee -a $L
done
export MTRAIN_LIBRARY=$B/libmtrain.so PYTHONPATH=python:.
echo "==== prof mtrain-topp ($((SECONDS - T0)) s)" >> $L
timeout -k 3 90 python3 .device/prof_topp.py mtrain-topp .device/wB/dense-16384.pt $OUT/prof-topp.json 8 >> $L 2>&1
echo "prof: rc $? ($((SECONDS - T0)) s)" | tee -a $L
R=.device/wW
mkdir -p $R
left=$((290 - (SECONDS - T0)))
if [ $left -gt 60 ]; then
  echo "==== arm: CALL_S=$left ARMS=mtrain-topp FROM_DIR=.device/wB device_train.sh arms-32k $R" >> $L
  timeout -k 3 $((left + 5)) env CALL_S=$left MARGIN_S=10 ARMS="mtrain-topp" FROM_DIR=.device/wB \
    bash scripts/device_train.sh arms-32k $R >> $L 2>&1
  echo "arm: rc $? ($((SECONDS - T0)) s)" | tee -a $L
fi
grep -E "select_batch|scores_batch|PASSED|FAILED|final accuracy" $L | cut -c1-80,150-240
tar czf $OUT/runsV7.tgz $OUT/prof-topp.json $R/*.json $R/*.log $R/*.stdout 2>/dev/null; rm -f $OUT/prof-topp.json
echo "total $((SECONDS - T0)) s"
