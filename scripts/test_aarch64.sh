#!/usr/bin/env bash
# scripts/test_aarch64.sh: cross-compiles the library, its tools and the CPU
# test suite for aarch64 (Linux, glibc) and runs the tests under qemu-user,
# to show that the portable build (MTRAIN_NATIVE OFF) builds and computes on
# another architecture.
#
#   bash scripts/test_aarch64.sh            # build in build-aarch64/, run the tests
#   bash scripts/test_aarch64.sh --install  # first apt-get install the cross
#                                           # compiler and qemu-user (root)
#
# Without qemu-aarch64 the script prints "skipped: qemu-aarch64 not present"
# and exits 0. It needs aarch64-linux-gnu-gcc (Debian: gcc-aarch64-linux-gnu)
# and fetches the arm64 libraries the build links (OpenBLAS, jansson, CMocka,
# libpng, zlib: Debian's arm64 packages) with apt-get download into
# build-aarch64/sysroot, through a private package list: the machine's apt
# and dpkg configuration are not changed (no dpkg --add-architecture).
#
# Left out: MPI, CUDA and NCCL (off in this build); the tests that ctest does
# not start through the emulator (the shell-script tests: install, exported
# symbols, the tools' scripts) or that start an aarch64 tool themselves
# (test_balance_tool), since this machine has no binfmt_misc to run aarch64
# programs directly; test_cuda_emu (x86-64 and CUDA only). Needs python3 (to
# read ctest's test list). Under emulation test_cross_backend runs its
# quick set (MTRAIN_TEST_QUICK=1) and test_memory's leak loop 20 iterations
# instead of 100 (MTRAIN_TEST_LEAK_ITERATIONS, as under the sanitizers).
# Exit status: 0 when every test that ran passed (or qemu is absent), 1 else.
set -euo pipefail
cd "$(dirname "$0")/.."
root=$PWD
build=$root/build-aarch64
sysroot=$build/sysroot
start=$(date +%s)

if [ "${1:-}" = --install ]; then
  apt-get update
  DEBIAN_FRONTEND=noninteractive apt-get install -y --no-remove gcc-aarch64-linux-gnu qemu-user \
    cmake pkg-config
fi

qemu=$(command -v qemu-aarch64 || command -v qemu-aarch64-static || true)
if [ -z "$qemu" ]; then
  echo "skipped: qemu-aarch64 not present (apt-get install qemu-user, or run with --install)"
  exit 0
fi
cc=$(command -v aarch64-linux-gnu-gcc || true)
if [ -z "$cc" ]; then
  echo "FAIL: aarch64-linux-gnu-gcc not found (apt-get install gcc-aarch64-linux-gnu, or run" \
    "with --install)"
  exit 1
fi
guest_libc=/usr/aarch64-linux-gnu

# ---- the arm64 libraries, in a private sysroot ----------------------------
pkgs=(libopenblas-dev libopenblas-pthread-dev libopenblas0-pthread libopenblas0 libgfortran5
  libjansson4 libjansson-dev libcmocka0 libcmocka-dev libpng16-16 libpng-dev zlib1g zlib1g-dev)
if [ ! -f "$sysroot/.complete" ]; then
  echo "== fetching the arm64 libraries into $sysroot"
  rm -rf "$sysroot" "$build/debs" "$build/apt-lists"
  mkdir -p "$sysroot" "$build/debs" "$build/apt-lists/partial"
  apt_opts=(-oAPT::Architecture=arm64 -oAPT::Architectures=arm64
    "-oDir::State::Lists=$build/apt-lists" -oDir::Cache::pkgcache= -oDir::Cache::srcpkgcache=
    -oAPT::Sandbox::User=root)
  apt-get "${apt_opts[@]}" update > "$build/apt-update.log" 2>&1 ||
    { echo "FAIL: apt-get update for arm64 (log: $build/apt-update.log)"; exit 1; }
  (cd "$build/debs" && apt-get "${apt_opts[@]}" download "${pkgs[@]}") > "$build/apt-download.log" \
    2>&1 || { echo "FAIL: apt-get download of the arm64 libraries (log: $build/apt-download.log)"; exit 1; }
  for deb in "$build"/debs/*.deb; do dpkg -x "$deb" "$sysroot"; done
  # absolute symbolic links (libz.so -> /lib/...) point into the sysroot
  while IFS= read -r link; do
    target=$(readlink "$link")
    case $target in /*) ln -sfn "$sysroot$target" "$link" ;; esac
  done < <(find "$sysroot" -type l)
  touch "$sysroot/.complete"
fi
libdirs="$sysroot/usr/lib/aarch64-linux-gnu/openblas-pthread:$sysroot/usr/lib/aarch64-linux-gnu"
libdirs="$libdirs:$sysroot/lib/aarch64-linux-gnu"

# ---- the toolchain and the emulator ------------------------------------------
mkdir -p "$build"
cat > "$build/emulator.sh" << EOF
#!/usr/bin/env bash
# runs an aarch64 program under qemu-user with the sysroot's libraries
exec "$qemu" -L "$guest_libc" -E LD_LIBRARY_PATH="$libdirs" "\$@"
EOF
chmod +x "$build/emulator.sh"
cat > "$build/toolchain.cmake" << EOF
set(CMAKE_SYSTEM_NAME Linux)
set(CMAKE_SYSTEM_PROCESSOR aarch64)
set(CMAKE_C_COMPILER $cc)
set(CMAKE_FIND_ROOT_PATH $guest_libc $sysroot)
set(CMAKE_FIND_ROOT_PATH_MODE_PROGRAM NEVER)
set(CMAKE_FIND_ROOT_PATH_MODE_LIBRARY ONLY)
set(CMAKE_FIND_ROOT_PATH_MODE_INCLUDE ONLY)
set(CMAKE_FIND_ROOT_PATH_MODE_PACKAGE ONLY)
set(CMAKE_CROSSCOMPILING_EMULATOR $build/emulator.sh)
set(ENV{PKG_CONFIG_LIBDIR} $sysroot/usr/lib/aarch64-linux-gnu/pkgconfig)
set(ENV{PKG_CONFIG_SYSROOT_DIR} $sysroot)
set(CMAKE_EXE_LINKER_FLAGS_INIT "-Wl,-rpath-link,$libdirs")
set(CMAKE_SHARED_LINKER_FLAGS_INIT "-Wl,-rpath-link,$libdirs")
EOF

echo "== configuring and building (aarch64, portable, MPI/CUDA/NCCL off)"
cmake -S "$root" -B "$build/cmake" -DCMAKE_TOOLCHAIN_FILE="$build/toolchain.cmake" \
  -DCMAKE_BUILD_TYPE=Release -DMTRAIN_NATIVE=OFF -DMTRAIN_WITH_MPI=OFF -DMTRAIN_WITH_CUDA=OFF \
  -DMTRAIN_WITH_NCCL=OFF \
  -DCBLAS_INCLUDE_DIR="$sysroot/usr/include/aarch64-linux-gnu/openblas-pthread" \
  -DOPENBLAS_LIBRARY="$sysroot/usr/lib/aarch64-linux-gnu/openblas-pthread/libopenblas.so" \
  > "$build/configure.log" 2>&1 || { tail -30 "$build/configure.log"; echo "FAIL: configure"; exit 1; }
cmake --build "$build/cmake" -j"$(nproc)" > "$build/build.log" 2>&1 ||
  { grep -E "error|Error" "$build/build.log" | head -30; echo "FAIL: build"; exit 1; }
command -v file > /dev/null && file -L "$build/cmake/libmtrain.so" | head -n 1
built=$(date +%s)
echo "== built in $((built - start)) s; running the tests under $qemu"

# the tests ctest starts through the emulator, less those that start a tool
# themselves (test_*_tool: popen of an aarch64 program); script tests start
# programs directly and are left out (see the top of this file)
tests=$(cd "$build/cmake" && ctest --show-only=json-v1 | python3 -c '
import json, sys
emulator, skip = sys.argv[1], ("test_balance_tool", "test_bench_tool")
names = [t["name"] for t in json.load(sys.stdin)["tests"]
         if t.get("command", [""])[0] == emulator and t["name"] not in skip]
print("^(" + "|".join(names) + ")$")' "$build/emulator.sh")
set +e
(cd "$build/cmake" && MTRAIN_TEST_QUICK=1 MTRAIN_TEST_LEAK_ITERATIONS=20 ctest --output-on-failure \
  -R "$tests" --timeout 1800)
rc=$?
set -e
end=$(date +%s)
echo "== aarch64: ctest exit status $rc; build $((built - start)) s, tests $((end - built)) s"
[ "$rc" -eq 0 ] && echo "PASS: the aarch64 build passes its CPU tests under qemu" ||
  echo "FAIL: see the test output above"
exit $((rc != 0))
