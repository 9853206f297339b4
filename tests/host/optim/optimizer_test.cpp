// Optimizer: schedule, clipping, group split, validation, and the fused update's precision
// variants (bf16/fp16 gradients, low-precision copy-out, grad_scale, threading).
#include "optim/optimizer.h"

#include <gtest/gtest.h>
#include <omp.h>

#include <cmath>
#include <numbers>
#include <random>
#include <string>
#include <vector>

#include "core/status.h"
#include "mem/float16.h"
#include "mem/parallel.h"

namespace cai {
namespace {

constexpr size_t kN = 4 * kParallelMinElements + 29;

std::vector<float> Random(size_t n, uint32_t seed, float scale = 1) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> dist(0, scale);
  std::vector<float> v(n);
  for (float& x : v) x = dist(rng);
  return v;
}

GroupHyper Adam(double lr, double wd) {
  GroupHyper h;
  h.lr = lr;
  h.weight_decay = wd;
  return h;
}

TEST(OptimSchedule, WarmupThenCosine_ReachesMinRatioAtTotalSteps) {
  Optimizer opt(CAI_OPTIM_ADAMW, {Adam(1.0, 0), Adam(0.5, 0)}, LrSchedule{10, 110, 0.1});
  EXPECT_DOUBLE_EQ(opt.LrAt(0, 1), 0.1);
  EXPECT_DOUBLE_EQ(opt.LrAt(0, 5), 0.5);
  EXPECT_DOUBLE_EQ(opt.LrAt(0, 10), 1.0);
  EXPECT_DOUBLE_EQ(opt.LrAt(0, 60), 0.1 + 0.9 * 0.5);  // half way: cos(pi/2) = 0
  EXPECT_DOUBLE_EQ(opt.LrAt(0, 35), 0.1 + 0.9 * 0.5 * (1 + std::cos(std::numbers::pi * 0.25)));
  EXPECT_DOUBLE_EQ(opt.LrAt(0, 110), 0.1);
  EXPECT_DOUBLE_EQ(opt.LrAt(0, 1000), 0.1);
  EXPECT_DOUBLE_EQ(opt.LrAt(1, 60), 0.5 * 0.55);  // each group scales its own lr
  EXPECT_DOUBLE_EQ(opt.LrAt(0, 0), 0.1);          // steps below 1 count as 1
}

TEST(OptimSchedule, Unset_IsConstantAndWarmupOnlyHoldsAfterwards) {
  Optimizer constant(CAI_OPTIM_SGD, {Adam(0.3, 0)});
  EXPECT_DOUBLE_EQ(constant.LrAt(0, 1), 0.3);
  EXPECT_DOUBLE_EQ(constant.LrAt(0, 100000), 0.3);
  Optimizer warmup(CAI_OPTIM_SGD, {Adam(0.4, 0)}, LrSchedule{4, 0, 0});
  EXPECT_DOUBLE_EQ(warmup.LrAt(0, 3), 0.3);
  EXPECT_DOUBLE_EQ(warmup.LrAt(0, 4), 0.4);
  EXPECT_DOUBLE_EQ(warmup.LrAt(0, 5000), 0.4);
}

TEST(OptimClip, Coefficient_FollowsClipGradNorm) {
  Optimizer opt(CAI_OPTIM_ADAMW, {Adam(1e-3, 0)}, {}, 1.0);
  EXPECT_EQ(opt.max_grad_norm(), 1.0);
  EXPECT_EQ(opt.ClipCoefficient(0.5), 1.0);
  EXPECT_EQ(opt.ClipCoefficient(1.0), 1.0);
  EXPECT_DOUBLE_EQ(opt.ClipCoefficient(4.0), 1.0 / (4.0 + 1e-6));
  EXPECT_EQ(opt.ClipCoefficient(INFINITY), 0.0);
  EXPECT_TRUE(std::isnan(opt.ClipCoefficient(NAN)));
  Optimizer unclipped(CAI_OPTIM_ADAMW, {Adam(1e-3, 0)});
  EXPECT_EQ(unclipped.ClipCoefficient(1e9), 1.0);
}

TEST(OptimGroups, DefaultSplit_DecaysOnlyMatrices) {
  EXPECT_EQ(DefaultParamGroup(2), 0u);
  EXPECT_EQ(DefaultParamGroup(4), 0u);
  EXPECT_EQ(DefaultParamGroup(1), 1u);
  EXPECT_EQ(DefaultParamGroup(0), 1u);
  const std::vector<GroupHyper> groups = DefaultParamGroups(Adam(2e-4, 0.1));
  ASSERT_EQ(groups.size(), 2u);
  EXPECT_EQ(groups[0].weight_decay, 0.1);
  EXPECT_EQ(groups[1].weight_decay, 0.0);
  EXPECT_EQ(groups[1].lr, 2e-4);
  Optimizer opt(CAI_OPTIM_ADAMW, groups);
  EXPECT_EQ(opt.num_groups(), 2u);
  EXPECT_EQ(opt.state_slots(1), 2u);
}

TEST(OptimGroups, BadHyperParameters_AreRefusedNamingGroupAndField) {
  GroupHyper bad = Adam(1e-3, 0);
  bad.beta2 = 1.0;
  try {
    Optimizer(CAI_OPTIM_ADAM, {Adam(1e-3, 0), bad});
    FAIL();
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), CAI_INVALID_ARGUMENT);
    EXPECT_NE(std::string(e.what()).find("group 1: beta2"), std::string::npos) << e.what();
  }
  GroupHyper nesterov;
  nesterov.momentum = 0.9;
  nesterov.dampening = 0.1;
  nesterov.nesterov = true;
  EXPECT_THROW(Optimizer(CAI_OPTIM_SGD, {nesterov}), Error);
  EXPECT_THROW(Optimizer(CAI_OPTIM_ADAMW, {}), Error);
  EXPECT_THROW(Optimizer(CAI_OPTIM_ADAMW, {Adam(-1, 0)}), Error);
  EXPECT_THROW(Optimizer(CAI_OPTIM_ADAMW, {Adam(1, 0)}, LrSchedule{0, 10, 1.5}), Error);
  EXPECT_THROW(Optimizer(7, {Adam(1, 0)}), Error);
  Optimizer opt(CAI_OPTIM_SGD, {Adam(1, 0)});
  EXPECT_EQ(opt.state_slots(0), 0u);
  try {
    opt.group(3);
    FAIL();
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), CAI_OUT_OF_RANGE);
  }
}

// Runs one AdamW step of kN elements and returns the parameters.
struct AdamRun {
  std::vector<float> p = Random(kN, 1), m = Random(kN, 2, 0.1f), v = Random(kN, 3, 0.0f);
  void Step(const Optimizer& opt, const void* grad, FloatType type, double scale = 1,
            void* lowp = nullptr, FloatType lowp_type = FloatType::kBF16) {
    FusedUpdate u;
    u.param = p.data();
    u.grad = grad;
    u.grad_type = type;
    u.state[0] = m.data();
    u.state[1] = v.data();
    u.param_lowp = lowp;
    u.param_lowp_type = lowp_type;
    u.numel = kN;
    u.step = 3;
    u.lr = 1e-3;
    u.grad_scale = scale;
    opt.Update(0, u);
  }
};

TEST(OptimUpdate, LowPrecisionGrads_EqualFp32UpdateOnWidenedGrads) {
  const Optimizer opt(CAI_OPTIM_ADAMW, {Adam(1e-3, 0.01)});
  const std::vector<float> g = Random(kN, 4);
  for (FloatType t : {FloatType::kBF16, FloatType::kF16}) {
    std::vector<uint16_t> low(kN);
    std::vector<float> widened(kN);
    for (size_t i = 0; i < kN; ++i) {
      low[i] = t == FloatType::kBF16 ? FloatToBf16(g[i]) : FloatToHalf(g[i]);
      widened[i] = t == FloatType::kBF16 ? Bf16ToFloat(low[i]) : HalfToFloat(low[i]);
    }
    AdamRun a, b;
    a.Step(opt, low.data(), t);
    b.Step(opt, widened.data(), FloatType::kF32);
    EXPECT_EQ(a.p, b.p) << FloatTypeName(t);
    EXPECT_EQ(a.m, b.m);
    EXPECT_EQ(a.v, b.v);
  }
}

TEST(OptimUpdate, LowPrecisionCopyOut_IsRoundedUpdatedParams) {
  const Optimizer opt(CAI_OPTIM_ADAMW, {Adam(1e-3, 0.01)});
  const std::vector<float> g = Random(kN, 5);
  for (FloatType t : {FloatType::kBF16, FloatType::kF16}) {
    AdamRun run;
    std::vector<uint16_t> lowp(kN);
    run.Step(opt, g.data(), FloatType::kF32, 1, lowp.data(), t);
    for (size_t i = 0; i < kN; ++i) {
      ASSERT_EQ(lowp[i], t == FloatType::kBF16 ? FloatToBf16(run.p[i]) : FloatToHalf(run.p[i]))
          << i;
    }
  }
}

TEST(OptimUpdate, GradScale_MultipliesGradientFirst) {
  const Optimizer opt(CAI_OPTIM_ADAM, {Adam(1e-3, 0.01)});
  const std::vector<float> g = Random(kN, 6, 1024);
  std::vector<float> unscaled(kN);
  for (size_t i = 0; i < kN; ++i) unscaled[i] = g[i] * (1.0f / 1024);
  AdamRun a, b;
  a.Step(opt, g.data(), FloatType::kF32, 1.0 / 1024);
  b.Step(opt, unscaled.data(), FloatType::kF32);
  EXPECT_EQ(a.p, b.p);
  EXPECT_EQ(a.m, b.m);
}

TEST(OptimUpdate, AdamW_MatchesFp64ScalarReference) {
  GroupHyper h = Adam(1e-2, 0.1);
  const Optimizer opt(CAI_OPTIM_ADAMW, {h});
  const std::vector<float> g = Random(kN, 7);
  AdamRun run;
  const AdamRun before = run;
  run.Step(opt, g.data(), FloatType::kF32);
  const double lr = 1e-3, bc1 = 1 - std::pow(h.beta1, 3), bc2 = 1 - std::pow(h.beta2, 3);
  for (size_t i = 0; i < kN; i += 97) {
    const double m = h.beta1 * before.m[i] + (1 - h.beta1) * g[i];
    const double v = h.beta2 * before.v[i] + (1 - h.beta2) * g[i] * g[i];
    const double p = before.p[i] * (1 - lr * h.weight_decay) -
                     lr / bc1 * m / (std::sqrt(v) / std::sqrt(bc2) + h.eps);
    ASSERT_NEAR(run.p[i], p, 1e-6 * std::max(1.0, std::fabs(p))) << i;
    ASSERT_NEAR(run.m[i], m, 1e-6 * std::max(0.1, std::fabs(m))) << i;
  }
}

TEST(OptimUpdate, SgdFirstStep_InitialisesMomentumBufferToGradient) {
  GroupHyper h;
  h.lr = 0.1;
  h.momentum = 0.9;
  h.dampening = 0.5;
  const Optimizer opt(CAI_OPTIM_SGD, {h});
  EXPECT_EQ(opt.state_slots(0), 1u);
  std::vector<float> p = {1, 2}, g = {0.5f, -1}, buf = {123, 456};
  FusedUpdate u;
  u.param = p.data();
  u.grad = g.data();
  u.state[0] = buf.data();
  u.numel = 2;
  u.step = 1;
  u.lr = 0.1;
  opt.Update(0, u);
  EXPECT_EQ(buf, g);  // no dampening at the first step, as torch
  EXPECT_FLOAT_EQ(p[0], 1 - 0.1f * 0.5f);
  u.step = 2;
  opt.Update(0, u);
  EXPECT_FLOAT_EQ(buf[0], 0.9f * 0.5f + 0.5f * 0.5f);
}

TEST(OptimUpdate, OneThreadAndAllThreads_GiveIdenticalResults) {
  const Optimizer opt(CAI_OPTIM_ADAMW, {Adam(1e-3, 0.01)});
  const std::vector<float> g = Random(kN, 8);
  AdamRun many, one;
  many.Step(opt, g.data(), FloatType::kF32);
  const int threads = omp_get_max_threads();
  omp_set_num_threads(1);
  one.Step(opt, g.data(), FloatType::kF32);
  omp_set_num_threads(threads);
  EXPECT_EQ(many.p, one.p);
}

TEST(OptimUpdate, MissingStateOrBadStep_IsInvalidArgument) {
  const Optimizer opt(CAI_OPTIM_ADAMW, {Adam(1e-3, 0)});
  std::vector<float> p(4), g(4), m(4);
  FusedUpdate u;
  u.param = p.data();
  u.grad = g.data();
  u.state[0] = m.data();
  u.numel = 4;
  u.lr = 1e-3;
  try {
    opt.Update(0, u);
    FAIL();
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), CAI_INVALID_ARGUMENT);
    EXPECT_NE(std::string(e.what()).find("state slot 1"), std::string::npos) << e.what();
  }
  u.state[1] = m.data();
  u.step = 0;
  EXPECT_THROW(opt.Update(0, u), Error);
  u.step = 1;
  u.grad_scale = NAN;
  EXPECT_THROW(opt.Update(0, u), Error);
}

}  // namespace
}  // namespace cai
