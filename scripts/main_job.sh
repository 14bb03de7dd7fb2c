#!/usr/bin/env bash
# main_job.sh: the README's main-job command. Installs the dependencies,
# builds, and runs mtrain-run: sparse attention forward and backward on the
# CPU with a vertical-slash pattern built from the real Qwen2.5-3B budgets,
# verified against the fp64 reference, with its report. Extra arguments go
# to mtrain-run.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
"$root/scripts/install_deps.sh"
"$root/scripts/build.sh" > "$root/build.log" 2>&1 || { cat "$root/build.log"; exit 1; }
exec "$root/build/tools/mtrain-run" --pattern "$root/examples/patterns/qwen2.5-3b-layer3-n4096.json" \
  --seq-len 4096 --heads 16 --kv-heads 2 --head-dim 128 --check "$@"
