#!/usr/bin/env bash
# The README's test command: set up, build, run every test.
set -euo pipefail
cd "$(dirname "$0")/.."
# Seconds per phase, printed last so that the tail of a CI log says where its time went.
phases=""
phase() {
  local name=$1 start=$SECONDS
  shift
  "$@"
  phases+="$name $((SECONDS - start)) s; "
}
trap 'echo "test.sh phases: ${phases}total ${SECONDS} s"' EXIT
phase setup scripts/setup.sh
phase build scripts/build.sh
build=${CAI_BUILD_DIR:-build}
# Every test, the packaging one included (it builds, installs and purges the deb and rpm
# packages as root, alone: ctest -L packaging runs only it).
phase ctest ctest --test-dir "$build" --output-on-failure -j "$(nproc)" --timeout 900
# A short run of each fuzz target over its kept corpus (scripts/fuzz.sh; 10 minutes each by
# default when run by hand).
phase fuzz scripts/fuzz.sh --seconds "${CAI_FUZZ_SECONDS:-10}"
# The host, SDK, ABI and plugin suites again, built with ASan and UBSan (scripts/sanitize.sh).
phase sanitize scripts/sanitize.sh
