// The fused updates against LibTorch's own torch::optim::AdamW, Adam and SGD: same initial
// parameters, same gradients each step, parameters and optimizer states compared after every
// step.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <algorithm>
#include <cmath>
#include <functional>
#include <memory>
#include <vector>

#include "mem/kernels.h"
#include "optim/optimizer.h"

namespace cai {
namespace {

constexpr int64_t kNumel = 100003;  // above the threading threshold, ragged tail
constexpr int kSteps = 6;
constexpr double kRelTol = 1e-6;

// Relative error per element, measured against max(|reference|, rms(reference)): torch's
// CPU kernels contract a*b + c into FMAs and we do not, so where a value is the small result
// of cancellation (m * beta1 + (1 - beta1) * g) the two differ by an ulp of the operands,
// not of the result. Scaled by the tensor's own magnitude, that is still rounding noise.
void ExpectClose(const float* got, const torch::Tensor& want, const char* what, int step) {
  const float* w = want.data_ptr<float>();
  double sum_sq = 0;
  for (int64_t i = 0; i < want.numel(); ++i) sum_sq += static_cast<double>(w[i]) * w[i];
  const double rms = std::sqrt(sum_sq / static_cast<double>(want.numel()));
  double worst = 0;
  for (int64_t i = 0; i < want.numel(); ++i) {
    const double diff = std::fabs(static_cast<double>(got[i]) - w[i]);
    worst = std::max(worst, diff / std::max<double>(std::fabs(w[i]), rms));
  }
  EXPECT_LE(worst, kRelTol) << what << " after step " << step;
}

// Steps `ours` and `theirs` side by side on random gradients. `states` names the torch
// state tensors in the order of our slots.
void RunParity(const Optimizer& ours, torch::optim::Optimizer& theirs, torch::Tensor& param,
               const std::function<std::vector<torch::Tensor>()>& states) {
  torch::manual_seed(1);
  std::vector<float> p(param.data_ptr<float>(), param.data_ptr<float>() + kNumel);
  std::vector<float> s0(kNumel), s1(kNumel);
  for (int step = 1; step <= kSteps; ++step) {
    const torch::Tensor grad = torch::randn({kNumel});
    param.mutable_grad() = grad.clone();
    theirs.step();

    FusedUpdate u;
    u.param = p.data();
    u.grad = grad.data_ptr<float>();
    u.state[0] = s0.data();
    u.state[1] = s1.data();
    u.numel = kNumel;
    u.step = step;
    u.lr = ours.group(0).lr;
    ours.Update(0, u);

    torch::NoGradGuard no_grad;
    ExpectClose(p.data(), param, "param", step);
    const std::vector<torch::Tensor> st = states();
    if (!st.empty()) ExpectClose(s0.data(), st[0], "state 0", step);
    if (st.size() > 1) ExpectClose(s1.data(), st[1], "state 1", step);
  }
}

torch::Tensor InitialParam() {
  torch::manual_seed(0);
  return torch::randn({kNumel}).requires_grad_(true);
}

TEST(OptimTorchParity, AdamW_MatchesTorchOverSixSteps) {
  torch::Tensor param = InitialParam();
  GroupHyper h;
  h.lr = 1e-2;
  h.weight_decay = 0.05;
  h.beta1 = 0.8;
  h.beta2 = 0.99;
  h.eps = 1e-6;
  torch::optim::AdamW theirs({param}, torch::optim::AdamWOptions(h.lr)
                                          .betas({h.beta1, h.beta2})
                                          .eps(h.eps)
                                          .weight_decay(h.weight_decay));
  RunParity(Optimizer(CAI_OPTIM_ADAMW, {h}), theirs, param, [&] {
    auto& s = static_cast<torch::optim::AdamWParamState&>(
        *theirs.state().at(c10::guts::to_string(param.unsafeGetTensorImpl())));
    return std::vector<torch::Tensor>{s.exp_avg(), s.exp_avg_sq()};
  });
}

TEST(OptimTorchParity, AdamWithL2Decay_MatchesTorchOverSixSteps) {
  torch::Tensor param = InitialParam();
  GroupHyper h;
  h.lr = 3e-3;
  h.weight_decay = 0.1;
  torch::optim::Adam theirs({param}, torch::optim::AdamOptions(h.lr)
                                         .betas({h.beta1, h.beta2})
                                         .eps(h.eps)
                                         .weight_decay(h.weight_decay));
  RunParity(Optimizer(CAI_OPTIM_ADAM, {h}), theirs, param, [&] {
    auto& s = static_cast<torch::optim::AdamParamState&>(
        *theirs.state().at(c10::guts::to_string(param.unsafeGetTensorImpl())));
    return std::vector<torch::Tensor>{s.exp_avg(), s.exp_avg_sq()};
  });
}

std::vector<torch::Tensor> MomentumBuffer(torch::optim::SGD& sgd, const torch::Tensor& param) {
  auto& s = static_cast<torch::optim::SGDParamState&>(
      *sgd.state().at(c10::guts::to_string(param.unsafeGetTensorImpl())));
  return {s.momentum_buffer()};
}

TEST(OptimTorchParity, SgdMomentumDampeningWeightDecay_MatchesTorchOverSixSteps) {
  torch::Tensor param = InitialParam();
  GroupHyper h;
  h.lr = 0.05;
  h.momentum = 0.9;
  h.dampening = 0.1;
  h.weight_decay = 0.01;
  torch::optim::SGD theirs({param}, torch::optim::SGDOptions(h.lr)
                                        .momentum(h.momentum)
                                        .dampening(h.dampening)
                                        .weight_decay(h.weight_decay));
  RunParity(Optimizer(CAI_OPTIM_SGD, {h}), theirs, param,
            [&] { return MomentumBuffer(theirs, param); });
}

TEST(OptimTorchParity, SgdNesterov_MatchesTorchOverSixSteps) {
  torch::Tensor param = InitialParam();
  GroupHyper h;
  h.lr = 0.05;
  h.momentum = 0.9;
  h.nesterov = true;
  h.weight_decay = 0.01;
  torch::optim::SGD theirs({param}, torch::optim::SGDOptions(h.lr)
                                        .momentum(h.momentum)
                                        .nesterov(true)
                                        .weight_decay(h.weight_decay));
  RunParity(Optimizer(CAI_OPTIM_SGD, {h}), theirs, param,
            [&] { return MomentumBuffer(theirs, param); });
}

TEST(OptimTorchParity, PlainSgd_MatchesTorchOverSixSteps) {
  torch::Tensor param = InitialParam();
  GroupHyper h;
  h.lr = 0.1;
  torch::optim::SGD theirs({param}, torch::optim::SGDOptions(h.lr));
  RunParity(Optimizer(CAI_OPTIM_SGD, {h}), theirs, param,
            [] { return std::vector<torch::Tensor>{}; });
}

}  // namespace
}  // namespace cai
