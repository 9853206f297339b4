#include "optim/optimizer.h"

#include <algorithm>
#include <cmath>
#include <numbers>
#include <string>

#include "core/status.h"
#include "cuda/cuda_module.h"
#include "optim/fused_update.h"

namespace cai {
namespace {

[[noreturn]] void Invalid(const std::string& message) {
  throw Error(CAI_INVALID_ARGUMENT, message);
}

void CheckRange(double value, double lo, double hi, bool hi_open, uint32_t group,
                const char* field) {
  const bool ok = std::isfinite(value) && value >= lo && (hi_open ? value < hi : value <= hi);
  if (!ok) {
    Invalid("optimizer group " + std::to_string(group) + ": " + field + " = " +
            std::to_string(value) + " is outside [" + std::to_string(lo) + ", " +
            std::to_string(hi) + (hi_open ? ")" : "]"));
  }
}

}  // namespace

Optimizer::Optimizer(cai_optim_kind kind, std::vector<GroupHyper> groups, LrSchedule schedule,
                     double max_grad_norm)
    : kind_(kind), groups_(std::move(groups)), schedule_(schedule), max_grad_norm_(max_grad_norm) {
  if (kind_ != CAI_OPTIM_ADAMW && kind_ != CAI_OPTIM_ADAM && kind_ != CAI_OPTIM_SGD) {
    Invalid("unknown optimizer kind " + std::to_string(kind_) +
            ": expected ADAMW (0), ADAM (1) or SGD (2)");
  }
  if (groups_.empty()) Invalid("an optimizer needs at least one parameter group");
  constexpr double kInf = HUGE_VAL;
  for (uint32_t g = 0; g < groups_.size(); ++g) {
    const GroupHyper& h = groups_[g];
    CheckRange(h.lr, 0, kInf, true, g, "lr");
    CheckRange(h.weight_decay, 0, kInf, true, g, "weight_decay");
    if (kind_ == CAI_OPTIM_SGD) {
      CheckRange(h.momentum, 0, kInf, true, g, "momentum");
      CheckRange(h.dampening, -kInf, kInf, true, g, "dampening");
      // As torch.optim.SGD: Nesterov needs momentum and no dampening.
      if (h.nesterov && (h.momentum <= 0 || h.dampening != 0)) {
        Invalid("optimizer group " + std::to_string(g) +
                ": nesterov requires momentum > 0 and dampening = 0");
      }
    } else {
      CheckRange(h.beta1, 0, 1, true, g, "beta1");
      CheckRange(h.beta2, 0, 1, true, g, "beta2");
      CheckRange(h.eps, 0, kInf, true, g, "eps");
    }
  }
  if (schedule_.warmup_steps < 0 || schedule_.total_steps < 0) {
    Invalid("lr schedule: warmup_steps (" + std::to_string(schedule_.warmup_steps) +
            ") and total_steps (" + std::to_string(schedule_.total_steps) +
            ") must not be negative");
  }
  if (!(schedule_.min_lr_ratio >= 0 && schedule_.min_lr_ratio <= 1)) {
    Invalid("lr schedule: min_lr_ratio = " + std::to_string(schedule_.min_lr_ratio) +
            " is outside [0, 1]");
  }
  if (!(max_grad_norm_ >= 0 && std::isfinite(max_grad_norm_))) {
    Invalid("max_grad_norm = " + std::to_string(max_grad_norm_) +
            " must be finite and >= 0 (0 disables clipping)");
  }
}

const GroupHyper& Optimizer::group(uint32_t group) const {
  if (group >= groups_.size()) {
    throw Error(CAI_OUT_OF_RANGE, "optimizer group " + std::to_string(group) +
                                      " does not exist; the optimizer has " +
                                      std::to_string(groups_.size()));
  }
  return groups_[group];
}

uint32_t Optimizer::state_slots(uint32_t group) const {
  if (kind_ == CAI_OPTIM_SGD) return this->group(group).momentum != 0 ? 1 : 0;
  this->group(group);
  return 2;
}

double Optimizer::LrAt(uint32_t group, int64_t step) const {
  const double lr = this->group(group).lr;
  const LrSchedule& s = schedule_;
  step = std::max<int64_t>(step, 1);
  if (step <= s.warmup_steps) {
    return lr * static_cast<double>(step) / static_cast<double>(s.warmup_steps);
  }
  if (s.total_steps <= s.warmup_steps) return lr;
  const double progress = std::min(1.0, static_cast<double>(step - s.warmup_steps) /
                                            static_cast<double>(s.total_steps - s.warmup_steps));
  const double cosine = 0.5 * (1 + std::cos(std::numbers::pi * progress));
  return lr * (s.min_lr_ratio + (1 - s.min_lr_ratio) * cosine);
}

double Optimizer::ClipCoefficient(double global_norm) const {
  if (max_grad_norm_ <= 0 || global_norm <= max_grad_norm_) return 1;
  return max_grad_norm_ / (global_norm + 1e-6);
}

void Optimizer::Update(uint32_t group, const FusedUpdate& u) const {
  const GroupHyper& h = this->group(group);
  if (u.numel == 0) return;
  const uint32_t slots = state_slots(group);
  if (!u.param || !u.grad) Invalid("optimizer update: param or grad is NULL");
  for (uint32_t k = 0; k < slots; ++k) {
    if (!u.state[k]) {
      Invalid("optimizer update of group " + std::to_string(group) + ": state slot " +
              std::to_string(k) + " is NULL but the rule needs " + std::to_string(slots));
    }
  }
  if (u.param_lowp && u.param_lowp_type == FloatType::kF32) {
    Invalid("optimizer update: param_lowp must be bf16 or fp16");
  }
  if (u.step < 1)
    Invalid("optimizer update: step is " + std::to_string(u.step) + "; steps count from 1");
  if (!std::isfinite(u.lr) || !std::isfinite(u.grad_scale)) {
    Invalid("optimizer update: lr (" + std::to_string(u.lr) + ") and grad_scale (" +
            std::to_string(u.grad_scale) + ") must be finite");
  }
  if (u.cuda_device >= 0) {
    cuda::Module& module = cuda::Load();
    if (kind_ == CAI_OPTIM_SGD) {
      module.Sgd(u, h, u.cuda_device, u.stream);
    } else {
      module.Adam(u, h, kind_ == CAI_OPTIM_ADAMW, u.cuda_device, u.stream);
    }
  } else if (kind_ == CAI_OPTIM_SGD) {
    FusedSgd(u, h);
  } else {
    FusedAdam(u, h, kind_ == CAI_OPTIM_ADAMW);
  }
}

std::vector<GroupHyper> DefaultParamGroups(const GroupHyper& hyper) {
  GroupHyper no_decay = hyper;
  no_decay.weight_decay = 0;
  return {hyper, no_decay};
}

uint32_t DefaultParamGroup(int64_t ndim) { return ndim >= 2 ? 0 : 1; }

}  // namespace cai
