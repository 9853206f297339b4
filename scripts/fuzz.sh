#!/usr/bin/env bash
# Builds the libFuzzer targets (tests/fuzz, clang with ASan and UBSan) into build-fuzz and runs
# each for the given time on its corpus (tests/fuzz/corpus/<target>, grown in place with the
# new inputs libFuzzer keeps). A crash leaves its input as build-fuzz/crash-<target>-* and fails
# the script. Before committing a grown corpus, --minimize keeps only the inputs that add
# coverage (libFuzzer's -merge=1) and the named seeds.
# usage: scripts/fuzz.sh [--seconds N (default 600)] [--seeds] [--minimize] [TARGET...]
#   --seeds  rewrites the checkpoint and safetensors seeds with the current writers first
set -euo pipefail
cd "$(dirname "$0")/.."
seconds=600
seeds=false
minimize=false
targets=()
while (($#)); do
  case $1 in
    --seconds) seconds=$2; shift 2 ;;
    --seeds) seeds=true; shift ;;
    --minimize) minimize=true; shift ;;
    fuzz_job|fuzz_manifest|fuzz_checkpoint|fuzz_safetensors) targets+=("$1"); shift ;;
    *) echo "usage: scripts/fuzz.sh [--seconds N] [--seeds] [--minimize] [fuzz_job|fuzz_manifest|fuzz_checkpoint|fuzz_safetensors...]" >&2
       exit 2 ;;
  esac
done
((${#targets[@]})) || targets=(fuzz_job fuzz_manifest fuzz_checkpoint fuzz_safetensors)
command -v clang++ >/dev/null || { echo "fuzz: clang++ is missing; run scripts/setup.sh" >&2; exit 1; }
source scripts/ccache-env.sh "$PWD"
build=build-fuzz
[[ -f $build/build.ninja ]] ||
  cmake -S tests/fuzz -B "$build" -G Ninja -DCMAKE_CXX_COMPILER=clang++ \
    -DCMAKE_CXX_COMPILER_LAUNCHER="$(command -v ccache || true)" >/dev/null
cmake --build "$build" -j "$(nproc)"
if $seeds; then "$build/make_seeds" tests/fuzz/corpus; fi
status=0
for t in "${targets[@]}"; do
  corpus=tests/fuzz/corpus/${t#fuzz_}
  echo "fuzz: $t for ${seconds} s on $corpus"
  # -max_len: the largest seed is a few hundred bytes; checkpoints need room to grow.
  # Scratch files on tmpfs: the targets write their input to a file for each run.
  if ! TMPDIR=/dev/shm "$build/$t" -max_total_time="$seconds" -max_len=16384 -timeout=25 -rss_limit_mb=2048 \
      -artifact_prefix="$build/crash-$t-" -print_final_stats=1 "$corpus" \
      >"$build/$t.log" 2>&1; then
    echo "fuzz: $t FAILED; the input is $build/crash-$t-*; log: $build/$t.log" >&2
    tail -40 "$build/$t.log" >&2
    status=1
  else
    grep -E "stat::number_of_executed_units|stat::new_units_added|stat::peak_rss_mb" \
      "$build/$t.log" | sed "s/^/fuzz: $t /"
  fi
done
if $minimize; then
  for t in "${targets[@]}"; do
    corpus=tests/fuzz/corpus/${t#fuzz_} kept=$build/minimized-${t#fuzz_}
    rm -rf "$kept" && mkdir -p "$kept"
    TMPDIR=/dev/shm "$build/$t" -merge=1 -max_len=16384 "$kept" "$corpus" >"$build/$t.merge.log" 2>&1
    # The named seeds stay whatever their coverage; libFuzzer's own inputs are hashes.
    find "$corpus" -type f -regextype posix-extended -regex '.*/[0-9a-f]{40}' -delete
    cp -n "$kept"/* "$corpus"/
    echo "fuzz: $t corpus minimized to $(ls "$corpus" | wc -l) inputs"
  done
fi
exit $status
