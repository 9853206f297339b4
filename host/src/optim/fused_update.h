// The fused update kernels behind Optimizer::Update. The arithmetic follows LibTorch 1.13's
// torch::optim::{AdamW, Adam, SGD} operation for operation (same scalars, computed in double
// and rounded to fp32 as ATen does), so results agree with torch up to its FMA contractions.
#pragma once

#include "optim/optimizer.h"

namespace cai {

// AdamW (decoupled = true; Loshchilov & Hutter, arXiv:1711.05101) or Adam with L2 decay.
void FusedAdam(const FusedUpdate& u, const GroupHyper& h, bool decoupled);
// SGD with momentum, dampening, Nesterov and L2 decay; the momentum buffer starts as the
// gradient at step 1.
void FusedSgd(const FusedUpdate& u, const GroupHyper& h);

}  // namespace cai
