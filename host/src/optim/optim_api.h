// The optimizer service's ABI table (cai_optim_api), over Optimizer and LossScaler.
#pragma once

#include "cai/optimizer.h"

namespace cai {

// A static, fully filled table; valid for the life of the process. Entry points never throw.
// Functions without a status report misuse in their value: num_groups and max_grad_norm
// return 0 for a NULL optimizer; lr_at and clip_coefficient return NaN for a NULL optimizer
// or a group that does not exist; loss_scaler_scale returns 0 and loss_scaler_update true
// (skip the step) for a NULL scaler. Streams are ignored: on the CPU an update completes
// before return.
const cai_optim_api* OptimApi();

}  // namespace cai
