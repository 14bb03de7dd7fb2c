#!/usr/bin/env bash
# install_test.sh: proves the install: installs the build tree into a fresh
# prefix, builds examples/install_check against it with find_package(mtrain)
# and with pkg-config, and runs both programs.
# usage: install_test.sh BUILD_DIR SOURCE_DIR WORK_DIR
set -euo pipefail
build=$1 src=$2 work=$3
rm -rf "$work"
mkdir -p "$work"
cmake --install "$build" --prefix "$work/prefix" > "$work/install.log"
test -f "$work/prefix/include/mtrain/mtrain.h"
libdir=$(ls -d "$work"/prefix/lib*/ | head -n 1)
cmake -S "$src/examples/install_check" -B "$work/example" -DCMAKE_PREFIX_PATH="$work/prefix" > "$work/configure.log"
cmake --build "$work/example" > "$work/build.log"
LD_LIBRARY_PATH="$libdir" "$work/example/mtrain_example"
export PKG_CONFIG_PATH="$libdir/pkgconfig"
cc -std=c11 "$src/examples/install_check/example.c" -o "$work/example_pc" $(pkg-config --cflags --libs mtrain) -lm
LD_LIBRARY_PATH="$libdir" "$work/example_pc"
echo "install test: find_package and pkg-config builds both ran"
