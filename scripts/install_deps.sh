#!/usr/bin/env bash
# install_deps.sh: installs mtrain's build and test dependencies from
# Debian's packages (run as root, or with sudo available). Idempotent.
set -euo pipefail
packages=(build-essential cmake pkg-config libopenblas-dev libjansson-dev libcmocka-dev
          libopenmpi-dev openmpi-bin libpng-dev clang libomp-dev python3 python3-venv python3-pip)
missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -eq 0 ]; then
  echo "install_deps: all packages present"
  exit 0
fi
SUDO=""
[ "$(id -u)" -eq 0 ] || SUDO=sudo
echo "install_deps: installing ${missing[*]}"
$SUDO apt-get update -qq
DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${missing[@]}"
