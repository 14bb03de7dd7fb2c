#!/usr/bin/env bash
# test_run_options.sh: mtrain-run's command line where a new user met
# surprises.
#  - granularity: a --pattern file's granularity is taken when --granularity
#    is not given; given and equal it runs; given and different it fails
#    naming both values.
#  - --schedule hier: refused on one rank; --ranks-per-node without it is
#    refused; under mpiexec (MPI builds) all ranks on one node without
#    --ranks-per-node is refused (never silently the flat ring), a
#    --ranks-per-node equal to or not dividing W is refused, and a valid one
#    runs the hierarchical ring and says where its topology came from.
#  - the correctness bound: --check's bound over max|ref| is 1e-4 for fp32,
#    4 * 2^-8 for bf16 and 4 * 2^-11 for fp16, and the tools' sources define
#    the unit roundoffs only in tool_common.h.
# usage: test_run_options.sh MTRAIN_RUN TMPDIR TOOLS_SOURCE_DIR [MPIEXEC]
set -euo pipefail
bin=$1 work=$2/run_options src=$3 mpiexec=${4:-}
rm -rf "$work"
mkdir -p "$work"
export OMP_NUM_THREADS=1 OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
fail() {
  echo "test_run_options: FAIL: $*" >&2
  exit 1
}
shape=(--seq-len 512 --heads 2 --kv-heads 1 --head-dim 16)

# expect CODE NEEDLE cmd...: exit status CODE and NEEDLE on stderr
expect() {
  local want=$1 needle=$2 rc=0
  shift 2
  "$@" > "$work/out.txt" 2> "$work/err.txt" || rc=$?
  [ "$rc" = "$want" ] || fail "'$*' exited $rc, expected $want; stderr: $(cat "$work/err.txt")"
  grep -qF -- "$needle" "$work/err.txt" ||
    fail "'$*': stderr lacks '$needle': $(cat "$work/err.txt")"
}

# ---- granularity from the pattern file -------------------------------------
cat > "$work/g64.json" << 'EOF'
{"granularity": 64, "seq_len": 512,
 "heads": [{"diagonals": [0, 1], "verticals": [0, 1, 100]}, {"diagonals": [0, 3], "verticals": [5]}]}
EOF
"$bin" "${shape[@]}" --pattern "$work/g64.json" --check > "$work/out.txt" ||
  fail "--pattern of granularity 64 without --granularity failed: $(cat "$work/out.txt")"
grep -q "G=64" "$work/out.txt" || fail "the run did not take G=64 from the file: $(cat "$work/out.txt")"
grep -q "PASS" "$work/out.txt" || fail "the G=64 run did not pass its check"
"$bin" "${shape[@]}" --pattern "$work/g64.json" --granularity 64 > /dev/null ||
  fail "--granularity 64 with a pattern of granularity 64 failed"
expect 1 "--granularity 128 disagrees with the granularity 64" \
  "$bin" "${shape[@]}" --pattern "$work/g64.json" --granularity 128
expect 1 "missing.json" "$bin" "${shape[@]}" --pattern "$work/missing.json"

# ---- the hierarchical schedule -----------------------------------------------
expect 2 "--schedule hier needs several ranks" "$bin" "${shape[@]}" --schedule hier
expect 2 "--ranks-per-node 2 needs --schedule hier" "$bin" "${shape[@]}" --ranks-per-node 2
if [ -n "$mpiexec" ]; then
  mpi=("$mpiexec" --oversubscribe --bind-to none)
  rc=0
  "${mpi[@]}" -n 2 "$bin" "${shape[@]}" --schedule hier > "$work/out.txt" 2> "$work/err.txt" || rc=$?
  [ "$rc" != 0 ] || fail "--schedule hier on 2 ranks of one node ran: $(cat "$work/out.txt")"
  grep -q "all 2 ranks share one node" "$work/err.txt" ||
    fail "one node, no --ranks-per-node: no clear message: $(cat "$work/err.txt")"
  grep -q "hierarchical\|topology" "$work/out.txt" && fail "a report was printed after the refusal"
  for n in 4 3; do
    rc=0
    "${mpi[@]}" -n 4 "$bin" "${shape[@]}" --schedule hier --ranks-per-node $n \
      > "$work/out.txt" 2> "$work/err.txt" || rc=$?
    [ "$rc" != 0 ] || fail "--ranks-per-node $n on 4 ranks ran"
    grep -q -- "--ranks-per-node $n" "$work/err.txt" ||
      fail "--ranks-per-node $n on 4 ranks: no clear message: $(cat "$work/err.txt")"
  done
  "${mpi[@]}" -n 4 "$bin" "${shape[@]}" --schedule hier --ranks-per-node 2 > "$work/out.txt" ||
    fail "--schedule hier --ranks-per-node 2 on 4 ranks failed"
  grep -q "hierarchical ring" "$work/out.txt" || fail "not the hierarchical ring: $(cat "$work/out.txt")"
  grep -q "topology   2 nodes x 2 ranks (--ranks-per-node)" "$work/out.txt" ||
    fail "the report does not say where the topology came from: $(cat "$work/out.txt")"
  "${mpi[@]}" -n 4 "$bin" "${shape[@]}" --schedule hier --ranks-per-node 2 --json \
    > "$work/out.txt" || fail "the same with --json failed"
  grep -q '"ranks_per_node_source": "option"' "$work/out.txt" ||
    fail "no ranks_per_node_source in the JSON: $(cat "$work/out.txt")"
fi

# ---- the correctness bound ------------------------------------------------------
# check_bound DTYPE REL: every output's bound / max|ref| is REL (to the printed digits)
check_bound() {
  "$bin" "${shape[@]}" --pattern "$work/g64.json" --dtype "$1" --check > "$work/out.txt" ||
    fail "--dtype $1 --check failed: $(cat "$work/out.txt")"
  local lines
  lines=$(grep -c "max|err|.*bound" "$work/out.txt")
  [ "$lines" = 5 ] || fail "--dtype $1: $lines error lines, expected 5: $(cat "$work/out.txt")"
  awk -v rel="$2" -v dt="$1" '/max\|err\|.*bound/ {
      for (i = 1; i <= NF; i++) {
        if ($i == "bound") b = $(i + 1)
        if ($i == "(max|ref|") r = $(i + 1)
      }
      sub(/\)/, "", r)
      q = b / r
      if (q < rel * 0.999 || q > rel * 1.001) {
        printf "--dtype %s: %s bound %s / max|ref| %s = %g, expected %g\n", dt, $1, b, r, q, rel
        bad = 1
      }
    }
    END { exit bad }' "$work/out.txt" || fail "--dtype $1: wrong bound"
}
check_bound fp32 1e-4
check_bound bf16 0.015625
check_bound fp16 0.001953125
# one definition: the unit roundoffs appear in the tools' C sources only in tool_common.h
copies=$(grep -lE '0x1p-(8|11)\b' "$src"/*.c "$src"/*.h | grep -v '/tool_common\.h$' || true)
[ -z "$copies" ] || fail "the tolerance is defined again in: $copies (use tool_check_tolerance)"
echo "test_run_options: all checks passed"
