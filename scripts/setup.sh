#!/usr/bin/env bash
# Installs every Debian 12 package cai's build and tests need, selects the OpenMP OpenBLAS for
# LibTorch (the reference BLAS makes a GPT step >10x slower), and is safe to run again. With
# --bench also what the benchmarks need (python3-torch, gnuplot-nox). Needs root (or sudo).
# usage: scripts/setup.sh [--bench]
set -euo pipefail

packages=(
  build-essential cmake ninja-build ccache pkg-config
  libtorch-dev libgloo-dev libtomlplusplus-dev libspdlog-dev libboost-dev libgtest-dev
  libopenblas0-openmp
  abigail-tools           # abidiff gate of the ABI
  binutils file           # readelf/nm checks of plugins
  rpm lintian dpkg-dev fakeroot  # deb/rpm packaging and its test
  clang-format            # the style test
  clang libclang-rt-14-dev  # libFuzzer targets (scripts/fuzz.sh)
)
if [[ ${1:-} == --bench ]]; then
  packages+=(python3-torch gnuplot-nox)  # bench/peers: PyTorch 1.13 on Gloo; bench/run.py's plot
elif [[ $# -gt 0 ]]; then
  echo "usage: scripts/setup.sh [--bench]" >&2
  exit 2
fi

sudo=()
[[ $(id -u) -eq 0 ]] || sudo=(sudo)
missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if ((${#missing[@]})); then
  echo "setup: installing ${missing[*]}"
  "${sudo[@]}" apt-get update -qq
  DEBIAN_FRONTEND=noninteractive "${sudo[@]}" apt-get install -y -qq --no-install-recommends \
    "${missing[@]}" >/dev/null
fi

blas=/usr/lib/x86_64-linux-gnu/openblas-openmp/libblas.so.3
"${sudo[@]}" update-alternatives --set libblas.so.3-x86_64-linux-gnu "$blas" >/dev/null
"${sudo[@]}" update-alternatives --set liblapack.so.3-x86_64-linux-gnu \
  /usr/lib/x86_64-linux-gnu/openblas-openmp/liblapack.so.3 >/dev/null 2>&1 || true
echo "setup: BLAS for LibTorch is $(readlink -f /etc/alternatives/libblas.so.3-x86_64-linux-gnu)"
