#!/usr/bin/env bash
# The README's main job: set up, build, and train the default job (a small GPT-2 on the
# embedded corpus) on 2 ranks of this machine with a data-parallel strategy plugin.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
scripts/build.sh
build=${CAI_BUILD_DIR:-build}
strategy=hello_strategy
[[ -n $(find "$build" -path "*/cai/plugins/ddp.toml" -print -quit) ]] && strategy=ddp
run_dir=${CAI_RUN_DIR:-runs/default-$(date +%Y%m%d-%H%M%S)}
exec "$build/bin/cai" train examples/default.toml --nproc 2 --run-dir "$run_dir" \
  --set plugin.name="$strategy" "$@"
