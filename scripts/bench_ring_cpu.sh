#!/usr/bin/env bash
# bench_ring_cpu.sh: the CPU ring benchmark of docs/PERFORMANCE.md: flat and
# hierarchical rings on 2 and 4 MPI ranks of this machine, N = 8192, the
# Qwen2.5-3B budgets of layer 31, forward and backward; prints one JSON
# summary line per configuration. Needs a build in build/.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMP_NUM_THREADS=1
budgets="$root/data/budgets/Qwen2.5_3B_kv_out_v32_fit_o_best_pattern.json"
for spec in "2 flat 0" "2 hier 1" "4 flat 0" "4 hier 2"; do
  set -- $spec
  extra=()
  [ "$2" = hier ] && extra=(--schedule hier --ranks-per-node "$3")
  mpiexec -n "$1" --oversubscribe --bind-to none "$root/build/tools/mtrain-run" --seq-len 8192 \
    --budgets "$budgets" --layer 31 --repeat 2 "${extra[@]}" --json |
    python3 -c "import json,sys; d=json.load(sys.stdin); print(json.dumps({k: d.get(k) for k in
      ['world','schedule','ranks_per_node','sparsity','forward_seconds','backward_seconds',
       'forward_ring_over_compute','backward_ring_over_compute','pair_imbalance']}))"
done
