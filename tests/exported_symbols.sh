#!/usr/bin/env bash
# exported_symbols.sh: proves that the installed libmtrain exports its public
# API and nothing else. Installs the build tree into a fresh prefix, lists the
# dynamic symbols the installed library defines (nm -D --defined-only) and
# the functions the installed headers declare, and fails when
#   - a function of an installed header lacks MTRAIN_API (it would be hidden);
#   - a declared function is not exported (those of mtrain_mpi.h and
#     mtrain_nccl.h only where the build has MPI or NCCL);
#   - an exported symbol is not declared in an installed header (internal
#     functions and the backend tables stay hidden), apart from the few the
#     toolchain adds, listed below;
#   - one of a few named internal functions is exported.
# usage: exported_symbols.sh BUILD_DIR WORK_DIR WITH_MPI WITH_NCCL
#        (WITH_*: ON/OFF, 1/0, as CMake gives them)
set -euo pipefail
build=$1 work=$2
on() { case "${1^^}" in ON | 1 | TRUE | YES) return 0 ;; *) return 1 ;; esac }
with_mpi=0 with_nccl=0
on "$3" && with_mpi=1
on "$4" && with_nccl=1

rm -rf "$work"
mkdir -p "$work"
cmake --install "$build" --prefix "$work/prefix" > "$work/install.log"
lib=$(find "$work/prefix" -name libmtrain.so -path '*/lib*/*' | head -n 1)
if [ -z "$lib" ]; then
  echo "exported symbols: no installed libmtrain.so under $work/prefix (static build?)" >&2
  exit 1
fi
headers="$work/prefix/include/mtrain"

# What the toolchain adds to every shared library (the linker's section
# markers and the init/fini entry points). Nothing else may lack the prefix.
toolchain='^(_init|_fini|__bss_start|_edata|_end|__end__|__bss_start__|__bss_end__|_bss_end__)$'
# Internal functions that must never be exported (white-box tests reach
# them through the static mtrain_internal instead).
internal='^(mtrain_plan_build_step_head|mtrain_plan_build_step_head_runs|mtrain_layout_from_owner|mtrain_cost_evaluate_owner|mtrain_select_[a-z_0-9]*|mtrain_token_to_block_diagonals|mtrain_cpu_backend|mtrain_cpu_ref_backend|mtrain_cuda_backend|mtrain_be_[a-z_0-9]*|mtrain_cm_[a-z_0-9]*|mtrain_memory_tracker_add|mtrain_config_validate|mtrain_now|mtrain_ring_run)$'

nm -D --defined-only "$lib" | awk 'NF >= 3 {print $3}' | sed 's/@.*//' | sort -u > "$work/exported.txt"

# The functions of the installed headers: comments and preprocessor lines
# (with their continuations) removed, the rest cut at ';', '{' and '}'; a
# piece whose first '(' follows an identifier directly is a declaration (a
# function-pointer member reads "type (*name)(", an inline function is
# static, a macro call has no type before it). Output: header name
# has_MTRAIN_API.
for h in "$headers"/*.h; do
  awk -v header="$(basename "$h")" '
    BEGIN { text = "" }
    {
      line = $0
      if (cont) { cont = (line ~ /\\$/); next }
      if (line ~ /^[ \t]*#/) { cont = (line ~ /\\$/); next }
      if (line !~ /\*/) sub(/\/\/.*/, "", line)
      text = text " " line
    }
    END {
      # comments
      while ((s = index(text, "/*")) > 0) {
        rest = substr(text, s + 2)
        e = index(rest, "*/")
        text = substr(text, 1, s - 1) " " (e ? substr(rest, e + 2) : "")
      }
      n = split(text, piece, /[;{}]/)
      for (i = 1; i <= n; i++) {
        p = piece[i]
        if (p ~ /(^|[^a-zA-Z_0-9])(static|typedef)[^a-zA-Z_0-9]/) continue
        if (!match(p, /[a-zA-Z_][a-zA-Z_0-9]*\(/)) continue
        if (index(p, "(") < RSTART) continue
        # a declaration has a return type before the name (a macro call has not)
        if (substr(p, 1, RSTART - 1) !~ /[a-zA-Z_]/) continue
        name = substr(p, RSTART, RLENGTH - 1)
        print header, name, (p ~ /(^|[^a-zA-Z_0-9])MTRAIN_API[^a-zA-Z_0-9]/) ? 1 : 0
      }
    }' "$h"
done | sort -k2,2 -u > "$work/declared.txt"

fail=0
if [ ! -s "$work/declared.txt" ]; then
  echo "exported symbols: found no function declarations in $headers" >&2
  exit 1
fi
while read -r header name api; do
  if [ "$api" != 1 ]; then
    echo "FAIL: $header declares $name without MTRAIN_API (hidden in libmtrain.so)" >&2
    fail=1
  fi
  required=1
  case "$header" in
  mtrain_mpi.h) required=$with_mpi ;;
  mtrain_nccl.h)
    required=$with_nccl
    [ "$name" = mtrain_comm_create_nccl_mpi ] && required=$((with_nccl && with_mpi))
    ;;
  esac
  if [ "$required" = 1 ] && ! grep -qx "$name" "$work/exported.txt"; then
    echo "FAIL: $name ($header) is not exported by $lib" >&2
    fail=1
  fi
done < "$work/declared.txt"

awk '{print $2}' "$work/declared.txt" > "$work/declared_names.txt"
while read -r sym; do
  if [[ "$sym" =~ $toolchain ]]; then continue; fi
  if [[ "$sym" =~ $internal ]]; then
    echo "FAIL: internal symbol $sym is exported" >&2
    fail=1
  elif [[ "$sym" != mtrain_* ]]; then
    echo "FAIL: exported symbol $sym does not start with mtrain_" >&2
    fail=1
  elif ! grep -qx "$sym" "$work/declared_names.txt"; then
    echo "FAIL: exported symbol $sym is declared in no installed header" >&2
    fail=1
  fi
done < "$work/exported.txt"

if [ "$fail" != 0 ]; then
  echo "exported symbols: FAILED ($(wc -l < "$work/exported.txt") exported, $(wc -l < "$work/declared.txt") declared; lists in $work)" >&2
  exit 1
fi
echo "exported symbols: $(wc -l < "$work/exported.txt") exported, all public mtrain_* API of the $(wc -l < "$work/declared.txt") declared functions"
