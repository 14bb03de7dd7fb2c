#!/usr/bin/env bash
# device call V5 (2026-11-29f, one H200): variant 3's two forward kernels of this tree (persistent,
# MTRAIN_CUDA_WGMMA_FWD_PERSISTENT=1, the default; one CTA per item, =0) against each other, three
# rounds interleaved at d 128 and d 64 (mtrain-bench-cuda, 32768 tokens, 16:2 heads, bf16, causal),
# then block masks (tools/bench_block_kernels.py --queued --keep 4,16, d 128) with each.
# (kept here as run, from the repository root: it reads the Debian packages of .device/debs)
set -uo pipefail
T0=$SECONDS
. scripts/device_lib.sh
dev_unpack_debs "$PWD"
dev_deps_openblas
L=$OUT/callV5.log
B=build-cuda
{ cmake -S . -B $B -DCMAKE_BUILD_TYPE=Release -DMTRAIN_WITH_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90a \
    -DMTRAIN_PATTERN_DATA_DIR=$PWD/data/budgets &&
  cmake --build $B -j16 --target mtrain mtrain-bench-cuda; } > $OUT/build.log 2>&1
echo "build: rc $? ($((SECONDS - T0)) s)" | tee $L
for r in 1 2 3; do
  for d in 128 64; do
    for pers in 1 0; do
      [ $((SECONDS - T0)) -lt 420 ] || break
      echo "==== round $r d $d persistent=$pers ($((SECONDS - T0)) s)" >> $L
      timeout -k 3 40 env MTRAIN_CUDA_WGMMA_FWD_PERSISTENT=$pers $B/tools/mtrain-bench-cuda \
        --seq-len 32768 --heads 16 --kv-heads 2 --head-dim $d --variants 3 --reps 10 --warmup 3 \
        --validate-len 1024 --json $OUT/r$r-d$d-p$pers.json >> $L 2>&1
      echo "rc $?" >> $L
    done
  done
done
export PYTHONPATH=$PWD/python MTRAIN_LIBRARY=$PWD/$B/libmtrain.so
for pers in 1 0 1 0; do
  [ $((SECONDS - T0)) -lt 500 ] || break
  echo "==== bench_block_kernels persistent=$pers ($((SECONDS - T0)) s)" >> $L
  timeout -k 3 60 env MTRAIN_CUDA_WGMMA_FWD_PERSISTENT=$pers python3 tools/bench_block_kernels.py \
    --seq-len 32768 --queued --keep 4,16 >> $L 2>&1
  echo "rc $?" >> $L
done
python3 - $OUT <<'PY' | tee -a $L
import glob, json, os, sys
print("| run | pattern | fwd ms | fwd+bwd ms |")
print("|---|---|---|---|")
for p in sorted(glob.glob(os.path.join(sys.argv[1], "r*.json"))):
    for x in json.load(open(p))["results"]:
        print(f"| {os.path.basename(p)[:-5]} | {x['pattern']} | {x['forward_ms']:.3f} | {x['forward_backward_ms']:.3f} |")
PY
grep -E "^\| (dense|keep|[0-9])|====" $L | tail -30
cd $OUT && tar czf runsV5.tgz r*.json && rm -f r*.json
echo "total $((SECONDS - T0)) s"
