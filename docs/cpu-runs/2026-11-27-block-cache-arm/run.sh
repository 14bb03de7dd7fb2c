#!/usr/bin/env bash
# the CPU comparison of --block-refresh 1, 8, 4 (docs/TRAINING.md)
set -u
cd /work/wt-trainarm
D=docs/cpu-runs/2026-11-27-block-cache-arm
export MTRAIN_LIBRARY=$PWD/build/libmtrain.so PYTHONPATH=python OMP_NUM_THREADS=1 MTRAIN_NUM_THREADS=1
for k in 1 8 4; do
  echo "=== $(date -u +%FT%TZ) refresh $k, load: $(cut -d' ' -f1-3 /proc/loadavg)"
  /work/main/build/venv/bin/python -m examples.train --arm mtrain-block --block-top-p 0.5 \
    --block-refresh $k --size tiny --task mix --seq-len 1024 --batch 2 --steps 200 --warmup 10 \
    --seed 0 --data-seed 7 --eval-seqs 16 --probe-every 50 --threads 1 --device cpu \
    --out $D/refresh-$k.json
  echo "=== $(date -u +%FT%TZ) done refresh $k (rc $?), load: $(cut -d' ' -f1-3 /proc/loadavg)"
done
