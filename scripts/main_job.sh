#!/usr/bin/env bash
# main_job.sh: the README's main-job command. Installs the dependencies,
# builds, and runs the main job: mtrain-run on 4 MPI ranks of this machine,
# CPU backend, structured inputs (RoPE'd q and k with vertical-slash
# structure), the pattern estimated online (distributed) from the real
# Qwen2.5-3B budgets of layer 31, the striped layout on the flat ring, sparse
# attention forward and backward, verified against the distributed fp64
# reference, with the per-rank and total report. Extra arguments go to
# mtrain-run (for example --schedule hier --ranks-per-node 2, --layout zigzag,
# --json).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
"$root/scripts/install_deps.sh"
"$root/scripts/build.sh" > "$root/build.log" 2>&1 || { cat "$root/build.log"; exit 1; }
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMP_NUM_THREADS=1
exec mpiexec -n 4 --oversubscribe --bind-to none "$root/build/tools/mtrain-run" \
  --budgets "$root/data/budgets/Qwen2.5_3B_kv_out_v32_fit_o_best_pattern.json" \
  --layer 31 --seq-len 4096 --heads 16 --kv-heads 2 --head-dim 128 --check "$@"
