#!/bin/sh
# Installs the Debian packages dparallel builds and tests with, when missing.
# Runs as root (or through sudo). The CUDA Toolkit and NCCL are not Debian
# packages here: when /usr/local/cuda has them, the build uses them.
set -eu

packages="build-essential cmake pkg-config ccache python3 python3-venv python3-pip \
  googletest libgtest-dev libgmock-dev libbenchmark-dev \
  libdlpack-dev libgloo-dev nlohmann-json3-dev libopenblas-dev \
  clang libclang-rt-14-dev clang-format-14 clang-tidy-14 abigail-tools git iproute2 \
  swig mono-mcs mono-runtime nuget openjdk-17-jdk-headless golang-go valgrind \
  openmpi-bin libopenmpi3 mpich libmpich12"

missing=""
for p in $packages; do
  if ! dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed"; then
    missing="$missing $p"
  fi
done
[ -z "$missing" ] && exit 0

echo "installing:$missing"
if [ "$(id -u)" -eq 0 ]; then
  SUDO=""
elif command -v sudo >/dev/null 2>&1; then
  SUDO="sudo"
else
  echo "error: missing packages:$missing; run this script as root" >&2
  exit 1
fi
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update -qq
# shellcheck disable=SC2086
$SUDO apt-get install -y -qq --no-install-recommends $missing
