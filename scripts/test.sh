#!/usr/bin/env bash
# The README's test command: set up, build, run every test.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
scripts/build.sh
build=${CAI_BUILD_DIR:-build}
# Every test, the packaging one included (it builds, installs and purges the deb and rpm
# packages as root, alone: ctest -L packaging runs only it).
ctest --test-dir "$build" --output-on-failure -j "$(nproc)" --timeout 900
# A short run of each fuzz target over its kept corpus (scripts/fuzz.sh; 10 minutes each by
# default when run by hand).
scripts/fuzz.sh --seconds "${CAI_FUZZ_SECONDS:-20}"
# The host, SDK, ABI and plugin suites again, built with ASan and UBSan (scripts/sanitize.sh).
scripts/sanitize.sh
