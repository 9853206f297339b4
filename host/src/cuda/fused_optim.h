// The fused optimizer kernels on device memory (fused_optim.cu). Same arithmetic as the CPU
// kernels of optim/fused_update.cpp, element for element.
#pragma once

#include "optim/fused_scalars.h"

namespace cai::cuda {

// Enqueue one update of u.numel elements on `stream` (a cudaStream_t); throw cai::Error on a
// launch failure. u's pointers are device pointers.
void LaunchAdam(const FusedUpdate& u, const AdamScalars& s, void* stream);
void LaunchSgd(const FusedUpdate& u, const SgdScalars& s, bool with_momentum, void* stream);

}  // namespace cai::cuda
