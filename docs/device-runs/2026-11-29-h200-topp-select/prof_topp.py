"""Profile a few steps of the training program's arms at 32K (torch.profiler): where the top-p
step's time goes. From the repository root, with MTRAIN_LIBRARY set and PYTHONPATH=python:.:
python3 docs/device-runs/2026-11-29-h200-topp-select/prof_topp.py ARM WEIGHTS OUT_JSON STEPS"""

import sys

from torch.profiler import ProfilerActivity, profile

from examples.train.train import main

arm, weights, out, steps = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4]
COMMON = (
    "--size mini --task mix --num-keys 32 --num-values 32 --num-filler 256 --mqar-pairs 4"
    " --mqar-queries 24 --passkey-digits 5 --eval-seqs 2 --eval-batch 2 --seed 0 --data-seed 1"
    " --seq-len 32768 --batch 2 --lr 1e-3 --warmup 20 --eval-every 100000"
)
args = COMMON.split()
args += ["--arm", arm, "--steps", steps, "--init-from", weights, "--out", out]
if arm == "mtrain-topp":
    args += ["--topp-forced", "1"]
with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
    main(args)
table = prof.key_averages().table(
    sort_by="self_cuda_time_total", row_limit=30, max_name_column_width=70
)
print(table)
