#!/usr/bin/env bash
# Builds cai with AddressSanitizer and UndefinedBehaviorSanitizer (gcc, -fsanitize=address,undefined,
# every report fatal) into build-asan and runs the host, SDK, ABI and plugin suites there: the
# cai binary, the plugins it loads and every test program are instrumented; LibTorch, Gloo and
# OpenBLAS are not (their bugs are not ours to find, and ASan only sees what they do through
# malloc). Leaks are reported at exit of every instrumented process but `cai train --nproc N`'s
# launcher, which ends without its leak check once the ranks have ended (its code is checked by
# the launcher's tests and by every one-rank run); the few that belong to the uninstrumented
# libraries are listed, with why, in tests/sanitize/lsan.supp.
# Left out: what runs no code of ours (the packaging test, which builds its own packages; the
# out-of-tree SDK build; clang-format; the benchmarks' PyTorch peers) and what repeats, for
# minutes, code paths that the tests kept here already run (under ASan a training rank runs
# 3-4x slower: on a 2-core machine of CI's kind the tests took 1845 s at -j2 with these, 1218 s
# without):
# - the default job's full training run; the 50 kills in saves;
# - the resume matrix (every strategy's checkpoint under every other): each strategy's own
#   checkpoint and resume tests write and read the same code;
# - the conformance runs of the shipped plugins (their parity tests train the same code; the
#   runner itself runs on the C replica and the hello strategy) and its negative control;
# - the two-namespace multi-node run (the launcher and communicator paths run on one node);
# - plain-SGD twins of parity tests (the optimizer's SGD path has its unit tests), the same
#   strategy at more rank counts or bucket sizes, and the byte and memory accounting checks,
#   which rerun a parity test's training to count;
# - a second mixed-precision test of one strategy (its fp16 test keeps the casts and scaling);
# - gemini's budget runs (its NVMe, host and auto placements are kept at small sizes);
# - the lazy-initialisation runs of gemini and hybrid_parallel (the host's lazy paths run in
#   cai_model_test's LazyInit tests, and end to end in fsdp's and the reference's lazy runs)
#   and bf16's noise floor, six reference runs that only measure rounding;
# - tensor parallelism's padded-vocabulary, bf16, accounting, grid, Llama and checkpoint-matrix
#   runs (its tp 2 and 3 test and its Llama tp 2 run with every kernel run the same split,
#   padding, gather and distributed loss code), and its run of every kernel with per-stage
#   recompute (the kernels' own tests in cai_model_test run here, recompute runs in zbv's Llama
#   run); sequence parallelism's accounting runs, split_gather's GPT-2 tp 2 and 3 run (its
#   Llama plain-SGD and pipeline run, kept, runs the same all-gathers, reduce-scatters and
#   shard loss), Ulysses' Llama, grid and checkpoint runs (its sp 2 and 3 test runs the same
#   all-to-alls and shard loss), and ring
#   attention's likewise (its sp 2 and 3 test runs the same ring steps and zigzag split);
#   hybrid_parallel's plain data-parallel path (ddp's and low_level_zero's own tests run it);
# - the tables of bad configurations whose cases each start ranks only to refuse a key
#   (hybrid_parallel's, Ulysses', ring attention's, the layouts', gemini's, and tensor
#   parallelism's unsplittable models): the parsing and messages they check are strings built
#   once, and the same runs pass unsanitised;
# - local_sgd synchronising every step (its every-two-steps test runs the same code) and a
#   checkpoint of another strategy resumed under ddp, or a pp 2 checkpoint under dp 3 and fsdp
#   (each strategy's own resume tests read the same layout).
skip=(
  'Train\.DefaultJob_LearnsBelowStatedLoss' 'Shards/KillInSave\..*' 'Style_.*' 'Bench_Peers_.*'
  'Sdk_ExamplePlugin_BuildsOutOfTree.*'
  'Savers/ResumeMatrix\..*'
  'Sdk_Conformance_(Ddp|Fsdp|Gemini|LowLevelZero|LocalSgd|HybridParallel)_.*'
  'Conformance\.GradientsAveragedOverRanks_FailTheTwoRankSgdCheck'
  'MultiNode\..*'
  '.*PlainSgd.*'
  'LowLevelZero\.(Stage2_SmallBuckets|Stage1_OneTwoThreeRanks|CommunicationPerStep|Memory_|Bf16_).*'
  'FsdpParity\.(SaveFullOnTwoRanksResumeOnThree|SaveShardedOnThreeRanksResumeOnTwo|TwoAndThreeRanks_BufferDtype|ThreeRanks_Bf16).*'
  'DdpParity\.(Ddp_TwoRanks_AllReduceBytesEqualGradientBytes|CheckpointOfAnotherStrategy|Bf16NoiseFloor).*'
  'HybridParallel\.(OneFOneB_ActivationMemory|Pp3_GptAndLlama|Tp_PaddedVocabulary|Bf16_Tp2|Tp2_Communication|Checkpoint_Tp2Pp2|Tp2Pp2AndTp2Dp2|Tp2_LlamaGqa|ActivationMemoryPerBlock|SequenceParallel_(Communication|OddSequence|Tp2AndTp3)|AllOptimizations|SequenceParallelRing_Communication|Ulysses_(LlamaGqa|Sp2With|Checkpoints|Communication|BadConfigurations)|RingAttn_(LlamaGqa|Sp2With|Checkpoint|Communication|BadConfigurations)|BadConfigurations|DataParallelPath|TorchScriptPolicy_Missing|Tp_UnsplittableModels|LazyInit_|Checkpoint_SavedByPp2ResumesUnderDp3AndFsdp).*'
  'LocalSgd\.SyncEveryStep_IsDdpExactly' 'ParallelLayout\.BadLayouts.*'
  'GeminiParity\.(BadConfigurations|TwoRanks_ChunkSearch|FourRanks_ExtraDataParallel|Bf16AndFp16|TwoAndThreeRanks_HostPlacement|TwoRanks_LazyInit).*' 'GeminiBudget\..*'
)
# usage: scripts/sanitize.sh [ctest arguments...]
set -euo pipefail
cd "$(dirname "$0")/.."
build=${CAI_ASAN_BUILD_DIR:-build-asan}
source scripts/ccache-env.sh "$PWD"
if [[ ! -f $build/build.ninja ]]; then
  # No CUDA objects (nvcc does not take gcc's sanitizers) and no benchmarks: neither is run.
  # -g1: line tables only, which is what a report's stack needs; with full debug information
  # (-g) a translation unit took ~27% longer to compile (host/src/model/model.cpp: 46 s
  # against 36 s), and CI compiles every one of them a second time here.
  cmake -S . -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo \
    -DCMAKE_C_FLAGS_RELWITHDEBINFO="-O2 -g1 -DNDEBUG" \
    -DCMAKE_CXX_FLAGS_RELWITHDEBINFO="-O2 -g1 -DNDEBUG" \
    -DCAI_SANITIZE=address,undefined -DCAI_WITH_CUDA=OFF -DCAI_BUILD_BENCH=OFF >/dev/null
fi
jobs=$(( $(nproc) < 8 ? $(nproc) : 8 ))
cmake --build "$build" -j "$jobs"
supp=$PWD/tests/sanitize
# detect_container_overflow=0: libstdc++ containers are annotated only in instrumented code,
# and LibTorch's uninstrumented inlines resize the same vectors (ASan's documented false
# positive). abort_on_error: a report kills the process with SIGABRT, so a rank's report also
# ends its job and fails the test, not only a log line.
export ASAN_OPTIONS=detect_leaks=1:detect_container_overflow=0:abort_on_error=1:strict_string_checks=1:detect_stack_use_after_return=0
export LSAN_OPTIONS=suppressions=$supp/lsan.supp:print_suppressions=0
export UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1:suppressions=$supp/ubsan.supp
# --timeout 900: a test that hangs fails after 15 minutes and names itself in the log instead of
# holding CI past its limit; hybrid_parallel's job tests keep their own 600 s.
# The selection is made here, with grep, and handed to ctest as positions (-I): CMake's regular
# expressions take at most nine groups, and a -E over this list fails to compile, which ctest
# only warns about before running every test (the ASan pass then outgrew CI's time). -I counts
# positions among the tests the other filters keep (-LE, a caller's -R), so the list is read
# through the same filters.
names=$(ctest --test-dir "$build" -N -LE packaging "$@" | sed -n 's/^ *Test *#[0-9]*: \(.*\)$/\1/p')
total=$(grep -c . <<<"$names" || true)
# Line numbers of the names the skip list does not match: the positions -I takes.
kept=$(grep -n . <<<"$names" | grep -vE "^[0-9]+:($(IFS='|'; echo "${skip[*]}"))\$" |
  cut -d: -f1 || true)
count=$(grep -c . <<<"$kept" || true)
if ((count == 0 || ($# == 0 && count == total))); then
  echo "sanitize.sh: of $total tests the skip list kept $count; check its patterns" >&2
  exit 1
fi
echo "sanitize.sh: $count of $total tests (the rest are left out above, with why)"
ctest --test-dir "$build" --output-on-failure -j "$(nproc)" --timeout 900 -LE packaging \
  -I "0,0,0,$(paste -sd, <<<"$kept")" "$@"
