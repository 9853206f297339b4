#!/usr/bin/env bash
# Configures and builds cai into ${CAI_BUILD_DIR:-build} (ninja, ccache, RelWithDebInfo).
set -euo pipefail
cd "$(dirname "$0")/.."
build=${CAI_BUILD_DIR:-build}
source scripts/ccache-env.sh "$PWD"
if [[ ! -f $build/build.ninja ]]; then
  cmake -S . -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo "$@"
fi
# Each LibTorch translation unit takes ~1.5 GiB to compile: cap parallelism by memory too.
jobs=$(( $(nproc) < 8 ? $(nproc) : 8 ))
cmake --build "$build" -j "$jobs"
