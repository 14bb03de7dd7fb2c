# device_lib.sh: sourced (never run) by the GPU machine's scripts, scripts/device_*.sh: what they
# share, so that each script says only its own steps. It defines functions and two variables and
# runs nothing when sourced. What it provides:
#
#   DEV_DEPS, DEV_DEPS_LIB   where device_cuda.sh unpacks .device/debs (/tmp/deps) and its
#                            multiarch library folder
#   dev_unpack_debs ROOT     the .deb files of ROOT/.device/debs, when that folder exists, unpacked
#                            (dpkg -x) into DEV_DEPS, their pkg-config files pointed at the copy,
#                            and the compiler's, linker's, loader's and pkg-config's paths to it
#   dev_deps_ld_path         LD_LIBRARY_PATH: DEV_DEPS's two library folders first
#   dev_deps_openblas        PATH += /usr/local/cuda/bin; CMAKE_LIBRARY_PATH and LD_LIBRARY_PATH
#                            for the OpenBLAS unpacked from .device/debs (under openblas-pthread:
#                            no alternatives ran)
#   dev_no_nvls              NVLink multicast off (NCCL, torch's symmetric memory, NVSHMEM)
#   dev_mpi_root             OpenMPI's mpiexec allowed to run as root
#   dev_sanitizer            prints compute-sanitizer's path
#   dev_want STAGE           true when STAGE is one of the words of $stages
#   dev_step NAME CMD...     runs CMD; appends "==== NAME (time): CMD" and its output to $log,
#                            prints "== NAME: rc R (S s)" and the output's last 4 lines, adds
#                            "NAME: rc R, S s" to the array summary; returns CMD's status
#                            (the output passes through $OUT/.step)
#   dev_ensure_library DIR   when MTRAIN_LIBRARY is unset: builds build-cuda/libmtrain.so if it is
#                            missing (device_cuda.sh build under a 300 s timeout, log DIR/build.log)
#                            and exports MTRAIN_LIBRARY=build-cuda/libmtrain.so (from the
#                            repository root)
#   dev_run_limit NAME       the next run's time limit in `to`: RUN_S, cut to what is left until
#                            t_end (seconds since the epoch); 1, saying so, when less than MIN_S
#                            is left (CALL_S: the call's budget, named in the message)
#   dev_call_start NAME CALL MIN  a call of limited steps begins (device_peers.sh,
#                            device_kernel_ab.sh): OUT (default ROOT/build-cuda/device-out, ROOT
#                            the caller's $root) created and exported, out=$OUT, log=$OUT/NAME.log
#                            emptied, CALL_S (default CALL seconds), MIN_S=MIN, t_end, summary=()
#   dev_limited_step NAME LIMIT CMD...  dev_step of CMD under `timeout -k 10`, its limit LIMIT
#                            seconds cut to what is left of CALL_S (dev_run_limit); "NAME: not
#                            started" in summary and status 1 when less than MIN_S is left
#   dev_timed_run NAME CMD...  removes $out/NAME.json, runs CMD under `timeout -k 10 $to` with its
#                            output in $out/NAME.log; 0 ("NAME: done in S s") when CMD wrote
#                            $out/NAME.json, else 1 with failed=1 and CMD's status in run_rc (the
#                            caller says why)
#
# The scripts source it first: . "$(dirname "$0")/device_lib.sh"
# shellcheck shell=bash disable=SC2034,SC2154 # the callers' variables: out, log, stages, t_end, to, ...

DEV_DEPS=/tmp/deps
DEV_DEPS_LIB=$DEV_DEPS/usr/lib/x86_64-linux-gnu

dev_unpack_debs() {
  [ -d "$1/.device/debs" ] || return 0
  local deps=$DEV_DEPS multi=$DEV_DEPS_LIB deb
  mkdir -p "$deps"
  for deb in "$1"/.device/debs/*.deb; do
    [ -e "$deb" ] && dpkg -x "$deb" "$deps"
  done
  # their pkg-config files name the prefix /usr: point them at the copy
  find "$deps" -name '*.pc' -exec sed -i -e 's|=/usr|='"$deps"'/usr|g' \
    -e 's|-I/usr|-I'"$deps"'/usr|g' -e 's|-L/usr|-L'"$deps"'/usr|g' {} +
  export PKG_CONFIG_PATH=$multi/pkgconfig:$deps/usr/lib/pkgconfig:$deps/usr/share/pkgconfig${PKG_CONFIG_PATH:+:$PKG_CONFIG_PATH}
  export CMAKE_PREFIX_PATH=$deps/usr${CMAKE_PREFIX_PATH:+:$CMAKE_PREFIX_PATH}
  dev_deps_ld_path
  export LIBRARY_PATH=$multi:$deps/usr/lib${LIBRARY_PATH:+:$LIBRARY_PATH}
  export CPATH=$deps/usr/include${CPATH:+:$CPATH}
  export PATH=$PATH:$deps/usr/bin
}

dev_deps_ld_path() {
  export LD_LIBRARY_PATH=$DEV_DEPS_LIB:$DEV_DEPS/usr/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
}

dev_deps_openblas() {
  export PATH=$PATH:/usr/local/cuda/bin
  export CMAKE_LIBRARY_PATH=$DEV_DEPS_LIB/openblas-pthread
  export LD_LIBRARY_PATH=$DEV_DEPS_LIB/openblas-pthread:$DEV_DEPS_LIB${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
}

dev_no_nvls() {
  export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
}

dev_mpi_root() {
  export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
}

dev_sanitizer() {
  command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer
}

dev_want() { [[ " $stages " == *" $1 "* ]]; }

dev_step() {
  local name=$1 t0=$SECONDS
  shift
  echo "==== $name ($(date +%H:%M:%S)): $*" >> "$log"
  "$@" > "$OUT/.step" 2>&1
  local rc=$?
  cat "$OUT/.step" >> "$log"
  summary+=("$name: rc $rc, $((SECONDS - t0)) s")
  echo "== $name: rc $rc ($((SECONDS - t0)) s)"
  tail -4 "$OUT/.step"
  rm -f "$OUT/.step"
  return $rc
}

dev_call_start() {
  OUT=${OUT:-$root/build-cuda/device-out}
  mkdir -p "$OUT"
  export OUT
  out=$OUT
  log=$OUT/$1.log
  : > "$log"
  CALL_S=${CALL_S:-$2}
  MIN_S=$3
  t_end=$(($(date +%s) + CALL_S))
  summary=()
}

dev_limited_step() {
  local name=$1
  RUN_S=$2
  shift 2
  dev_run_limit "$name" || { summary+=("$name: not started"); return 1; }
  dev_step "$name" timeout -k 10 "$to" "$@"
}

dev_ensure_library() {
  [ -z "${MTRAIN_LIBRARY:-}" ] || return 0
  if [ ! -f build-cuda/libmtrain.so ]; then
    echo "no MTRAIN_LIBRARY and no build-cuda/libmtrain.so: building" \
      "(scripts/device_cuda.sh build, log $1/build.log)"
    local t0=$SECONDS
    timeout 300 bash scripts/device_cuda.sh build >"$1/build.log" 2>&1 ||
      echo "build failed or timed out after $((SECONDS - t0)) s: $1/build.log"
    echo "build: $((SECONDS - t0)) s"
  fi
  export MTRAIN_LIBRARY=build-cuda/libmtrain.so
}

dev_run_limit() {
  local left=$((t_end - $(date +%s)))
  if [ "$left" -lt "$MIN_S" ]; then
    echo "$1: not started, $left s left of CALL_S=$CALL_S"
    return 1
  fi
  to=$((left < RUN_S ? left : RUN_S))
}

dev_timed_run() {
  local name=$1 t0=$SECONDS
  shift
  rm -f "$out/$name.json"
  # timeout signals the whole process group: torchrun and its ranks too
  timeout -k 10 "$to" "$@" >"$out/$name.log" 2>&1
  run_rc=$?
  if [ -f "$out/$name.json" ]; then
    echo "$name: done in $((SECONDS - t0)) s"
    return 0
  fi
  failed=1
  return 1
}
