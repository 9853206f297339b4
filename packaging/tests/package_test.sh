#!/usr/bin/env bash
# The packages as users get them (issue #8, packaging/README.md):
#   1. build the debs (from BUILD_DIR when it is configured for /usr, else from a build of its
#      own) and check names, versions, relations, file layout and lintian;
#   2. refuse a plugin package without the host (dpkg's dependency check);
#   3. install the debs on this machine; from the installed tree list the packaged plugins (and
#      nothing of the build tree) and train the default job for a few steps;
#   4. build the example plugin cai-dev installs (/usr/share/doc/cai-dev/examples) out of tree
#      against the installed cai-dev, with find_package(cai) and with pkg-config, drop it into
#      the user plugin directory, see it listed and pass the conformance suite; a world-writable
#      user plugin directory is refused;
#   5. purge the packages and check that nothing they installed is left;
#   6. build the rpms (own build, libdir lib64) and check with rpm -qpl / -qpR that they hold the
#      same files under /usr/lib64 with the same relations, install them into a throwaway root
#      and list the plugins from there.
# usage: package_test.sh BUILD_DIR SOURCE_DIR
# Builds of its own go to BUILD_DIR-deb and BUILD_DIR-rpm (beside BUILD_DIR, so that ccache
# finds BUILD_DIR's objects under the same relative paths) and are kept, so a rerun is
# incremental. Needs root, since it installs the debs with dpkg; exits 77 (skipped) without.
set -euo pipefail
build=$(cd "$1" && pwd)
src=$(cd "$2" && pwd)
source "$src/scripts/ccache-env.sh" "$src"
fail() { echo "FAIL: $*" >&2; exit 1; }

if [[ $(id -u) -ne 0 ]]; then
  echo "SKIP: the packaging test installs packages with dpkg and needs root"
  exit 77
fi
for tool in dpkg-deb dpkg-architecture dpkg-shlibdeps lintian fakeroot rpmbuild rpm file \
            readelf pkg-config; do
  command -v "$tool" >/dev/null || fail "$tool not found; run scripts/setup.sh"
done

work=$(mktemp -d /tmp/cai-package-test-XXXXXX)
multiarch=$(dpkg-architecture -qDEB_HOST_MULTIARCH)
libdir=/usr/lib/$multiarch
plugindir=$libdir/cai/plugins
home=$work/home
userdir=$home/.local/share/cai/plugins
devdoc=/usr/share/doc/cai-dev  # documents and the example plugin's sources (cai-dev)
packages=()  # every deb package this run may have put on the machine
# True when dpkg has any trace of the package (installed, half-installed or config files).
known() {
  local status
  status=$(dpkg-query -W -f='${db:Status-Abbrev}' "$1" 2>/dev/null) && [[ $status != ?n* ]]
}
cleanup() {
  local present=()
  for p in "${packages[@]}"; do
    if known "$p"; then present+=("$p"); fi
  done
  if ((${#present[@]})); then dpkg -P "${present[@]}" >/dev/null 2>&1 || true; fi
  rm -rf "$work"
}
trap cleanup EXIT

cache_get() { sed -n "s/^$1:[A-Z]*=//p" "$2/CMakeCache.txt"; }
version=$(cache_get CMAKE_PROJECT_VERSION "$build")
abi_major=$(sed -n 's/^#define CAI_ABI_MAJOR \([0-9]*\)$/\1/p' "$src/abi/include/cai/core.h")
abi_minor=$(sed -n 's/^#define CAI_ABI_MINOR \([0-9]*\)$/\1/p' "$src/abi/include/cai/core.h")
abi=cai-abi-$abi_major
jobs=$(( $(nproc) < 8 ? $(nproc) : 8 ))  # as scripts/build.sh: LibTorch units need ~1.5 GiB

# A build of its own for one package layout: the project minus tests and benchmarks, with the
# LibTorch location and CUDA choice of BUILD_DIR.
own_build() {  # dir extra-cmake-args...
  local dir=$1
  shift
  if [[ ! -f $dir/build.ninja ]]; then
    local pass=()
    local prefix_path
    prefix_path=$(cache_get CMAKE_PREFIX_PATH "$build")
    [[ -z $prefix_path ]] || pass+=("-DCMAKE_PREFIX_PATH=$prefix_path")
    pass+=("-DCAI_WITH_CUDA=$(cache_get CAI_WITH_CUDA "$build")")
    cmake -S "$src" -B "$dir" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo \
      -DCMAKE_INSTALL_PREFIX=/usr -DCAI_BUILD_TESTS=OFF -DCAI_BUILD_BENCH=OFF \
      "${pass[@]}" "$@" >"$work/configure.log" 2>&1 ||
      { cat "$work/configure.log"; fail "configuring $dir"; }
  fi
  cmake --build "$dir" -j "$jobs" >"$work/build.log" 2>&1 ||
    { tail -50 "$work/build.log"; fail "building $dir"; }
}

run_cpack() {  # build-dir generator
  # Build first: cpack reads CPackConfig.cmake before its own build step regenerates it.
  cmake --build "$1" -j "$jobs" >"$work/build.log" 2>&1 ||
    { tail -50 "$work/build.log"; fail "building $1"; }
  rm -rf "$1/packages"
  (cd "$1" && cpack -G "$2") >"$work/cpack-$2.log" 2>&1 ||
    { cat "$work/cpack-$2.log"; fail "cpack -G $2 in $1"; }
}

# --- 1. debs --------------------------------------------------------------------------------
if [[ $(cache_get CMAKE_INSTALL_PREFIX "$build") == /usr &&
      $(cache_get CMAKE_INSTALL_LIBDIR "$build") == lib/$multiarch ]]; then
  deb_build=$build
else
  deb_build=$build-deb
  echo "building for the deb layout in $deb_build"
  own_build "$deb_build"
fi
run_cpack "$deb_build" DEB
shopt -s nullglob
debs=("$deb_build"/packages/*.deb)
shopt -u nullglob
((${#debs[@]})) || fail "cpack wrote no .deb into $deb_build/packages"

declare -A deb_of
plugin_pkgs=()
plugin_names=()
for deb in "${debs[@]}"; do
  p=$(dpkg-deb -f "$deb" Package)
  deb_of[$p]=$deb
  packages+=("$p")
  [[ $(dpkg-deb -f "$deb" Version) == "$version" ]] ||
    fail "$p: version $(dpkg-deb -f "$deb" Version), project version is $version"
  dpkg-deb -c "$deb" | awk '{print $6}' | sed 's|^\./|/|' >"$work/$p.deb-files"
  bad=$(grep -vE "^/usr/(bin|include|lib/$multiarch|share)/" "$work/$p.deb-files" |
        grep -vxE '/|/usr/|/usr/lib/' || true)
  [[ -z $bad ]] || fail "$p: files outside the FHS/multiarch layout: $bad"
  deps=$(dpkg-deb -f "$deb" Depends)
  case $p in
    cai) ;;
    cai-dev)
      grep -qF "cai (= $version)" <<<"$deps" || fail "cai-dev must depend on cai (= $version): $deps"
      for f in /usr/include/cai/abi.h /usr/include/cai/sdk.hpp /usr/include/cai/conformance.hpp \
               "$libdir/cmake/cai/caiConfig.cmake" "$libdir/cmake/cai/CaiPlugin.cmake" \
               "$libdir/pkgconfig/cai.pc" /usr/bin/cai-conformance \
               /usr/share/cai/abi/v1.0/cai/abi.h /usr/share/cai/abi/v1.0/SHA256SUMS \
               /usr/share/cai/abi/v1.1/cai/abi.h /usr/share/cai/abi/v1.1/SHA256SUMS \
               /usr/share/cai/abi/v1.2/cai/abi.h /usr/share/cai/abi/v1.2/SHA256SUMS \
               "$devdoc/DESIGN.md" "$devdoc/docs/README.md" "$devdoc/docs/abi-contract.md" \
               "$devdoc/docs/manifest.md" "$devdoc/docs/checkpoint-layout.md" \
               "$devdoc/examples/hello_strategy/CMakeLists.txt" \
               "$devdoc/examples/hello_strategy/hello_strategy.cpp" \
               "$devdoc/examples/hello_strategy/hello_strategy.toml"; do
        grep -qxF "$f" "$work/$p.deb-files" || fail "cai-dev lacks $f"
      done
      # Every document of the tree, none forgotten when one is added.
      for d in "$src"/docs/*; do
        grep -qxF "$devdoc/docs/${d##*/}" "$work/$p.deb-files" || fail "cai-dev lacks docs/${d##*/}"
      done
      ;;
    cai-plugin-*)
      plugin_pkgs+=("$p")
      grep -qF "$abi (>= $abi_major.$abi_minor)" <<<"$deps" ||
        fail "$p must depend on $abi (>= $abi_major.$abi_minor): $deps"
      stray=$(grep -vE "^($plugindir/[^/]+|/usr/share/doc/$p/.*|/usr/share/lintian/overrides/$p)$" \
                "$work/$p.deb-files" | grep -v '/$' || true)
      [[ -z $stray ]] || fail "$p: files outside $plugindir: $stray"
      manifests=$(grep -E "^$plugindir/[^/]+\.toml$" "$work/$p.deb-files" || true)
      [[ -n $manifests ]] || fail "$p: no manifest in $plugindir"
      for m in $manifests; do plugin_names+=("$(basename "$m" .toml)"); done
      ;;
    *) fail "unexpected package $p from cpack" ;;
  esac
  echo "ok: $(basename "$deb"): Depends: ${deps:-(none)}"
done
[[ -n ${deb_of[cai]:-} && -n ${deb_of[cai-dev]:-} ]] || fail "cai or cai-dev deb missing"
for f in /usr/bin/cai /usr/share/cai/examples/default.toml; do
  grep -qxF "$f" "$work/cai.deb-files" || fail "cai lacks $f"
done
provides=$(dpkg-deb -f "${deb_of[cai]}" Provides)
[[ $provides == "$abi (= $abi_major.$abi_minor)" ]] || fail "cai Provides: '$provides'"
# dpkg-shlibdeps ran: the host's libc/libstdc++ dependencies are computed, not written.
grep -qE '(^|, )libc6 \(>= ' <<<"$(dpkg-deb -f "${deb_of[cai]}" Depends)" ||
  fail "cai has no computed libc6 dependency: $(dpkg-deb -f "${deb_of[cai]}" Depends)"
echo "ok: packages: ${packages[*]}; plugins: ${plugin_names[*]:-(none yet)}"

lintian --allow-root --fail-on error --tag-display-limit 0 "${debs[@]}" >"$work/lintian.log" 2>&1 ||
  { cat "$work/lintian.log"; fail "lintian reports errors"; }
cat "$work/lintian.log"
echo "ok: lintian: no errors"

for p in "${packages[@]}"; do
  ! known "$p" || fail "$p is already installed on this machine; remove it first (dpkg -P $p)"
done

# --- 2. a plugin package without the host -----------------------------------------------------
if ((${#plugin_pkgs[@]})); then
  p=${plugin_pkgs[0]}
  rc=0
  out=$(dpkg -i "${deb_of[$p]}" 2>&1) || rc=$?
  [[ $rc -eq 1 ]] || fail "dpkg -i $p without cai: exit $rc, expected 1: $out"
  grep -q "dependency problems prevent configuration of $p" <<<"$out" &&
    grep -q "depends on $abi" <<<"$out" || fail "dpkg -i $p without cai: unexpected message: $out"
  [[ $(dpkg-query -W -f='${db:Status-Abbrev}' "$p") != ii* ]] || fail "$p configured without cai"
  dpkg -P "$p" >/dev/null
  echo "ok: $p without the host: dpkg refuses to configure it (exit 1, needs $abi)"
else
  echo "SKIP: plugin package without the host: no plugin packages were built"
fi

# --- 3. the installed tree --------------------------------------------------------------------
dpkg -i "${debs[@]}" >"$work/dpkg-i.log" 2>&1 || { cat "$work/dpkg-i.log"; fail "dpkg -i"; }
for p in "${packages[@]}"; do dpkg -L "$p"; done | sort -u >"$work/installed-paths"

# What a user's shell has: no build-tree variables, an empty home, not run from the tree.
run_cai() { (cd / && env -i PATH=/usr/bin:/bin HOME="$home" LANG=C.UTF-8 /usr/bin/cai "$@"); }
mkdir -p "$home"
[[ $(run_cai --version) == "cai $version (ABI $abi_major.$abi_minor)" ]] ||
  fail "installed cai --version: $(run_cai --version)"
while read -r f; do
  [[ -f $f && ! -L $f && $(file -b "$f") == ELF* ]] || continue
  paths=$(readelf -d "$f" | grep -E 'RPATH|RUNPATH' || true)
  ! grep -qE "$build|$src|$deb_build" <<<"$paths" || fail "$f points into the build tree: $paths"
  ! ldd "$f" | grep -E "not found|$build|$src|$deb_build" || fail "$f: unresolved or build-tree libraries"
done <"$work/installed-paths"

listing=$(run_cai plugins list) || fail "installed cai plugins list failed: $listing"
! grep -qE "$build|$src|$deb_build" <<<"$listing" || fail "listing shows the build tree: $listing"
for name in "${plugin_names[@]}"; do
  grep -qE "^$name +[^ ]+ +[^ ]+ +ok +$plugindir/$name\.toml$" <<<"$listing" ||
    fail "packaged plugin $name not listed from $plugindir: $listing"
done
echo "ok: installed cai lists ${plugin_names[*]:-no plugins} from $plugindir"

job=/usr/share/cai/examples/default.toml
if run_cai train --help >/dev/null 2>&1; then
  # The default job as shipped, then on each packaged strategy.
  for strategy in default "${plugin_names[@]}"; do
    sets=(--set train.steps=3)
    [[ $strategy == default ]] || sets+=(--set "plugin.name=$strategy")
    run=$work/run-$strategy
    run_cai train "$job" --run-dir "$run" "${sets[@]}" >"$work/train.log" 2>&1 ||
      { cat "$work/train.log"; fail "installed cai train $job ($strategy)"; }
    grep -qE '"step": ?3[,}]' "$run/metrics.jsonl" && [[ -s $run/summary.json ]] ||
      fail "train ($strategy): no step 3 in $run/metrics.jsonl or no $run/summary.json"
    echo "ok: installed cai trains $job for 3 steps ($strategy)"
  done
else
  echo "SKIP: train the default job: this host has no 'cai train' yet"
fi

# --- 4. a third-party plugin against the installed cai-dev ------------------------------------
# The example as cai-dev installs it, identical to the tree's. dpkg may be configured to skip
# /usr/share/doc (path-exclude, as in minimal container images); then the tree's copy is used.
example=$devdoc/examples/hello_strategy
if [[ -d $example ]]; then
  for f in CMakeLists.txt hello_strategy.cpp hello_strategy.toml; do
    cmp "$src/sdk/examples/hello_strategy/$f" "$example/$f" || fail "installed $example/$f differs"
  done
  diff -r "$src/docs" "$devdoc/docs" >/dev/null || fail "installed $devdoc/docs differs from docs/"
  echo "ok: cai-dev installed docs/, DESIGN.md and the example's sources in $devdoc"
else
  echo "NOTE: $example not installed (dpkg path-exclude?); building the tree's copy"
  example=$src/sdk/examples/hello_strategy
fi
env -u CMAKE_PREFIX_PATH cmake -S "$example" -B "$work/sdk-cmake" -G Ninja \
  -DCMAKE_BUILD_TYPE=Release -DCMAKE_FIND_USE_PACKAGE_REGISTRY=OFF >"$work/sdk.log" 2>&1 ||
  { cat "$work/sdk.log"; fail "configuring $example against the installed cai-dev"; }
cai_dir=$(cache_get cai_DIR "$work/sdk-cmake")
[[ $cai_dir == "$libdir/cmake/cai" ]] || fail "find_package(cai) found $cai_dir"
cmake --build "$work/sdk-cmake" >>"$work/sdk.log" 2>&1 || { cat "$work/sdk.log"; fail "building $example"; }

pc() { env -u PKG_CONFIG_PATH pkg-config "$@"; }
[[ $(pc --variable=pcfiledir cai) == "$libdir/pkgconfig" ]] || fail "pkg-config found $(pc --path cai)"
# cai.pc is relocatable (paths relative to pcfiledir), hence the normalisation.
[[ $(realpath -m "$(pc --variable=plugindir cai)") == "$plugindir" ]] ||
  fail "cai.pc plugindir: $(pc --variable=plugindir cai)"
mkdir -p "$work/sdk-pc"
# shellcheck disable=SC2046
g++ -std=c++20 -O2 -Wall -Wextra -Werror $(pc --cflags cai) "$example/hello_strategy.cpp" \
  -o "$work/sdk-pc/libcai_hello_strategy.so" $(pc --variable=plugin_ldflags cai) ||
  fail "building $example with pkg-config cai"

for how in cmake pc; do
  if [[ $how == cmake ]]; then so=$work/sdk-cmake/plugins/libcai_hello_strategy.so
  else so=$work/sdk-pc/libcai_hello_strategy.so; fi
  mkdir -p "$userdir"
  install -m 0755 "$so" "$userdir/"
  install -m 0644 "$example/hello_strategy.toml" "$userdir/"
  listing=$(run_cai plugins list) || fail "$how: plugins list with a user plugin: $listing"
  grep -qE "^hello_strategy +0\.1\.0 +1\.0\+ +ok +$userdir/hello_strategy\.toml$" <<<"$listing" ||
    fail "$how: hello_strategy not listed from $userdir: $listing"
  # The behaviour checks (~20 s) once: the installed cai-conformance trains with the installed
  # cai beside it. The other runs check structure only; the behaviour code is the same.
  behaviour=(--structure-only)
  [[ $how == cmake ]] && behaviour=()
  /usr/bin/cai-conformance "${behaviour[@]}" "$userdir/hello_strategy.toml" \
    >"$work/conformance.log" 2>&1 ||
    { cat "$work/conformance.log"; fail "$how: installed cai-conformance on hello_strategy"; }
  run_cai plugins check --structure-only "$userdir/hello_strategy.toml" >"$work/check.log" 2>&1 ||
    { cat "$work/check.log"; fail "$how: cai plugins check on hello_strategy"; }
  echo "ok: hello_strategy built with $how against the installed cai-dev: listed from" \
       "$userdir, conformance passes"

  # Bad input: a user plugin directory anyone may write to is refused, naming the directory.
  chmod 0777 "$userdir"
  rc=0
  out=$(run_cai plugins list 2>&1) || rc=$?
  [[ $rc -ne 0 ]] || fail "$how: world-writable $userdir accepted: $out"
  grep -qF "$userdir: refused: directory is writable by group or others" <<<"$out" ||
    fail "$how: world-writable $userdir: unexpected message: $out"
  rm -rf "$userdir"
done
echo "ok: world-writable $userdir refused (exit $rc, 'writable by group or others')"

# --- 5. removal -------------------------------------------------------------------------------
dpkg -P "${packages[@]}" >"$work/dpkg-P.log" 2>&1 || { cat "$work/dpkg-P.log"; fail "dpkg -P"; }
for p in "${packages[@]}"; do
  ! known "$p" || fail "$p still known to dpkg"
done
while read -r f; do
  if [[ $f == /. ]]; then
    continue  # dpkg -L lists the root as "/."
  elif [[ -d $f && ! -L $f ]]; then
    dpkg -S "$f" >/dev/null 2>&1 || fail "directory $f left behind"
  elif [[ -e $f || -L $f ]]; then
    fail "$f left behind"
  fi
done <"$work/installed-paths"
[[ ! -e $libdir/cai ]] || fail "$libdir/cai left behind"
echo "ok: purged; nothing of the $(wc -l <"$work/installed-paths") installed paths is left"

# --- 6. rpms ----------------------------------------------------------------------------------
rpm_build=$build-rpm
echo "building for the rpm layout in $rpm_build"
own_build "$rpm_build" -DCMAKE_INSTALL_LIBDIR=lib64
run_cpack "$rpm_build" RPM
shopt -s nullglob
rpms=("$rpm_build"/packages/*.rpm)
shopt -u nullglob
((${#rpms[@]} == ${#debs[@]})) || fail "${#rpms[@]} rpms for ${#debs[@]} debs"
declare -A rpm_of
for r in "${rpms[@]}"; do
  p=$(rpm -qp --qf '%{NAME}' "$r")
  rpm_of[$p]=$r
  [[ -n ${deb_of[$p]:-} ]] || fail "rpm $p has no deb counterpart"
  [[ $(rpm -qp --qf '%{VERSION}' "$r") == "$version" ]] || fail "rpm $p: version is not $version"
  # Same files as the deb, with /usr/lib64 for the multiarch libdir.
  rpm -qp --qf '[%{FILEMODES:perms} %{FILENAMES}\n]' "$r" | awk '$1 !~ /^d/ {print $2}' | sort \
    >"$work/$p.rpm-files"
  grep -v '/$' "$work/$p.deb-files" | sed "s|^$libdir/|/usr/lib64/|" | sort >"$work/$p.expected"
  diff -u "$work/$p.expected" "$work/$p.rpm-files" || fail "rpm $p: file list differs from the deb's"
  rpm -qpl "$r" >"$work/$p.rpm-list"
  ! grep -q "$multiarch" "$work/$p.rpm-list" || fail "rpm $p holds multiarch paths"
  reqs=$(rpm -qpR "$r")
  case $p in
    cai)
      grep -qE '^libc\.so\.6\(GLIBC_[0-9.]+\)\(64bit\)$' <<<"$reqs" ||
        fail "rpm cai has no automatic libc requirement: $reqs"
      grep -qxF "$abi = $abi_major.$abi_minor" <<<"$(rpm -qp --provides "$r")" ||
        fail "rpm cai does not provide $abi = $abi_major.$abi_minor"
      ;;
    cai-dev) grep -qxF "cai = $version" <<<"$reqs" || fail "rpm cai-dev must require cai = $version" ;;
    cai-plugin-*)
      grep -qxF "$abi >= $abi_major.$abi_minor" <<<"$reqs" ||
        fail "rpm $p must require $abi >= $abi_major.$abi_minor: $reqs"
      ;;
  esac
  echo "ok: $(basename "$r"): Requires: $(grep -v '^rpmlib(' <<<"$reqs" | paste -sd ' ')"
done

# A throwaway root: the plugin rpm alone is refused for want of the host, and the installed
# host lists the plugins under /usr/lib64.
root=$work/rpmroot
rpm --root "$root" --initdb
if ((${#plugin_pkgs[@]})); then
  p=${plugin_pkgs[0]}
  rc=0
  out=$(rpm --root "$root" -i --test "${rpm_of[$p]}" 2>&1) || rc=$?
  [[ $rc -ne 0 ]] && grep -qF "$abi >= $abi_major.$abi_minor is needed by $p" <<<"$out" ||
    fail "rpm -i $p without cai: exit $rc: $out"
  echo "ok: rpm refuses $p without the host ($abi >= $abi_major.$abi_minor is needed)"
fi
# --nodeps: the throwaway root has no libc package; the requirements were checked above.
rpm --root "$root" -i --nodeps --noscripts "${rpms[@]}" >"$work/rpm-i.log" 2>&1 ||
  { cat "$work/rpm-i.log"; fail "rpm -i into $root"; }
listing=$(cd / && env -i PATH=/usr/bin:/bin HOME="$home" LD_LIBRARY_PATH="$root/usr/lib64" \
          "$root/usr/bin/cai" plugins list) || fail "cai from the rpms: plugins list: $listing"
for name in "${plugin_names[@]}"; do
  grep -qE "^$name +[^ ]+ +[^ ]+ +ok +$root/usr/lib64/cai/plugins/$name\.toml$" <<<"$listing" ||
    fail "cai from the rpms does not list $name from /usr/lib64/cai/plugins: $listing"
done
echo "ok: cai from the rpms lists ${plugin_names[*]:-no plugins} from /usr/lib64/cai/plugins"
echo "PASS"
