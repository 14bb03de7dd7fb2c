#!/usr/bin/env bash
# test_tool_help.sh: every built tool's --help exits 0, prints its usage on
# stdout, names every long option the tool accepts, and names no option it
# does not accept. The accepted options are read from the tool's source:
# its getopt_long table ({"name", ..._argument, ...}), and for mtrain-bench
# also the options its own parser matches (option_value(..., "--name", ...))
# and mtrain-run's table, which it passes on. An option missing from the
# help fails the test, naming the tool and the option.
# usage: test_tool_help.sh TOOLS_SOURCE_DIR TOOL_BINARY...
set -euo pipefail
src=$1
shift
failures=0
fail() {
  echo "test_tool_help: FAIL: $*" >&2
  failures=$((failures + 1))
}

# The sources that hold a tool's option tables.
sources_of() {
  case $1 in
  mtrain-run) echo "$src/run_options.c" ;;
  mtrain-bench) echo "$src/mtrain_bench.c $src/run_options.c" ;;
  mtrain-bench-cpu) echo "$src/mtrain_bench_cpu.c" ;;
  mtrain-bench-cuda) echo "$src/mtrain_bench_cuda.c" ;;
  mtrain-pattern) echo "$src/mtrain_pattern.c" ;;
  mtrain-balance) echo "$src/mtrain_balance.c" ;;
  mtrain-bench-plan) echo "$src/mtrain_bench_plan.c" ;;
  *) return 1 ;;
  esac
}

# The long options (without the dashes) the sources accept, one a line.
accepted_options() {
  # (a pattern a tool does not use matches nothing: grep's status 1 is no error)
  # shellcheck disable=SC2046 # the file list is words
  {
    grep -ohE '\{"[a-z0-9-]+", *(no|required|optional)_argument' $(sources_of "$1") || true
    grep -ohE 'option_value\([^"]*"--[a-z0-9-]+"' $(sources_of "$1") || true
    grep -ohE 'strcmp\(argv\[i\], "--[a-z0-9-]+"\)' $(sources_of "$1") || true
  } | sed -E 's/^[^"]*"(--)?([a-z0-9-]+)".*/\2/' | sort -u
}

export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
for bin in "$@"; do
  tool=$(basename "$bin")
  if ! sources_of "$tool" > /dev/null; then
    fail "$tool: unknown tool (add its sources to sources_of in $0)"
    continue
  fi
  before=$failures
  rc=0
  "$bin" --help > "$work/help.txt" 2> "$work/err.txt" || rc=$?
  if [ "$rc" != 0 ]; then
    fail "$tool --help exited $rc (expected 0); stderr: $(cat "$work/err.txt")"
    continue
  fi
  grep -q "^usage: " "$work/help.txt" || fail "$tool --help: no 'usage: ' line on stdout"
  accepted_options "$tool" > "$work/accepted.txt"
  n=$(wc -l < "$work/accepted.txt")
  [ "$n" -ge 2 ] || fail "$tool: found only $n options in $(sources_of "$tool") (table not parsed?)"
  missing=""
  while read -r opt; do
    grep -qE -- "--$opt([^a-z0-9-]|\$)" "$work/help.txt" || missing="$missing --$opt"
  done < "$work/accepted.txt"
  [ -z "$missing" ] || fail "$tool --help does not describe these options it accepts:$missing"
  # the other way: every option the help names is accepted
  unknown=""
  while read -r opt; do
    grep -qx -- "$opt" "$work/accepted.txt" || unknown="$unknown --$opt"
  done < <(grep -oE -- "--[a-z][a-z0-9-]*" "$work/help.txt" | sed 's/^--//' | sort -u)
  [ -z "$unknown" ] || fail "$tool --help names options it does not accept:$unknown"
  [ "$failures" != "$before" ] ||
    echo "test_tool_help: $tool: --help exits 0 and describes all $n options"
done
if [ "$failures" != 0 ]; then
  echo "test_tool_help: $failures failure(s)" >&2
  exit 1
fi
echo "test_tool_help: all checks passed ($# tools)"
