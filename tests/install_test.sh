#!/usr/bin/env bash
# install_test.sh: proves the install: installs the build tree into a fresh
# prefix, then WITHOUT LD_LIBRARY_PATH (the installed files must find their
# library themselves, through their RPATH): runs every installed tool's
# --help; builds examples/install_check against the prefix with
# find_package(mtrain) and with `pkg-config --cflags --libs mtrain`, and
# runs both programs; in builds with MPI, builds example_mpi.c (mtrain_mpi.h)
# with `pkg-config --cflags --libs mtrain-mpi` and with find_package, and
# runs it (under MPIEXEC on 2 ranks when given, else on one).
# usage: install_test.sh BUILD_DIR SOURCE_DIR WORK_DIR [MPIEXEC]
set -euo pipefail
build=$1 src=$2 work=$3 mpiexec=${4:-}
fail() {
  echo "install test: FAIL: $*" >&2
  exit 1
}
unset LD_LIBRARY_PATH
rm -rf "$work"
mkdir -p "$work"
prefix=$work/prefix
cmake --install "$build" --prefix "$prefix" > "$work/install.log"
test -f "$prefix/include/mtrain/mtrain.h" || fail "no include/mtrain/mtrain.h under $prefix"
libdir=$(find "$prefix" -mindepth 1 -maxdepth 1 -name "lib*" -type d | sort | head -n 1)
with_mpi=0
grep -q '^MTRAIN_WITH_MPI:BOOL=ON' "$build/CMakeCache.txt" && with_mpi=1

# 1. the installed tools run as installed
tools=0
for tool in "$prefix"/bin/mtrain-*; do
  [ -x "$tool" ] || continue
  tools=$((tools + 1))
  rc=0
  "$tool" --help > "$work/help.txt" 2> "$work/help.err" || rc=$?
  [ "$rc" = 0 ] || fail "installed $(basename "$tool") --help exited $rc: $(cat "$work/help.err")"
  grep -q "usage" "$work/help.txt" || fail "installed $(basename "$tool") --help printed no usage"
done
[ -x "$prefix/bin/mtrain-run" ] || fail "mtrain-run is not installed in $prefix/bin"
echo "install test: $tools installed tools ran --help without LD_LIBRARY_PATH"

# 2. find_package(mtrain)
cmake -S "$src/examples/install_check" -B "$work/example" -DCMAKE_PREFIX_PATH="$prefix" \
  > "$work/configure.log"
cmake --build "$work/example" > "$work/build.log"
"$work/example/mtrain_example"

# 3. pkg-config mtrain: the flags carry the RPATH
export PKG_CONFIG_PATH="$libdir/pkgconfig"
pkg-config --libs mtrain | grep -q -- "-Wl,-rpath," || fail "pkg-config --libs mtrain has no rpath"
# shellcheck disable=SC2046 # the flags are words
cc -std=c11 "$src/examples/install_check/example.c" -o "$work/example_pc" \
  $(pkg-config --cflags --libs mtrain) -lm
"$work/example_pc"

# 4. with MPI: mtrain_mpi.h through mtrain-mpi.pc and through find_package
run_mpi() { # program
  if [ -n "$mpiexec" ]; then
    OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 \
      "$mpiexec" -n 2 --oversubscribe --bind-to none "$1"
  else
    "$1"
  fi
}
if [ "$with_mpi" = 1 ]; then
  [ -f "$libdir/pkgconfig/mtrain-mpi.pc" ] || fail "a build with MPI installed no mtrain-mpi.pc"
  # shellcheck disable=SC2046
  cc -std=c11 "$src/examples/install_check/example_mpi.c" -o "$work/example_mpi_pc" \
    $(pkg-config --cflags --libs mtrain-mpi)
  run_mpi "$work/example_mpi_pc" | tee "$work/mpi.txt"
  grep -q "a cpu context over the MPI communicator" "$work/mpi.txt" || fail "example_mpi printed nothing"
  [ -x "$work/example/mtrain_example_mpi" ] || fail "find_package built no mtrain_example_mpi"
  run_mpi "$work/example/mtrain_example_mpi"
  echo "install test: find_package and pkg-config builds (mtrain, mtrain-mpi) all ran"
else
  echo "install test: find_package and pkg-config builds both ran (no MPI in this build)"
fi
