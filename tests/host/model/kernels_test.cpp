// The zoo's optional kernels (host/src/model/kernels.h) against the composed ATen paths they
// replace: values and every input's gradient, in fp32 and bf16, at sequence lengths that are
// and are not multiples of the attention's block; and whole models with them switched on.
#include "model/kernels.h"

#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <string>
#include <vector>

#include "core/status.h"
#include "model/model.h"
#include "torch_fixtures.h"

namespace cai {
namespace {

// The largest difference relative to the largest reference value (at least `floor`: bf16
// rounding leaves residues of order 1e-2 where the exact gradient is 0, e.g. of q and k with a
// single key).
double MaxRelative(const torch::Tensor& a, const torch::Tensor& b, double floor = 1e-12) {
  const torch::Tensor x = a.to(torch::kDouble), y = b.to(torch::kDouble);
  return ((x - y).abs().max() / y.abs().max().clamp_min(floor)).item<double>();
}

// Values of fn(inputs) and the gradients of every input against ref(inputs), for one random
// output gradient.
template <class F, class R>
void ExpectSameFunction(std::vector<torch::Tensor> inputs, F fn, R ref, double tolerance,
                        const std::string& what) {
  const double floor = inputs[0].scalar_type() == torch::kBFloat16 ? 1.0 : 1e-12;
  std::vector<torch::Tensor> a, b;
  for (const torch::Tensor& t : inputs) {
    a.push_back(t.detach().clone().requires_grad_(true));
    b.push_back(t.detach().clone().requires_grad_(true));
  }
  const torch::Tensor ya = fn(a), yb = ref(b);
  ASSERT_EQ(ya.sizes(), yb.sizes()) << what;
  EXPECT_LT(MaxRelative(ya, yb), tolerance) << what << ": values";
  const torch::Tensor grad = torch::randn(ya.sizes(), torch::dtype(torch::kFloat)).to(ya.dtype());
  ya.backward(grad);
  yb.backward(grad);
  for (size_t i = 0; i < a.size(); ++i) {
    ASSERT_TRUE(a[i].grad().defined()) << what << ": input " << i;
    EXPECT_LT(MaxRelative(a[i].grad(), b[i].grad(), floor), tolerance)
        << what << ": gradient " << i;
  }
}

TEST(Kernels, MemoryEfficientAttention_MatchesMathAttentionAtAnyLengthAndBlock) {
  torch::manual_seed(3);
  for (int64_t t : {1, 5, 16, 37}) {
    for (int64_t block : {4, 16, 128}) {
      const std::string what = "T " + std::to_string(t) + " block " + std::to_string(block);
      std::vector<torch::Tensor> qkv;
      for (int i = 0; i < 3; ++i) qkv.push_back(torch::randn({2, 3, t, 8}));
      ExpectSameFunction(
          qkv,
          [&](const std::vector<torch::Tensor>& x) {
            return kernels::MemoryEfficientAttention(x[0], x[1], x[2], block);
          },
          [](const std::vector<torch::Tensor>& x) {
            return kernels::MathAttention(x[0], x[1], x[2]);
          },
          1e-5, what);
      // bf16: both round their matmuls to bf16; within bf16's resolution of each other.
      std::vector<torch::Tensor> half;
      for (const torch::Tensor& x : qkv) half.push_back(x.to(torch::kBFloat16));
      ExpectSameFunction(
          half,
          [&](const std::vector<torch::Tensor>& x) {
            return kernels::MemoryEfficientAttention(x[0], x[1], x[2], block);
          },
          [](const std::vector<torch::Tensor>& x) {
            return kernels::MathAttention(x[0], x[1], x[2]);
          },
          3e-2, what + " bf16");
    }
  }
}

TEST(Kernels, FusedRmsNorm_MatchesComposedRmsNorm) {
  torch::manual_seed(4);
  auto composed = [](const std::vector<torch::Tensor>& x) {
    const torch::Tensor xf = x[0].to(torch::kFloat);
    return (xf * torch::rsqrt(xf.pow(2).mean(-1, true) + 1e-5)).to(x[0].scalar_type()) * x[1];
  };
  auto fused = [](const std::vector<torch::Tensor>& x) {
    return kernels::FusedRmsNorm(x[0], x[1], 1e-5);
  };
  for (int64_t rows : {1, 3, 130}) {
    ExpectSameFunction({torch::randn({rows, 2, 24}), torch::rand({24}) + 0.5}, fused, composed,
                       1e-5, "fp32 rows " + std::to_string(rows));
    ExpectSameFunction({torch::randn({rows, 2, 24}).to(torch::kBFloat16),
                        (torch::rand({24}) + 0.5).to(torch::kBFloat16)},
                       fused, composed, 2e-2, "bf16 rows " + std::to_string(rows));
  }
}

TEST(Kernels, FusedBiasGeluAndSwiGlu_MatchComposedOps) {
  torch::manual_seed(5);
  ExpectSameFunction(
      {torch::randn({3, 5, 40}) * 3, torch::randn({40})},
      [](const std::vector<torch::Tensor>& x) { return kernels::FusedBiasGelu(x[0], x[1]); },
      [](const std::vector<torch::Tensor>& x) { return torch::gelu(x[0] + x[1], "tanh"); }, 1e-5,
      "bias + GELU");
  ExpectSameFunction(
      {torch::randn({3, 5, 40}) * 3},
      [](const std::vector<torch::Tensor>& x) { return kernels::FusedBiasGelu(x[0], {}); },
      [](const std::vector<torch::Tensor>& x) { return torch::gelu(x[0], "tanh"); }, 1e-5,
      "GELU without bias");
  ExpectSameFunction(
      {torch::randn({3, 5, 40}).to(torch::kBFloat16), torch::randn({40}).to(torch::kBFloat16)},
      [](const std::vector<torch::Tensor>& x) { return kernels::FusedBiasGelu(x[0], x[1]); },
      [](const std::vector<torch::Tensor>& x) { return torch::gelu(x[0] + x[1], "tanh"); }, 1e-2,
      "bias + GELU bf16");
  ExpectSameFunction(
      {torch::randn({3, 5, 40}) * 3, torch::randn({3, 5, 40})},
      [](const std::vector<torch::Tensor>& x) { return kernels::FusedSwiGlu(x[0], x[1]); },
      [](const std::vector<torch::Tensor>& x) { return torch::silu(x[0]) * x[1]; }, 1e-5, "SwiGLU");
  ExpectSameFunction(
      {torch::randn({3, 5, 40}).to(torch::kBFloat16),
       torch::randn({3, 5, 40}).to(torch::kBFloat16)},
      [](const std::vector<torch::Tensor>& x) { return kernels::FusedSwiGlu(x[0], x[1]); },
      [](const std::vector<torch::Tensor>& x) { return torch::silu(x[0]) * x[1]; }, 1e-2,
      "SwiGLU bf16");
}

// Non-finite activations stay non-finite (fp16 loss scaling looks for them in the gradients),
// and large ones saturate as the composed ops do.
TEST(Kernels, FusedActivations_PropagateNanAndSaturate) {
  const float nan = std::numeric_limits<float>::quiet_NaN();
  const torch::Tensor x = torch::tensor({nan, -200.0f, 200.0f, 0.0f});
  const torch::Tensor gelu = kernels::FusedBiasGelu(x, {});
  const torch::Tensor swiglu = kernels::FusedSwiGlu(x, torch::ones({4}));
  EXPECT_TRUE(std::isnan(gelu[0].item<float>()));
  EXPECT_TRUE(std::isnan(swiglu[0].item<float>()));
  EXPECT_TRUE(torch::allclose(gelu.slice(0, 1), torch::gelu(x.slice(0, 1), "tanh")));
  EXPECT_TRUE(torch::allclose(swiglu.slice(0, 1), torch::silu(x.slice(0, 1))));
}

// ---- Whole models ---------------------------------------------------------------------------

struct Loss {
  double loss;
  std::vector<torch::Tensor> grads;
};

Loss RunOnce(ModelConfig config, uint64_t kernels, bool checkpoint_block_1) {
  auto m = MakeZooModel(config, 9);
  m->EnableKernels(kernels);
  if (checkpoint_block_1) m->SetUnitCheckpointing(1, true);
  const testing::Batch batch(config.vocab_size);
  Loss out{m->ForwardBackward(batch.tokens_desc.view, batch.targets_desc.view, true), {}};
  for (uint32_t i = 0; i < m->NumParams(); ++i) {
    const cai_tensor g = m->ParamGrad(i);
    out.grads.push_back(torch::from_blob(g.data, {m->ParamInfo(i).numel}, torch::kFloat).clone());
  }
  return out;
}

TEST(Kernels, ZooModelsWithEveryKernel_SameLossAndGradients) {
  constexpr uint64_t kAll = CAI_MODEL_KERNEL_MEMORY_EFFICIENT_ATTENTION |
                            CAI_MODEL_KERNEL_FUSED_NORMALIZATION |
                            CAI_MODEL_KERNEL_FUSED_ACTIVATION;
  for (ModelConfig::Arch arch : {ModelConfig::Arch::kGpt2, ModelConfig::Arch::kLlama}) {
    const Loss plain = RunOnce(testing::Config(arch), 0, false);
    for (bool checkpoint : {false, true}) {
      const Loss fused = RunOnce(testing::Config(arch), kAll, checkpoint);
      EXPECT_NEAR(fused.loss, plain.loss, 1e-6 * plain.loss);
      ASSERT_EQ(fused.grads.size(), plain.grads.size());
      for (size_t i = 0; i < plain.grads.size(); ++i) {
        EXPECT_LT(MaxRelative(fused.grads[i], plain.grads[i]), 1e-5) << "parameter " << i;
      }
    }
  }
}

TEST(Kernels, BadRequests_AreRefusedNamingWhat) {
  auto m = MakeZooModel(testing::Config(ModelConfig::Arch::kGpt2), 1);
  try {
    m->EnableKernels(uint64_t(1) << 7);
    ADD_FAILURE() << "unknown kernel bits accepted";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), CAI_INVALID_ARGUMENT);
    EXPECT_NE(std::string(e.what()).find("unknown kernel bits 128"), std::string::npos);
  }
  try {
    m->SetUnitCheckpointing(0, true);
    ADD_FAILURE() << "the embedding accepted checkpointing";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), CAI_INVALID_ARGUMENT);
    EXPECT_NE(std::string(e.what()).find("unit 0 ('embedding') is not a transformer block"),
              std::string::npos)
        << e.what();
  }
}

// set_unit_checkpointing: only the chosen block runs its forward again in backward.
TEST(Kernels, UnitCheckpointing_RecomputesOnlyThatBlock) {
  auto m = MakeZooModel(testing::Config(ModelConfig::Arch::kGpt2), 2);
  m->SetUnitCheckpointing(2, true);
  std::vector<int32_t> recomputed;
  m->AddHook(CAI_HOOK_PRE_FORWARD, -1, -1, [&](const cai_hook_event& e) {
    if (e.recompute) recomputed.push_back(e.unit);
  });
  const testing::Batch batch(64);
  m->ForwardBackward(batch.tokens_desc.view, batch.targets_desc.view, true);
  EXPECT_EQ(recomputed, std::vector<int32_t>{2});
  m->SetUnitCheckpointing(2, false);
  m->SetActivationCheckpointing(true);
  recomputed.clear();
  m->ForwardBackward(batch.tokens_desc.view, batch.targets_desc.view, true);
  EXPECT_EQ(recomputed, (std::vector<int32_t>{2, 1}));
}

}  // namespace
}  // namespace cai
