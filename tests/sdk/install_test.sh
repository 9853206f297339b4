#!/usr/bin/env bash
# The SDK as a third party uses it: install cai's development files into a throwaway prefix,
# build sdk/examples/hello_strategy out of tree with find_package(cai) and with pkg-config,
# check each .so links and exports only what a plugin may, run the conformance suite on it (the
# first build through the behaviour checks too, which train with the installed `cai` beside
# cai-conformance), and see the installed `cai` list it from a plugin directory.
# usage: install_test.sh BUILD_DIR SOURCE_DIR
set -euo pipefail
build=$1
src=$2
work=$(mktemp -d /tmp/cai-sdk-test-XXXXXX)
trap 'rm -rf "$work"' EXIT
prefix=$work/prefix
fail() { echo "FAIL: $*" >&2; exit 1; }

cmake --install "$build" --prefix "$prefix" --component dev >/dev/null
cmake --install "$build" --prefix "$prefix" --component runtime >/dev/null
libdir=$(cd "$prefix" && dirname "$(find . -name caiConfig.cmake -path '*cmake/cai/*' | head -1)" | sed 's|^\./||; s|/cmake/cai$||')

check_plugin() {  # .so manifest-dir label [cai-conformance option]
  local so=$1 dir=$2 label=$3 option=${4:-}
  local bad
  bad=$(readelf -d "$so" | grep NEEDED | grep -oE 'lib(torch|c10|gloo|nccl|cudart)[^]]*' || true)
  [[ -z $bad ]] || fail "$label: $so links $bad"
  local exports
  exports=$(nm -D --defined-only "$so" | awk '{print $3}' | grep -vE '^(_init|_fini|_edata|_end|__bss_start)$')
  [[ $exports == cai_plugin_init_v1 ]] || fail "$label: $so exports: $exports"
  "$prefix/bin/cai-conformance" ${option:+"$option"} "$dir/hello_strategy.toml" || fail "$label: conformance failed"
  local listing
  listing=$(CAI_PLUGIN_FILES= CAI_PLUGIN_PATH="$dir" HOME=/nonexistent "$prefix/bin/cai" plugins list) ||
    fail "$label: cai plugins list failed: $listing"
  grep -qE "^hello_strategy +0\.1\.0 +1\.0\+ +ok +$dir/hello_strategy\.toml$" <<<"$listing" ||
    fail "$label: not listed from $dir: $listing"
  echo "ok: $label"
}

# 1. CMake package: find_package(cai) + cai_add_plugin().
cmake -S "$src/sdk/examples/hello_strategy" -B "$work/cmake" -G Ninja \
  -DCMAKE_PREFIX_PATH="$prefix" -DCMAKE_BUILD_TYPE=Release >/dev/null
cmake --build "$work/cmake" >/dev/null
check_plugin "$work/cmake/plugins/libcai_hello_strategy.so" "$work/cmake/plugins" "find_package(cai)"

# 2. pkg-config only.
export PKG_CONFIG_PATH=$prefix/$libdir/pkgconfig
mkdir -p "$work/pc"
# shellcheck disable=SC2046
g++ -std=c++20 -O2 -Wall -Wextra -Werror $(pkg-config --cflags cai) \
  "$src/sdk/examples/hello_strategy/hello_strategy.cpp" -o "$work/pc/libcai_hello_strategy.so" \
  $(pkg-config --variable=plugin_ldflags cai)
cp "$src/sdk/examples/hello_strategy/hello_strategy.toml" "$work/pc/"
chmod 0755 "$work/pc"
check_plugin "$work/pc/libcai_hello_strategy.so" "$work/pc" "pkg-config cai" --structure-only
