// The per-step scalars of the fused updates, computed once per call in double and rounded to
// fp32 as ATen does. Shared by the CPU kernels (fused_update.cpp) and the CUDA kernels
// (cuda/fused_optim.cu), so that both run the same arithmetic. Header-only, no dependencies
// beyond optimizer.h, so nvcc compiles it too.
#pragma once

#include <cmath>

#include "optim/optimizer.h"

namespace cai {

struct AdamScalars {
  float grad_scale;
  float l2;  // Adam's weight decay, added to the gradient; 0 for AdamW
  bool use_l2;
  float decay;  // AdamW's p *= 1 - lr * weight_decay; 1 for Adam
  float beta1, one_minus_beta1, beta2, one_minus_beta2;
  float sqrt_bias_correction2;
  float neg_step_size;
  float eps;
};

struct SgdScalars {
  float grad_scale;
  float l2;
  bool use_l2;
  float momentum;
  float one_minus_dampening;
  float neg_lr;
  bool first;
  bool nesterov;
};

inline AdamScalars MakeAdamScalars(const FusedUpdate& u, const GroupHyper& h, bool decoupled) {
  const double step = static_cast<double>(u.step);
  const double bias_correction1 = 1 - std::pow(h.beta1, step);
  const double bias_correction2 = 1 - std::pow(h.beta2, step);
  AdamScalars s{};
  s.grad_scale = static_cast<float>(u.grad_scale);
  s.use_l2 = !decoupled && h.weight_decay != 0;
  s.l2 = s.use_l2 ? static_cast<float>(h.weight_decay) : 0.0f;
  s.decay = decoupled ? static_cast<float>(1 - u.lr * h.weight_decay) : 1.0f;
  s.beta1 = static_cast<float>(h.beta1);
  s.one_minus_beta1 = static_cast<float>(1 - h.beta1);
  s.beta2 = static_cast<float>(h.beta2);
  s.one_minus_beta2 = static_cast<float>(1 - h.beta2);
  s.sqrt_bias_correction2 = static_cast<float>(std::sqrt(bias_correction2));
  s.neg_step_size = static_cast<float>(-(u.lr / bias_correction1));
  s.eps = static_cast<float>(h.eps);
  return s;
}

inline SgdScalars MakeSgdScalars(const FusedUpdate& u, const GroupHyper& h) {
  SgdScalars s{};
  s.grad_scale = static_cast<float>(u.grad_scale);
  s.use_l2 = h.weight_decay != 0;
  s.l2 = static_cast<float>(h.weight_decay);
  s.momentum = static_cast<float>(h.momentum);
  s.one_minus_dampening = static_cast<float>(1 - h.dampening);
  s.neg_lr = static_cast<float>(-u.lr);
  s.first = u.step == 1;
  s.nesterov = h.nesterov;
  return s;
}

}  // namespace cai
