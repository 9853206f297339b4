#!/usr/bin/env bash
# The SDK as a third party uses it: install cai's development files into a throwaway prefix,
# check they include the documents (docs/, DESIGN.md) and the example plugins' sources, build
# the installed examples out of tree with find_package(cai) and with pkg-config, check each .so
# links and exports only what a plugin may, run the conformance suite on it (the first build
# through the behaviour checks too, which train with the installed `cai` beside
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

# The documents and the examples as cai-dev installs them: the same files as the source tree.
doc=$prefix/share/doc/cai-dev
example=$doc/examples/hello_strategy
diff -r "$src/docs" "$doc/docs" || fail "installed docs/ differ from $src/docs"
cmp "$src/DESIGN.md" "$doc/DESIGN.md" || fail "installed DESIGN.md differs"
for name in hello_strategy local_sgd; do
  for f in CMakeLists.txt $name.cpp $name.toml; do
    cmp "$src/sdk/examples/$name/$f" "$doc/examples/$name/$f" ||
      fail "installed example's $name/$f differs"
  done
done
for f in abi-contract.md manifest.md checkpoint-layout.md writing-a-strategy.md README.md; do
  [[ -s $doc/docs/$f ]] || fail "cai-dev lacks docs/$f"
done
echo "ok: docs/, DESIGN.md and examples/{hello_strategy,local_sgd} installed under share/doc/cai-dev"

check_plugin() {  # .so manifest-dir label [cai-conformance option] [plugin name]
  local so=$1 dir=$2 label=$3 option=${4:-} name=${5:-hello_strategy}
  local bad
  bad=$(readelf -d "$so" | grep NEEDED | grep -oE 'lib(torch|c10|gloo|nccl|cudart)[^]]*' || true)
  [[ -z $bad ]] || fail "$label: $so links $bad"
  local exports
  exports=$(nm -D --defined-only "$so" | awk '{print $3}' | grep -vE '^(_init|_fini|_edata|_end|__bss_start)$')
  [[ $exports == cai_plugin_init_v1 ]] || fail "$label: $so exports: $exports"
  "$prefix/bin/cai-conformance" ${option:+"$option"} "$dir/$name.toml" || fail "$label: conformance failed"
  local listing
  listing=$(CAI_PLUGIN_FILES= CAI_PLUGIN_PATH="$dir" HOME=/nonexistent "$prefix/bin/cai" plugins list) ||
    fail "$label: cai plugins list failed: $listing"
  grep -qE "^$name +0\.1\.0 +1\.0\+ +ok +$dir/$name\.toml$" <<<"$listing" ||
    fail "$label: not listed from $dir: $listing"
  echo "ok: $label"
}

# 1. CMake package: find_package(cai) + cai_add_plugin().
cmake -S "$example" -B "$work/cmake" -G Ninja \
  -DCMAKE_PREFIX_PATH="$prefix" -DCMAKE_BUILD_TYPE=Release >/dev/null
cmake --build "$work/cmake" >/dev/null
check_plugin "$work/cmake/plugins/libcai_hello_strategy.so" "$work/cmake/plugins" "find_package(cai)"

# 2. pkg-config only.
export PKG_CONFIG_PATH=$prefix/$libdir/pkgconfig
mkdir -p "$work/pc"
# shellcheck disable=SC2046
g++ -std=c++20 -O2 -Wall -Wextra -Werror $(pkg-config --cflags cai) \
  "$example/hello_strategy.cpp" -o "$work/pc/libcai_hello_strategy.so" \
  $(pkg-config --variable=plugin_ldflags cai)
cp "$example/hello_strategy.toml" "$work/pc/"
chmod 0755 "$work/pc"
check_plugin "$work/pc/libcai_hello_strategy.so" "$work/pc" "pkg-config cai" --structure-only

# 3. The SDK's data-parallel components, as installed: local_sgd out of tree.
cmake -S "$doc/examples/local_sgd" -B "$work/local_sgd" -G Ninja \
  -DCMAKE_PREFIX_PATH="$prefix" -DCMAKE_BUILD_TYPE=Release >/dev/null
cmake --build "$work/local_sgd" >/dev/null
check_plugin "$work/local_sgd/plugins/libcai_local_sgd.so" "$work/local_sgd/plugins" \
  "local_sgd on the installed SDK components" --structure-only local_sgd
