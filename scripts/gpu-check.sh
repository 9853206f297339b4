#!/usr/bin/env bash
# The checks that need a GPU, in one short run (a few minutes) for when one is lent:
#   1. the CUDA module's tests on the device (tests/host/cuda: NCCL all-reduce of a CUDA tensor
#      through the communicator, one rank per GPU as NCCL requires; the fused CUDA AdamW
#      against the CPU one at 1e-6 relative; the module's CUDA and NCCL versions);
#   2. bench/cuda_optim_bench: the fused CUDA AdamW's bandwidth against the device's copy
#      bandwidth, measured in the same run.
# Without a GPU it runs the same programs, which then check the "no device" answers and say
# that nothing was measured: the dry run that keeps this script working between loans.
# The build is ${CAI_BUILD_DIR:-build} (scripts/build.sh; CUDA found there); results also go
# to $OUT/gpu-check.txt when OUT is set (the device tool's output folder).
# usage: scripts/gpu-check.sh
set -uo pipefail
cd "$(dirname "$0")/.."
build=${CAI_BUILD_DIR:-build}
module=$build/lib/cai/libcai_cuda.so
log=${OUT:+$OUT/gpu-check.txt}
exec > >(tee ${log:+"$log"}) 2>&1
status=0
step() { echo; echo "== $*"; }

step "machine"
date -u
command -v nvidia-smi >/dev/null &&
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv ||
  echo "nvidia-smi: not here (no NVIDIA driver)"
if [[ ! -f $module ]]; then
  echo "gpu-check: $module is missing: build with CUDA and NCCL found (scripts/build.sh" \
       "configures it when /usr/local/cuda has both)" >&2
  exit 1
fi

step "CUDA module tests (tests/host/cuda)"
ctest --test-dir "$build" --output-on-failure -R '^(CudaTensors|CudaModule)' || status=1

step "fused CUDA AdamW against the device's bandwidth"
CAI_CUDA_MODULE=$PWD/$module "$build/bench/cuda_optim_bench" || status=1

step "result: $([[ $status == 0 ]] && echo passed || echo FAILED)"
exit $status
