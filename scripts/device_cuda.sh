#!/usr/bin/env bash
# device_cuda.sh: the one script for the GPU machine (H100/H200, Ubuntu, root,
# nvcc, cmake, OpenMPI, OpenBLAS, torch and compute-sanitizer installed). From
# the repository root:
#
#   bash scripts/device_cuda.sh [build] [test] [sanitize] [run] [bench] [peers]
#
# runs the stages named (all six, in this order, when none is named):
#   build     configure (CUDA on, CMAKE_CUDA_ARCHITECTURES=$MTRAIN_CUDA_ARCH or
#             90a, the library's default) and build with -j16 into build-cuda/
#   test      the CUDA tests under ctest (-R ${MTRAIN_TEST_FILTER:-cuda}, without
#             -E ${MTRAIN_TEST_EXCLUDE:-emu}: the CPU emulator test), with their output
#   sanitize  compute-sanitizer memcheck (with leak check) and racecheck on the
#             reduced cross-backend run (MTRAIN_TEST_QUICK=1), variants
#             $MTRAIN_SANITIZE_VARIANTS (default "0 2 2n 3 3n"; 2n, 3n: variant 2
#             or 3 with the fused, non-deterministic backward)
#   run       mtrain-run --backend cuda --check on small problems (variants
#             auto, 0, 2 and 3; the pattern estimated on the device)
#   bench     mtrain-bench-cuda (N = $MTRAIN_BENCH_SEQ or 32768): validation,
#             then timing of variants $MTRAIN_BENCH_VARIANTS (default 0,2,3); writes
#             the pattern and the validation dumps; then variants 2 and 3 with the
#             fused (non-deterministic) backward, and each further tile configuration
#             listed in $MTRAIN_BENCH_MMA2_CONFIGS (default none) with
#             MTRAIN_DETERMINISTIC 1, 0; variant 3's fused backward with each of its
#             kernels (MTRAIN_CUDA_WGMMA_BWD 2, the default, and 1)
#   nccl      (two or more GPUs) the NCCL ring and fault tests (ctest -L nccl: one
#             process per GPU under mpiexec, one process with a thread per GPU, and
#             test_nccl_fault_*: a peer killed or stalled mid-forward/backward must
#             end in a clear error within the timeout; on 2 ranks, and on 4 where 4
#             GPUs are visible), then mtrain-run under
#             mpiexec on 2 GPUs with --check (flat, hierarchical)
#   ringbench (two GPUs) mtrain-run under mpiexec -n 2, bf16, 16:2 heads, d 128:
#             the dense ring (zigzag) against the sparse ring (striped, the
#             Qwen2.5-3B budgets of layers $MTRAIN_RING_LAYERS, estimated) at
#             $MTRAIN_RING_SEQS tokens (default 131072), --repeat 3, JSON reports
#   ringbench2 (two GPUs) mtrain-bench under mpiexec -n 2, bf16, 16:2 heads, d 128:
#             for each length of $MTRAIN_RING_SEQS (default 131072,524288,1048576)
#             the dense ring (zigzag; skipped above $MTRAIN_RING_DENSE_MAX, default
#             524288) and, for each layer of $MTRAIN_RING_LAYERS (default 3,15,31),
#             the sparse ring (striped, Qwen2.5-3B budgets, estimated on the GPUs):
#             forward+backward, 1 warm-up, median of ${MTRAIN_RING_REPEAT:-3},
#             tokens/s, speed-up, ring/compute; ringbench2.log and ringbench2.json
#   peers     tools/bench_cuda_peers.py (torch SDPA flash/cuDNN, FlexAttention)
#             on the bench's pattern, and the independent check of its dumps;
#             runs the bench first when its outputs are missing
# A stage that needs the build builds first when build-cuda/ has no build.
# Dependencies missing on the machine (jansson, cmocka, ...) are taken from
# the .deb files in .device/debs when that folder exists (unpacked with
# dpkg -x into /tmp/deps: dev_unpack_debs of scripts/device_lib.sh). Logs go to $OUT (default build-cuda/device-out), one
# or two files per stage run plus summary.txt (the default six stages: 8 files):
# build.log test.log sanitize.log run.log bench.log bench.json peers.log
# nccl.log ringbench.log ringbench.txt ringbench2.log ringbench2.json; a short
# summary table is printed last. The exit status is 0 when every stage run passed.
set -uo pipefail
# shellcheck source=scripts/device_lib.sh
. "$(dirname "$0")/device_lib.sh" || exit 1
root=$(cd "$(dirname "$0")/.." && pwd)
build=$root/build-cuda
OUT=${OUT:-$build/device-out}
mkdir -p "$OUT"
work=$build/device-work # the bench's pattern and dumps (kept between calls)
arch=${MTRAIN_CUDA_ARCH:-90a}
bench_seq=${MTRAIN_BENCH_SEQ:-32768}
dev_mpi_root
export PATH=$PATH:/usr/local/cuda/bin

stages=("$@")
[ ${#stages[@]} -eq 0 ] && stages=(build test sanitize run bench peers)
for s in "${stages[@]}"; do
  case $s in
  build | test | sanitize | run | bench | peers | nccl | ringbench | ringbench2) ;;
  *)
    echo "device_cuda.sh: unknown stage '$s' (build test sanitize run bench peers nccl" \
      "ringbench ringbench2)" >&2
    exit 2
    ;;
  esac
done

summary=()  # "stage|status|seconds|detail"
failed=0
bench_ran=0
note() { summary+=("$1|$2|$3|$4"); [ "$2" = ok ] || failed=1; }
join() { local out="" x; for x in "$@"; do out+="${out:+; }$x"; done; echo "$out"; }
say() { echo "== device_cuda.sh: $* ($(date +%H:%M:%S))"; }

# ---- dependencies from .device/debs (unpacked into /tmp/deps) ---------------------
dev_unpack_debs "$root"

# The real budget files (tests and the run stage), in the repository: data/budgets.
data=""
[ -f "$root/data/budgets/Qwen2.5_3B_kv_out_v32_fit_o_best_pattern.json" ] && data=$root/data/budgets

# ---- stages -----------------------------------------------------------------------
stage_build() {
  local t0=$SECONDS log=$OUT/build.log
  say "build (CUDA architectures $arch) -> $log"
  {
    echo "nvcc: $(nvcc --version 2>&1 | tail -1)"
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>&1
    for m in jansson cmocka libpng; do
      pkg-config --exists $m 2>/dev/null && echo "$m $(pkg-config --modversion $m)" ||
        echo "MISSING: $m (put its .deb files, -dev and runtime, in .device/debs)"
    done
    [ -n "$data" ] && echo "budget files: $data" ||
      echo "WARNING: no data/budgets in $root: the qwen-budgets test cases will fail"
    extra=()
    [ -n "$data" ] && extra+=(-DMTRAIN_PATTERN_DATA_DIR="$data")
    cmake -S "$root" -B "$build" -DCMAKE_BUILD_TYPE=Release -DMTRAIN_WITH_CUDA=ON \
      -DCMAKE_CUDA_ARCHITECTURES="$arch" "${extra[@]}" &&
      cmake --build "$build" -j16
  } > "$log" 2>&1
  local rc=$?
  if [ $rc -eq 0 ]; then
    note build ok $((SECONDS - t0)) "sm_$arch"
  else
    tail -30 "$log"
    note build FAILED $((SECONDS - t0)) "see build.log"
  fi
  return $rc
}

ensure_build() {
  [ -x "$build/tools/mtrain-bench-cuda" ] && [ -x "$build/tests/test_cross_backend" ] && return 0
  stage_build
}

stage_test() {
  local t0=$SECONDS log=$OUT/test.log
  say "CUDA tests (ctest -R cuda) -> $log"
  ensure_build || { note test FAILED 0 "no build"; return 1; }
  # test_cuda_emu (the CPU emulator, run by CI) is left out on the GPU machine
  (cd "$build" && ctest -R "${MTRAIN_TEST_FILTER:-cuda}" -E "${MTRAIN_TEST_EXCLUDE:-emu}" -V \
    --timeout 1500) > "$log" 2>&1
  local rc=$?
  local line skipped
  line=$(grep -E "tests passed|tests failed" "$log" | tail -1)
  skipped=$(grep -c "\*\*\*Skipped\|Not Run" "$log")
  grep -E "(fp32|bf16|fp16): .*(compared|skipped)|Test +#|all cases SKIPPED|FAILED  \]" "$log" |
    tail -24
  if [ $rc -eq 0 ] && [ "$skipped" -eq 0 ]; then
    note test ok $((SECONDS - t0)) "$line"
  else
    note test FAILED $((SECONDS - t0)) "$line; $skipped skipped (a GPU run must skip none)"
  fi
}

stage_sanitize() {
  local t0=$SECONDS log=$OUT/sanitize.log res=() bad=0
  say "compute-sanitizer (memcheck, racecheck) on the quick cross-backend cases -> $log"
  ensure_build || { note sanitize FAILED 0 "no build"; return 1; }
  local cs
  cs=$(dev_sanitizer)
  if [ ! -x "$cs" ]; then
    note sanitize FAILED 0 "compute-sanitizer not found"
    return 1
  fi
  : > "$log"
  for tool in memcheck racecheck; do
    for v in ${MTRAIN_SANITIZE_VARIANTS:-0 2 2n 3 3n}; do
      local flags=(--tool "$tool" --error-exitcode 99)
      [ "$tool" = memcheck ] && flags+=(--leak-check full)
      echo "== $tool, variant $v" >> "$log"
      # 2n, 3n: variant 2 or 3 with the fused, non-deterministic backward
      MTRAIN_DETERMINISTIC=$([ "${v%n}" != "$v" ] && echo 0 || echo 1) MTRAIN_TEST_QUICK=1 \
        "$cs" "${flags[@]}" "$build/tests/test_cross_backend" cuda "${v%n}" >> "$log" 2>&1
      local rc=$?
      local errs
      errs=$(grep -E "ERROR SUMMARY" "$log" | tail -1 | grep -oE "[0-9]+ errors?" || echo "?")
      res+=("$tool v$v: rc $rc, $errs")
      [ $rc -eq 0 ] || bad=1
    done
  done
  printf '  %s\n' "${res[@]}"
  if [ $bad -eq 0 ]; then
    note sanitize ok $((SECONDS - t0)) "$(join "${res[@]}")"
  else
    note sanitize FAILED $((SECONDS - t0)) "$(join "${res[@]}")"
  fi
}

stage_run() {
  local t0=$SECONDS log=$OUT/run.log res=() bad=0
  say "mtrain-run --backend cuda --check -> $log"
  ensure_build || { note run FAILED 0 "no build"; return 1; }
  local src=(--v-size 256 --s-size 128)
  [ -n "$data" ] && src=(--budgets "$data/Qwen2.5_3B_kv_out_v32_fit_o_best_pattern.json" --layer 31)
  : > "$log"
  for v in auto 0 2 3; do
    for spec in "bf16 2048 estimated" "fp16 1000 dense"; do
      set -- $spec
      local args=(--backend cuda --cuda-variant "$v" --dtype "$1" --seq-len "$2" --check --repeat 3)
      [ "$3" = estimated ] && args+=("${src[@]}")
      echo "== mtrain-run ${args[*]}" >> "$log"
      "$build/tools/mtrain-run" "${args[@]}" >> "$log" 2>&1
      local rc=$?
      res+=("v$v $1 N=$2 $3: $([ $rc -eq 0 ] && echo PASS || echo "FAIL (exit $rc)")")
      [ $rc -eq 0 ] || bad=1
    done
  done
  printf '  %s\n' "${res[@]}"
  if [ $bad -eq 0 ]; then
    note run ok $((SECONDS - t0)) "$(join "${res[@]}")"
  else
    note run FAILED $((SECONDS - t0)) "$(join "${res[@]}")"
  fi
}

stage_bench() {
  local t0=$SECONDS log=$OUT/bench.log
  say "mtrain-bench-cuda N=$bench_seq -> $log, $OUT/bench.json"
  bench_ran=1
  ensure_build || { note bench FAILED 0 "no build"; return 1; }
  rm -rf "$work"
  mkdir -p "$work"
  # the main run feeds the peers
  "$build/tools/mtrain-bench-cuda" --seq-len "$bench_seq" --variants "${MTRAIN_BENCH_VARIANTS:-0,2,3}" \
    --pattern-out "$work/pattern.json" --dump-dir "$work/dump" --json "$OUT/bench.json" > "$log" 2>&1
  local rc=$?
  sed -n '/^mtrain-bench-cuda: .*causal; median/,$p' "$log"
  # variant 2's tile configurations, and its fused non-deterministic backward
  local cfg det
  for cfg in 0 ${MTRAIN_BENCH_MMA2_CONFIGS:-}; do
    for det in 1 0; do
      [ "$cfg" = 0 ] && [ "$det" = 1 ] && continue
      echo "== variant 2, MTRAIN_CUDA_MMA2_CONFIG=$cfg MTRAIN_DETERMINISTIC=$det" | tee -a "$log"
      MTRAIN_CUDA_MMA2_CONFIG=$cfg MTRAIN_DETERMINISTIC=$det "$build/tools/mtrain-bench-cuda" \
        --seq-len "$bench_seq" --variants 2 > "$work/extra.log" 2>&1 || rc=$?
      cat "$work/extra.log" >> "$log"
      grep -E "^(dense|vertical-slash) " "$work/extra.log"
    done
  done
  # variant 3 with the fused backward: the default kernel (the warp-specialised
  # wgmma_bwd_ws_kernel), then the first one (MTRAIN_CUDA_WGMMA_BWD=1) in the same call
  local bk
  for bk in 2 1; do
    echo "== variant 3, MTRAIN_DETERMINISTIC=0 MTRAIN_CUDA_WGMMA_BWD=$bk" | tee -a "$log"
    MTRAIN_CUDA_WGMMA_BWD=$bk MTRAIN_DETERMINISTIC=0 "$build/tools/mtrain-bench-cuda" \
      --seq-len "$bench_seq" --variants 3 > "$work/extra.log" 2>&1 || rc=$?
    cat "$work/extra.log" >> "$log"
    grep -E "^(dense|vertical-slash) " "$work/extra.log"
  done
  if [ $rc -eq 0 ]; then
    note bench ok $((SECONDS - t0)) "table in bench.log"
  else
    tail -5 "$log"
    note bench FAILED $((SECONDS - t0)) "exit $rc (exit 3: a variant failed its validation)"
  fi
  return $rc
}

stage_peers() {
  local t0=$SECONDS log=$OUT/peers.log
  # the peers need the bench's pattern, dumps and results: run it first when
  # this call has not and they are missing
  if [ $bench_ran -eq 0 ] && { [ ! -f "$work/pattern.json" ] || [ ! -f "$OUT/bench.json" ]; }; then
    stage_bench || true
  fi
  if [ ! -f "$work/pattern.json" ]; then
    note peers FAILED 0 "no pattern from mtrain-bench-cuda"
    return 1
  fi
  say "bench_cuda_peers.py -> $log"
  python3 "$root/tools/bench_cuda_peers.py" --pattern "$work/pattern.json" --seq-len "$bench_seq" \
    --dump-dir "$work/dump" --ours "$OUT/bench.json" > "$log" 2>&1
  local rc=$?
  grep -E "MISMATCH|FAIL|pairs:" "$log" | head -12
  sed -n '/^== peers table/,$p' "$log"
  if [ $rc -eq 0 ]; then
    note peers ok $((SECONDS - t0)) "table in peers.log; independent check passed"
  else
    tail -5 "$log"
    note peers FAILED $((SECONDS - t0)) "exit $rc (exit 3: the independent check failed)"
  fi
}

stage_nccl() {
  local t0=$SECONDS log=$OUT/nccl.log res=() bad=0
  say "NCCL ring tests and mtrain-run on $(nvidia-smi -L | wc -l) GPUs -> $log"
  ensure_build || { note nccl FAILED 0 "no build"; return 1; }
  dev_no_nvls
  # the 4-rank fault tests need 4 GPUs: left out below that (a skip fails this stage)
  local skip=()
  [ "$(nvidia-smi -L | wc -l)" -lt 4 ] && skip=(-E nccl_fault_w4)
  (cd "$build" && ctest -L nccl "${skip[@]}" -V --timeout 900) > "$log" 2>&1
  local rc=$?
  grep -E "^[0-9]+: (passed|FAILED|SKIPPED|PASS: mode|FAIL)|^[0-9]+: +rank|tests passed|tests failed" \
    "$log" | tail -40
  res+=("ctest -L nccl: $(grep -E 'tests passed|tests failed' "$log" | tail -1)")
  grep -q "Skipped" "$log" && { res+=("a test SKIPPED"); bad=1; }
  [ $rc -eq 0 ] || bad=1
  local src=(--v-size 256 --s-size 128)
  [ -n "$data" ] && src=(--budgets "$data/Qwen2.5_3B_kv_out_v32_fit_o_best_pattern.json" --layer 31)
  for spec in "flat" "hier 1"; do
    set -- $spec
    local args=(--backend cuda --dtype bf16 --seq-len 16384 --layout striped --check "${src[@]}")
    [ "$1" = hier ] && args+=(--schedule hier --ranks-per-node "$2")
    echo "== mpiexec -n 2 mtrain-run ${args[*]}" >> "$log"
    mpiexec -n 2 --bind-to none "$build/tools/mtrain-run" "${args[@]}" >> "$log" 2>&1
    rc=$?
    res+=("mtrain-run 2 GPUs $spec: $([ $rc -eq 0 ] && echo PASS || echo "FAIL (exit $rc)")")
    [ $rc -eq 0 ] || bad=1
  done
  printf '  %s\n' "${res[@]}"
  if [ $bad -eq 0 ]; then
    note nccl ok $((SECONDS - t0)) "$(join "${res[@]}")"
  else
    note nccl FAILED $((SECONDS - t0)) "$(join "${res[@]}")"
  fi
}

stage_ringbench() {
  local t0=$SECONDS log=$OUT/ringbench.log bad=0
  say "ring benchmark on 2 GPUs -> $log"
  ensure_build || { note ringbench FAILED 0 "no build"; return 1; }
  dev_no_nvls
  : > "$log"
  local budgets=$data/Qwen2.5_3B_kv_out_v32_fit_o_best_pattern.json
  printf '%-8s %-6s %-22s %9s %10s %10s %9s %9s\n' tokens layer mode sparsity fwd_s bwd_s \
    fwd_ring bwd_ring | tee -a "$OUT/ringbench.txt"
  for n in ${MTRAIN_RING_SEQS:-131072}; do
    local dense_total=""
    for mode in dense ${MTRAIN_RING_LAYERS:-3 31}; do
      local args=(--backend cuda --dtype bf16 --seq-len "$n" --heads 16 --kv-heads 2 --head-dim 128
        --repeat 3 --json)
      if [ "$mode" = dense ]; then args+=(--layout zigzag --input normal)
      else args+=(--layout striped --budgets "$budgets" --layer "$mode"); fi
      echo "== mpiexec -n 2 mtrain-run ${args[*]}" >> "$log"
      local js
      js=$(mpiexec -n 2 --bind-to none "$build/tools/mtrain-run" "${args[@]}" 2>> "$log")
      local rc=$?
      echo "$js" >> "$log"
      [ $rc -eq 0 ] || { bad=1; continue; }
      python3 - "$n" "$mode" "$js" <<'PY' | tee -a "$OUT/ringbench.txt"
import json, sys
n, mode, js = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
print(f"{n:<8} {mode:<6} {('dense zigzag' if mode == 'dense' else 'sparse striped'):<22} "
      f"{js['sparsity']:9.4f} {js['forward_seconds']:10.4f} {js['backward_seconds']:10.4f} "
      f"{js['forward_ring_over_compute']:9.3f} {js['backward_ring_over_compute']:9.3f}")
PY
    done
  done
  # the peer: a dense zigzag ring written with torch (SDPA flash kernels, NCCL send/recv)
  echo "== torch ring peer: check at N=4096" >> "$log"
  torchrun --nproc_per_node 2 "$root/tools/bench_ring_torch_peer.py" --seq-len 4096 --check-only \
    >> "$log" 2>&1 || { bad=1; echo "torch ring peer check FAILED" | tee -a "$OUT/ringbench.txt"; }
  for n in ${MTRAIN_RING_SEQS:-131072}; do
    echo "== torch ring peer N=$n" >> "$log"
    local js
    js=$(torchrun --nproc_per_node 2 "$root/tools/bench_ring_torch_peer.py" --seq-len "$n" \
      --reps 3 --warmup 1 --no-check 2>> "$log" | tail -1)
    echo "$js" >> "$log"
    python3 - "$n" "$js" 2>> "$log" <<'PY' | tee -a "$OUT/ringbench.txt" || bad=1
import json, sys
n, j = sys.argv[1], json.loads(sys.argv[2])
print(f"{n:<8} torch  {'dense zigzag (peer)':<22} {0.0:9.4f} {j['fwd_seconds']:10.4f} "
      f"{j['fwdbwd_seconds'] - j['fwd_seconds']:10.4f}")
PY
  done
  if [ $bad -eq 0 ]; then note ringbench ok $((SECONDS - t0)) "table in ringbench.log"
  else note ringbench FAILED $((SECONDS - t0)) "see ringbench.log"; fi
}

stage_ringbench2() {
  local t0=$SECONDS log=$OUT/ringbench2.log
  say "mtrain-bench on 2 GPUs -> $log, $OUT/ringbench2.json"
  ensure_build || { note ringbench2 FAILED 0 "no build"; return 1; }
  [ -x "$build/tools/mtrain-bench" ] || stage_build || { note ringbench2 FAILED 0 "no build"; return 1; }
  if [ -z "$data" ]; then
    note ringbench2 FAILED 0 "no budget files (data/budgets)"
    return 1
  fi
  dev_no_nvls
  # the lists may be given with spaces (as for the ringbench stage) or commas
  local seqs=${MTRAIN_RING_SEQS:-131072,524288,1048576} layers=${MTRAIN_RING_LAYERS:-3,15,31}
  seqs=${seqs// /,}
  layers=${layers// /,}
  local args=(--backend cuda --dtype bf16 --heads 16 --kv-heads 2 --head-dim 128
    --budgets "$data/Qwen2.5_3B_kv_out_v32_fit_o_best_pattern.json" --layers "$layers"
    --tokens-list "$seqs" --skip-dense-above "${MTRAIN_RING_DENSE_MAX:-524288}" --warmup 1
    --repeat "${MTRAIN_RING_REPEAT:-3}" --json "$OUT/ringbench2.json")
  echo "== mpiexec -n 2 mtrain-bench ${args[*]}" > "$log"
  mpiexec -n 2 --bind-to none "$build/tools/mtrain-bench" "${args[@]}" >> "$log" 2>&1
  local rc=$?
  sed -n '/^mtrain-bench: backend/,$p' "$log"
  if [ $rc -eq 0 ]; then
    note ringbench2 ok $((SECONDS - t0)) "table in ringbench2.log, ringbench2.json"
  else
    tail -20 "$log"
    note ringbench2 FAILED $((SECONDS - t0)) "exit $rc, see ringbench2.log"
  fi
}

for s in "${stages[@]}"; do
  "stage_$s"
done

# ---- summary ------------------------------------------------------------------------
{
  echo "== device_cuda.sh summary: $(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1), $(date -u +%Y-%m-%dT%H:%MZ)"
  printf '%-9s %-7s %6s  %s\n' stage status seconds detail
  for row in "${summary[@]}"; do
    IFS='|' read -r st status secs detail <<< "$row"
    printf '%-9s %-7s %6s  %s\n' "$st" "$status" "$secs" "$detail"
  done
  if [ -f "$OUT/bench.log" ]; then
    echo "-- mtrain-bench-cuda"
    sed -n '/^pattern .*density/,$p' "$OUT/bench.log"
  fi
  if [ -f "$OUT/ringbench2.log" ]; then
    echo "-- mtrain-bench (ring, 2 GPUs)"
    sed -n '/^mtrain-bench: backend/,$p' "$OUT/ringbench2.log"
  fi
  if [ -f "$OUT/peers.log" ]; then
    echo "-- peers"
    sed -n '/^== peers table/,$p' "$OUT/peers.log" | tail -n +2
  fi
} | tee "$OUT/summary.txt"
exit $failed
