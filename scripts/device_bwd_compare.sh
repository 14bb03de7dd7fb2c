#!/usr/bin/env bash
# device_bwd_compare.sh: variant 3's two backward kernels on the GPU machine in
# one command (docs/CUDA_KERNELS.md, "The warp-specialised backward"): the
# warp-specialised wgmma_bwd_ws_kernel (MTRAIN_CUDA_WGMMA_BWD=2, the default)
# against the first one (=1), built once, then
#  1. tests: test_cross_backend cuda 3 with each kernel, deterministic and
#     fused, against the fp64 oracle; test_cuda_device_plan; the layout test;
#  2. compute-sanitizer racecheck and memcheck on the quick cross-backend cases
#     of variant 3 with the new kernel, deterministic and fused;
#  3. timing: mtrain-bench-cuda at 32768 tokens, bf16, causal, dense and
#     vertical-slash, d 64 (8:2 heads) and d 128 (16:2), the fused backward of
#     each kernel in two interleaved rounds and the deterministic one once,
#     then torch SDPA cuDNN and flash (tools/bench_cuda_peers.py) in the same
#     call. STAGES selects a subset of "build tests sanitize bench".
# Logs to $OUT (default build-cuda/device-out): compare.log and the JSON files.
set -uo pipefail
# shellcheck source=scripts/device_lib.sh
. "$(dirname "$0")/device_lib.sh" || exit 1
root=$(cd "$(dirname "$0")/.." && pwd)
OUT=${OUT:-$root/build-cuda/device-out}
mkdir -p "$OUT"
export OUT
dev_deps_openblas # the OpenBLAS that device_cuda.sh unpacks from .device/debs
stages=${STAGES:-build tests sanitize bench}
build=$root/build-cuda
log=$OUT/compare.log
: > "$log"
say() { echo "==== $* ($(date +%H:%M:%S))" | tee -a "$log"; }
if dev_want build; then
  say build
  bash "$root/scripts/device_cuda.sh" build >> "$log" 2>&1 || { tail -40 "$OUT/build.log"; exit 1; }
fi
rc=0
if dev_want tests; then
  say tests
  (cd "$build" && ctest -R "cross_backend_cuda_v3|cuda_device_plan|cuda_wgmma_layout" \
    --output-on-failure --timeout 1500) >> "$log" 2>&1 || rc=1
  grep -E "Test +#|tests passed" "$log" | tail -8
fi
if dev_want sanitize; then
  say sanitize
  cs=$(dev_sanitizer)
  for tool in racecheck memcheck; do
    for det in 1 0; do
      echo "== $tool, variant 3, MTRAIN_DETERMINISTIC=$det" >> "$log"
      MTRAIN_DETERMINISTIC=$det MTRAIN_TEST_QUICK=1 "$cs" --tool $tool --error-exitcode 99 \
        "$build/tests/test_cross_backend" cuda 3 >> "$log" 2>&1 || rc=1
      grep -E "ERROR SUMMARY|RACECHECK SUMMARY" "$log" | tail -1
    done
  done
fi
if dev_want bench; then
  say bench
  bench() { # d heads bwd det tag
    MTRAIN_CUDA_WGMMA_BWD=$3 MTRAIN_DETERMINISTIC=$4 "$build/tools/mtrain-bench-cuda" \
      --seq-len 32768 --heads "$2" --kv-heads 2 --head-dim "$1" --variants 3 --reps 7 \
      --warmup 2 --validate-len 2048 > "$OUT/.b" 2>&1 || rc=1
    { echo "== d $1, $2:2 heads, MTRAIN_CUDA_WGMMA_BWD=$3, MTRAIN_DETERMINISTIC=$4 ($5)"
      cat "$OUT/.b"; } >> "$log"
    echo "d $1 bwd $3 det $4 ($5): $(grep -E '^(dense|vertical-slash) ' "$OUT/.b" | tr '\n' ' ')"
  }
  for d in 64 128; do
    h=$([ "$d" = 64 ] && echo 8 || echo 16)
    bench "$d" "$h" 2 0 ws1
    bench "$d" "$h" 1 0 first1
    bench "$d" "$h" 2 0 ws2
    bench "$d" "$h" 1 0 first2
    bench "$d" "$h" 2 1 ws-det
    bench "$d" "$h" 1 1 first-det
    echo "== peers d $d" >> "$log"
    python3 "$root/tools/bench_cuda_peers.py" --peers sdpa-cudnn,sdpa-flash --seq-len 32768 \
      --heads "$h" --kv-heads 2 --head-dim "$d" --reps 7 --warmup 2 \
      >> "$log" 2>&1 || rc=1
    grep -E "cudnn|flash" "$log" | tail -4
  done
  rm -f "$OUT/.b"
fi
echo "rc $rc"
exit $rc
