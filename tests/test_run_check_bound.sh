#!/usr/bin/env bash
# test_run_check_bound.sh: mtrain-run --check's bound has an absolute floor
# for dQ and dK (docs/SPEC.md section 7, docs/USAGE.md): bound =
# max(tol * max|ref|, 8 * u_acc * S), S = scale * max ||dout|| * max ||v|| *
# max |k| (dQ) or max |q| (dK). It
#  - passes correct results whose reference dQ and dK are exactly zero: N = 1,
#    and G = 1 with diagonal 0 only (every query sees only itself), on the
#    cpu and cpu-ref backends;
#  - still fails a result perturbed beyond the bound (MTRAIN_RUN_FAULT=
#    add-dq:X adds X to one element of dQ: X = 2 bounds fails, the check's
#    exit status 3);
#  - loosens nothing on ordinary inputs: on N(0,1) inputs the floor is printed
#    next to the relative term tol * max|ref|; it must be below it, and the
#    bound must be the relative term (to the printed digits);
#  - passes the large-input case: q, k, v scaled 1e4 (--input-scale), fp32,
#    cpu backend, where the softmax saturates and dS = P (dP - delta) cancels
#    in fp32.
# usage: test_run_check_bound.sh MTRAIN_RUN TMPDIR
set -uo pipefail
bin=$1 work=$2/run_check_bound
rm -rf "$work"
mkdir -p "$work"
export OMP_NUM_THREADS=1
unset MTRAIN_RUN_FAULT MTRAIN_BACKEND
failures=0
fail() {
  echo "test_run_check_bound: FAIL: $*" >&2
  failures=$((failures + 1))
}
out=$work/out.txt

# passes NAME cmd...: exit 0 and PASS in the report
passes() {
  local name=$1 rc=0
  shift
  "$@" > "$out" 2>&1 || rc=$?
  if [ "$rc" != 0 ] || ! grep -q "check .*PASS" "$out"; then
    fail "$name: exit status $rc, expected a passing check: $(cat "$out")"
    return
  fi
  echo "test_run_check_bound: $name: PASS ($(grep -E '^ +(dq|dk) ' "$out" | tr -s ' ' | paste -sd ';'))"
}

# field NAME KEY: the number after KEY on the report line of output NAME
field() {
  awk -v n="$1" -v k="$2" '$1 == n && /max\|err\|/ {
      for (i = 1; i <= NF; i++) if ($i == k) { v = $(i + 1); sub(/[),]$/, "", v); print v; exit }
    }' "$out"
}

one=(--heads 2 --kv-heads 1 --head-dim 16 --granularity 1)
cat > "$work/diag.json" << 'EOF'
{"granularity": 1, "seq_len": 64,
 "heads": [{"diagonals": [0], "verticals": []}, {"diagonals": [0], "verticals": []}]}
EOF
for backend in cpu cpu-ref; do
  passes "N=1 $backend" "$bin" --seq-len 1 "${one[@]}" --backend "$backend" --check
  passes "G=1 diagonal 0 $backend" "$bin" --seq-len 64 --heads 2 --kv-heads 1 --head-dim 16 \
    --pattern "$work/diag.json" --backend "$backend" --check
done

# ---- a perturbation beyond the bound fails ---------------------------------------
"$bin" --seq-len 1 "${one[@]}" --check > "$out" 2>&1 || fail "N=1: $(cat "$out")"
b=$(field dq bound)
if [ -z "$b" ] || ! awk -v b="$b" 'BEGIN { exit !(b > 0) }'; then
  fail "N=1: dq bound '$b' is not positive"
fi
x=$(awk -v b="$b" 'BEGIN { printf "%.6e", 2 * b }')
rc=0
MTRAIN_RUN_FAULT=add-dq:$x "$bin" --seq-len 1 "${one[@]}" --check > "$out" 2>&1 || rc=$?
[ "$rc" = 3 ] || fail "dq perturbed by $x (2 bounds): exit status $rc, expected 3: $(cat "$out")"
grep -q "dq .*<-- FAIL" "$out" || fail "dq perturbed by $x: dq not marked FAIL: $(cat "$out")"
echo "test_run_check_bound: dq perturbed by $x = 2 x bound $b: check FAIL, exit $rc"

# ---- ordinary inputs: the floor far below the relative term -----------------------
"$bin" --input normal --seq-len 1024 --heads 4 --kv-heads 2 --head-dim 64 --check > "$out" 2>&1 ||
  fail "N(0,1) inputs: $(cat "$out")"
for t in dq dk; do
  bound=$(field "$t" bound) ref=$(field "$t" "(max|ref|") floor=$(field "$t" floor)
  if [ -z "$floor" ]; then
    fail "N(0,1) $t: no floor in the report: $(cat "$out")"
    continue
  fi
  rel=$(awk -v r="$ref" 'BEGIN { printf "%.3e", 1e-4 * r }')
  echo "test_run_check_bound: N(0,1) d=64 $t: relative term 1e-4 * max|ref| = $rel, floor = $floor" \
    "(floor / relative = $(awk -v f="$floor" -v r="$rel" 'BEGIN { printf "%.2e", f / r }'))"
  awk -v f="$floor" -v r="$rel" -v b="$bound" 'BEGIN { exit !(f < r && b > 0.999 * r && b < 1.001 * r) }' ||
    fail "N(0,1) $t: the bound $bound is not the relative term $rel (floor $floor)"
done

# ---- the large-input case ----------------------------------------------------------
passes "q, k, v x 1e4" "$bin" --input normal --input-scale 1e4 --seq-len 1024 --heads 4 \
  --kv-heads 2 --head-dim 64 --backend cpu --dtype fp32 --check

if [ "$failures" != 0 ]; then
  echo "test_run_check_bound: $failures failure(s)" >&2
  exit 1
fi
echo "test_run_check_bound: all checks passed"
