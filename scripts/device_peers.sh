#!/usr/bin/env bash
# device_peers.sh: issue 21 on the GPU machine in one command: our kernels and the strongest
# peers in the same call, one table (tools/bench_cuda_peers.py; docs/PERFORMANCE.md, "The
# peers of issue 21"). Run from the repository root with carry [".device", ".whl"]:
#  1. the carried wheels (.whl/*.whl: nvidia-cudnn-frontend) installed into /tmp/site;
#  2. the build (scripts/device_cuda.sh build, as every device script);
#  3. mtrain-bench-cuda at 32768 tokens, 16:2 heads, d 128, variant 3: our dense and
#     vertical-slash rows, the pattern (--pattern-out) the peers are fed;
#  4. minference's CUDA extension built from .whl/minference-*.tar.gz (its build time printed);
#  5. tools/bench_cuda_peers.py: SDPA flash and cuDNN, FlexAttention, the cuDNN frontend (dense,
#     block mask), flash-attn, minference (exact tiles, public API), FlashInfer, and the block
#     mask of bench_block_kernels (keep 16) with mtrain's Python op; every peer under its own
#     limit, the ones that cannot run named with why.
# Every step runs under `timeout`, cut to what is left of CALL_S (default 470 s), so the whole
# script ends within 8 minutes. Logs and JSON to $OUT (default build-cuda/device-out): peers.log.
set -uo pipefail
# shellcheck source=scripts/device_lib.sh
. "$(dirname "$0")/device_lib.sh" || exit 1
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root" || exit 1
dev_call_start peers 470 20
work=/tmp/mtrain-peers
mkdir -p "$work"
dev_deps_openblas
seq=${PEERS_SEQ:-32768}
step() { dev_limited_step "$@"; } # NAME LIMIT CMD...
step wheels 90 python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$root/python${PYTHONPATH:+:$PYTHONPATH}
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" | tee -a "$log"
step build 240 bash scripts/device_cuda.sh build
export MTRAIN_LIBRARY=$root/build-cuda/libmtrain.so
step bench 120 build-cuda/tools/mtrain-bench-cuda --seq-len "$seq" --heads 16 --kv-heads 2 \
  --head-dim 128 --variants 3 --reps 7 --warmup 2 --validate-len 2048 \
  --pattern-out "$work/pattern.json" --json "$OUT/bench.json"
step minference 120 python3 tools/peers_minference.py .whl "$work"
step peers 300 python3 tools/bench_cuda_peers.py --pattern "$work/pattern.json" --seq-len "$seq" \
  --ours "$OUT/bench.json" --reps 7 --warmup 2 --peer-limit 100 --block-keep 16 \
  --peers sdpa-flash,sdpa-cudnn,flex,minference,cudnn-fe,flash-attn,flashinfer \
  --work-dir "$work" --json "$OUT/peers.json"
echo "==== summary"
printf '  %s\n' "${summary[@]}"
sed -n '/^==== peers/,$p' "$log" | sed -n '/^== peers table/,$p'
