#!/usr/bin/env bash
# The CPU comparison of the block arm's pattern cache (docs/TRAINING.md, "The pattern cache in the
# block arm"): --block-refresh 1 (select every step), 8 and 4, in the order 1 8 4 1 8 so that the
# shared VM's changing load falls on each setting; the tiny model, 1024 tokens, 200 steps.
set -u
cd "$(dirname "$0")/../../.."
D=docs/cpu-runs/2026-11-27-block-cache-arm
PY=${PYTHON:-/work/main/build/venv/bin/python}
export MTRAIN_LIBRARY=${MTRAIN_LIBRARY:-$PWD/build/libmtrain.so} PYTHONPATH=python
export OMP_NUM_THREADS=1 MTRAIN_NUM_THREADS=1
echo "commit $(git rev-parse --short HEAD), $(nproc --all) cores, $(grep -m1 'model name' /proc/cpuinfo)"
for run in 1:a 8:a 4:a 1:b 8:b; do
  k=${run%:*}
  echo "=== $(date -u +%FT%TZ) refresh $k (${run#*:}), load: $(cut -d' ' -f1-3 /proc/loadavg)"
  "$PY" -m examples.train --arm mtrain-block --block-top-p 0.5 --block-refresh "$k" \
    --size tiny --task mix --seq-len 1024 --batch 2 --steps 200 --warmup 10 --seed 0 \
    --data-seed 7 --eval-seqs 16 --probe-every 50 --threads 1 --device cpu \
    --out "$D/refresh-$k-${run#*:}.json"
  echo "=== $(date -u +%FT%TZ) exit status $?, load: $(cut -d' ' -f1-3 /proc/loadavg)"
done
"$PY" -m examples.train.report "$D"/refresh-*.json --out-dir /tmp/block-cache-arm-charts
