#!/usr/bin/env bash
# device call V1 (2026-11-29f, two H200s): issue 19's 32K arms from call U4's curriculum weights
# (.device/wB: extended.pt, dense-16384.pt), dense and mtrain-topp (forced) at once on the two
# GPUs, then mtrain-static and the window control; the library alone built.
# (kept here as run, from the repository root; .device/wB holds the curriculum run's
# extended.pt and dense-16384.pt, .device/wC its zero-shot JSON, .device/debs the packages)
set -uo pipefail
T0=$SECONDS
. scripts/device_lib.sh
dev_unpack_debs "$PWD"
dev_deps_openblas
export PYTHONUNBUFFERED=1
B=build-cuda
L=$OUT/callV1.log
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
echo "==== arms32k: CALL_S=$((left - 15)) ARM_GPUS=2 ARMS='dense mtrain-topp mtrain-static window' FROM_DIR=.device/wB device_train.sh arms-32k $R" >> $L
timeout -k 3 $((left - 10)) env CALL_S=$((left - 15)) MARGIN_S=15 ARM_GPUS=2 \
  ARMS="dense mtrain-topp mtrain-static window" FROM_DIR=.device/wB \
  bash scripts/device_train.sh arms-32k $R >> $L 2>&1
echo "arms32k: rc $? ($((SECONDS - t0)) s)" | tee -a $L
grep -hE "final accuracy|density|tokens/s" $L $R/*.stdout 2>/dev/null | tail -20
cp $R/*.json $R/*.log $R/*.stdout $OUT/ 2>/dev/null
ls $OUT
echo "total $((SECONDS - T0)) s"
