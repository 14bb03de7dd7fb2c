#!/usr/bin/env bash
# device call V3 (2026-11-29f, two H200s): dense and mtrain-topp (forced) at 32K from call U4's
# curriculum weights (.device/wB) again, at once on the two GPUs: a second run of each (call V1
# ran them first, same data seed) and top-p's step time; every output in one tar.
# (kept here as run, from the repository root; .device/wB as for callV1.sh)
set -uo pipefail
T0=$SECONDS
. scripts/device_lib.sh
dev_unpack_debs "$PWD"
dev_deps_openblas
export PYTHONUNBUFFERED=1
B=build-cuda
L=$OUT/callV3.log
{ cmake -S . -B $B -DCMAKE_BUILD_TYPE=Release -DMTRAIN_WITH_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90a &&
  cmake --build $B -j32 --target mtrain; } > $OUT/build.log 2>&1
echo "build: rc $? ($((SECONDS - T0)) s)" | tee -a $L
[ -f $B/libmtrain.so ] || { tail -30 $OUT/build.log; exit 1; }
export MTRAIN_LIBRARY=$B/libmtrain.so PYTHONPATH=python:.
nvidia-smi -L | tee -a $L
R=.device/wV
mkdir -p $R
cp .device/wC/zeroshot-16384.json $R/
left=$((560 - (SECONDS - T0)))
t0=$SECONDS
echo "==== arms32k: CALL_S=$((left - 15)) ARM_GPUS=2 ARMS='dense mtrain-topp' FROM_DIR=.device/wB device_train.sh arms-32k $R" >> $L
timeout -k 3 $((left - 10)) env CALL_S=$((left - 15)) MARGIN_S=15 ARM_GPUS=2 \
  ARMS="dense mtrain-topp" FROM_DIR=.device/wB \
  bash scripts/device_train.sh arms-32k $R >> $L 2>&1
echo "arms32k: rc $? ($((SECONDS - t0)) s)" | tee -a $L
grep -hE "final accuracy|density|tokens/s" $L $R/*.stdout 2>/dev/null | tail -20
tar czf $OUT/runsV3.tgz $R/*.json $R/*.log $R/*.stdout 2>/dev/null
ls $OUT
echo "total $((SECONDS - T0)) s"
