#!/usr/bin/env bash
# The README's test command: set up, build, run every test.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
scripts/build.sh
build=${CAI_BUILD_DIR:-build}
# The packaging test (ctest -L packaging: builds, installs and purges the deb and rpm packages
# as root) is run on its own; it is not yet part of this command.
ctest --test-dir "$build" --output-on-failure -j "$(nproc)" --timeout 900 -LE packaging
