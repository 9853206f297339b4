// The host's optimizer: its kind, parameter groups and hyper-parameters, learning-rate
// schedule, gradient-clipping rule and the fused update on flat fp32 buffers that plugins run
// on the shards they own. Behind the opaque cai_optimizer handle of cai_optim_api.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "cai/optimizer.h"
#include "mem/kernels.h"

namespace cai {

// One parameter group's hyper-parameters, with torch.optim's defaults.
struct GroupHyper {
  double lr = 1e-3;
  double weight_decay = 0;  // decoupled for ADAMW, L2 (added to the gradient) for ADAM and SGD
  double beta1 = 0.9, beta2 = 0.999, eps = 1e-8;  // ADAM/ADAMW
  double momentum = 0, dampening = 0;             // SGD
  bool nesterov = false;                          // SGD
};

// Linear warmup from lr/warmup_steps at step 1 to lr at step warmup_steps, then cosine decay
// to min_lr_ratio * lr at total_steps, constant after. total_steps <= warmup_steps (0 by
// default) means no decay: constant lr after the warmup, or throughout without one.
// (Cosine decay as in Loshchilov & Hutter, SGDR, arXiv:1608.03983, without restarts.)
struct LrSchedule {
  int64_t warmup_steps = 0;
  int64_t total_steps = 0;
  double min_lr_ratio = 0;
};

// The buffers of one fused update: `numel` elements each.
struct FusedUpdate {
  float* param = nullptr;
  const void* grad = nullptr;
  FloatType grad_type = FloatType::kF32;
  // ADAM/ADAMW: {exp_avg, exp_avg_sq}; SGD with momentum: {momentum_buffer}.
  float* state[2] = {};
  void* param_lowp = nullptr;  // optional copy-out of the updated parameters (bf16 or fp16)
  FloatType param_lowp_type = FloatType::kBF16;
  size_t numel = 0;
  int64_t step = 1;       // 1-based; Adam's bias correction, SGD's momentum initialisation
  double lr = 0;          // this step's learning rate (LrAt)
  double grad_scale = 1;  // multiplies the gradient first: 1/loss_scale * clip coefficient
  // >= 0: every pointer is memory of this CUDA device and the update is enqueued on `stream`
  // (a cudaStream_t) by the CUDA module; -1: host memory, updated by the CPU kernels.
  int cuda_device = -1;
  void* stream = nullptr;
};

// Immutable after construction, hence thread-safe.
class Optimizer {
 public:
  // Throws cai::Error(INVALID_ARGUMENT) naming the group and field of a bad hyper-parameter.
  Optimizer(cai_optim_kind kind, std::vector<GroupHyper> groups, LrSchedule schedule = {},
            double max_grad_norm = 0);

  cai_optim_kind kind() const { return kind_; }
  uint32_t num_groups() const { return static_cast<uint32_t>(groups_.size()); }
  // Throws OUT_OF_RANGE for a group that does not exist.
  const GroupHyper& group(uint32_t group) const;
  // fp32 state values per parameter element: 2 for ADAM/ADAMW, 1 for SGD with momentum, else 0.
  uint32_t state_slots(uint32_t group) const;
  const LrSchedule& schedule() const { return schedule_; }

  // Learning rate of `group` at 1-based `step` (steps below 1 count as 1).
  double LrAt(uint32_t group, int64_t step) const;
  // torch.nn.utils.clip_grad_norm_: max_norm / (global_norm + 1e-6) when global_norm exceeds
  // max_norm, 1 otherwise or without clipping. A NaN norm gives NaN, so the step shows it.
  double ClipCoefficient(double global_norm) const;
  double max_grad_norm() const { return max_grad_norm_; }

  // Runs the group's rule over u's buffers, vectorised and on all OpenMP threads.
  // Throws INVALID_ARGUMENT for missing buffers, step < 1 or non-finite lr / grad_scale.
  void Update(uint32_t group, const FusedUpdate& u) const;

 private:
  cai_optim_kind kind_;
  std::vector<GroupHyper> groups_;
  LrSchedule schedule_;
  double max_grad_norm_;
};

// The default split into parameter groups: group 0 is `hyper` for parameters of rank >= 2
// (weights), group 1 the same without weight decay for rank <= 1 (biases, norm weights).
std::vector<GroupHyper> DefaultParamGroups(const GroupHyper& hyper);
// The group DefaultParamGroups puts a parameter of `ndim` dimensions in.
uint32_t DefaultParamGroup(int64_t ndim);

// The ABI's opaque handle is the Optimizer itself.
inline cai_optimizer* ToHandle(const Optimizer* opt) {
  return reinterpret_cast<cai_optimizer*>(const_cast<Optimizer*>(opt));
}
inline const Optimizer* FromHandle(const cai_optimizer* opt) {
  return reinterpret_cast<const Optimizer*>(opt);
}

}  // namespace cai
