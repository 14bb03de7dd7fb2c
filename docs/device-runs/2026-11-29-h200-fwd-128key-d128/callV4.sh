#!/usr/bin/env bash
# device call V4 (2026-11-29f, one H200): which part of commit c7dd60c (128-key stages at d 128,
# Q from shared memory) costs: its one-CTA-per-item kernel (no shared query buffer) and its
# persistent kernel, against 4b8df9f's two kernels, d 128, dense and vertical-slash, two rounds
# interleaved; mtrain-bench-cuda of each tree built in the same call. Every output in one tar.
# (kept here as run: it reads .device/new.tar.gz = git archive c7dd60c and .device/base.tar.gz =
# git archive 4b8df9f, and the Debian packages of .device/debs, carried to the GPU machine)
set -uo pipefail
T0=$SECONDS
. scripts/device_lib.sh
dev_unpack_debs "$PWD"
dev_deps_openblas
L=$OUT/callV4.log
: > $L
for tree in new base; do
  d=/tmp/t-$tree; rm -rf $d; mkdir -p $d; tar xzf .device/$tree.tar.gz -C $d
  ( cmake -S $d -B $d/b -DCMAKE_BUILD_TYPE=Release -DMTRAIN_WITH_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90a \
      -DMTRAIN_PATTERN_DATA_DIR=$d/data/budgets > $d/build.log 2>&1 &&
    cmake --build $d/b -j8 --target mtrain-bench-cuda >> $d/build.log 2>&1; echo "build $tree: rc $? ($((SECONDS - T0)) s)" >> $L ) &
done
wait
cat $L
for r in 1 2; do
  for tree in new base; do
    for pers in 1 0; do
      [ $((SECONDS - T0)) -lt 540 ] || break
      echo "==== round $r $tree persistent=$pers ($((SECONDS - T0)) s)" >> $L
      timeout -k 3 40 env MTRAIN_CUDA_WGMMA_FWD_PERSISTENT=$pers /tmp/t-$tree/b/tools/mtrain-bench-cuda \
        --seq-len 32768 --heads 16 --kv-heads 2 --head-dim 128 --variants 3 --reps 10 --warmup 3 \
        --validate-len 1024 --json $OUT/r$r-$tree-p$pers.json >> $L 2>&1
      echo "rc $?" >> $L
    done
  done
done
python3 - $OUT <<'PY' | tee -a $L
import glob, json, os, sys
print("| run | pattern | fwd ms | fwd+bwd ms |")
print("|---|---|---|---|")
for p in sorted(glob.glob(os.path.join(sys.argv[1], "r*.json"))):
    for x in json.load(open(p))["results"]:
        print(f"| {os.path.basename(p)[:-5]} | {x['pattern']} | {x['forward_ms']:.3f} | {x['forward_backward_ms']:.3f} |")
PY
cd $OUT && tar czf runsV4.tgz r*.json && rm -f r*.json
echo "total $((SECONDS - T0)) s"
