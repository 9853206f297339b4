// The model service where the test needs LibTorch itself: TorchScript modules built and saved
// here, thread-count independence, and reduced-precision dtypes.
#include <gtest/gtest.h>
#include <torch/script.h>
#include <torch/torch.h>
#include <unistd.h>

#include <cmath>
#include <filesystem>
#include <string>
#include <vector>

#include "core/status.h"
#include "model/model.h"
#include "torch_fixtures.h"

namespace cai {
namespace {

using testing::Batch;
using testing::Config;
using testing::TokenDesc;

torch::ScalarType TypeOf(const cai_dtype& d) {
  if (d.code == CAI_DTYPE_BFLOAT) return torch::kBFloat16;
  return d.bits == 16 ? torch::kHalf : torch::kFloat;
}

// The descriptor's memory as an fp32 copy.
torch::Tensor ToFloat(const cai_tensor& t) {
  return torch::from_blob(t.data, std::vector<int64_t>(t.shape, t.shape + t.ndim),
                          torch::TensorOptions().dtype(TypeOf(t.dtype)))
      .to(torch::kFloat);
}

// A small language model written in TorchScript: embedding, tanh, a child "head" module's
// projection, and a buffer; `count` adds an int64 buffer the forward does not read.
std::string SaveTinyScriptModel(const std::string& path, double scale = 2.0, bool count = false) {
  torch::manual_seed(0);
  torch::jit::Module head("Head");
  head.register_parameter("weight", (torch::randn({16, 32}) * 0.1).requires_grad_(true), false);
  head.register_parameter("bias", torch::zeros({32}).requires_grad_(true), false);
  torch::jit::Module lm("TinyLM");
  lm.register_parameter("emb", (torch::randn({32, 16}) * 0.1).requires_grad_(true), false);
  lm.register_buffer("scale", torch::full({1}, scale));
  if (count) lm.register_buffer("count", torch::full({1}, 7, torch::kLong));
  lm.register_module("head", head);
  lm.define(R"JIT(
def forward(self, tokens):
    h = torch.tanh(torch.embedding(self.emb, tokens) * self.scale)
    return torch.matmul(h, self.head.weight) + self.head.bias
)JIT");
  lm.save(path);
  return path;
}

std::unique_ptr<Model> LoadTinyScriptModel(double scale, bool count = false) {
  const std::string path = (std::filesystem::temp_directory_path() /
                            ("cai_model_test_" + std::to_string(::getpid()) + ".pt"))
                               .string();
  std::unique_ptr<Model> m = LoadTorchScriptModel(SaveTinyScriptModel(path, scale, count));
  std::filesystem::remove(path);
  return m;
}

TEST(TorchScript, SavedModule_LoadsWithParametersAndTrains) {
  std::unique_ptr<Model> m = LoadTinyScriptModel(2.0);
  ASSERT_EQ(m->NumParams(), 3u);
  ASSERT_EQ(m->NumUnits(), 1u);
  EXPECT_EQ(m->UnitInfo(0).num_params, 3u);
  EXPECT_EQ(m->UnitInfo(0).num_reads, 0u);  // one unit: nothing crosses
  EXPECT_STREQ(m->ParamInfo(0).name, "emb");
  EXPECT_STREQ(m->ParamInfo(1).name, "head.weight");
  EXPECT_STREQ(m->ParamInfo(1).module_path, "head");
  EXPECT_TRUE(m->ParamInfo(2).flags & CAI_PARAM_IS_BIAS);
  EXPECT_EQ(m->ParamInfo(2).group, 1u);
  EXPECT_TRUE(m->ParamInfo(0).flags & CAI_PARAM_REQUIRES_GRAD);
  ASSERT_EQ(m->NumBuffers(), 1u);
  EXPECT_EQ(*static_cast<float*>(m->BufferData(0).data), 2.0f);

  int ready = 0, post_backward = 0;
  m->AddHook(CAI_HOOK_GRAD_READY, -1, -1, [&](const cai_hook_event&) { ++ready; });
  m->AddHook(CAI_HOOK_POST_BACKWARD, 0, -1, [&](const cai_hook_event&) { ++post_backward; });
  Batch batch(32);
  std::vector<double> losses;
  for (int step = 0; step < 20; ++step) {
    losses.push_back(m->ForwardBackward(batch.tokens_desc.view, batch.targets_desc.view, true));
    for (uint32_t i = 0; i < m->NumParams(); ++i) {
      torch::Tensor w = torch::from_blob(m->ParamData(i).data, {m->ParamInfo(i).numel});
      w -= 0.5 * ToFloat(m->ParamGrad(i)).view({-1});
    }
    m->ZeroGrad(true);
  }
  EXPECT_NEAR(losses.front(), std::log(32.0), 0.1);
  EXPECT_LT(losses.back(), losses.front() - 0.5);
  EXPECT_EQ(ready, 3 * 20);
  EXPECT_EQ(post_backward, 20);
}

// 2 + 2^-8 lies between bf16's neighbours 2 and 2 + 2^-6, so a bf16 buffer holds 2: the cast
// model computes exactly what a model saved with scale 2 does (the fp32 activations times a
// bf16 buffer promote to fp32), and not what the fp32 buffer did.
TEST(TorchScript, SetBufferDtype_CastsFloatBuffersInTheModuleAndKeepsIntegerOnes) {
  std::unique_ptr<Model> cast = LoadTinyScriptModel(2.0 + 1.0 / 256, /*count=*/true);
  std::unique_ptr<Model> exact = LoadTinyScriptModel(2.0);
  std::unique_ptr<Model> fine = LoadTinyScriptModel(2.0 + 1.0 / 256);
  ASSERT_EQ(cast->NumBuffers(), 2u);
  cast->SetBufferDtype(cai_dtype{CAI_DTYPE_BFLOAT, 16, 1});
  const cai_tensor scale = cast->BufferData(0);
  EXPECT_EQ(scale.dtype.code, CAI_DTYPE_BFLOAT);
  EXPECT_EQ(ToFloat(scale).item<float>(), 2.0f);
  const cai_tensor count = cast->BufferData(1);
  EXPECT_EQ(count.dtype.code, CAI_DTYPE_INT);
  EXPECT_EQ(count.dtype.bits, 64);
  EXPECT_EQ(*static_cast<int64_t*>(count.data), 7);

  Batch batch(32);
  const auto loss = [&](Model& m) {
    return m.ForwardBackward(batch.tokens_desc.view, batch.targets_desc.view, false);
  };
  const double cast_loss = loss(*cast);
  EXPECT_EQ(cast_loss, loss(*exact));
  EXPECT_NE(cast_loss, loss(*fine));

  cast->SetBufferDtype(cai_dtype{CAI_DTYPE_FLOAT, 32, 1});
  EXPECT_EQ(cast->BufferData(0).dtype.bits, 32);
  EXPECT_EQ(ToFloat(cast->BufferData(0)).item<float>(), 2.0f);  // the rounding stays
  try {
    cast->SetBufferDtype(cai_dtype{CAI_DTYPE_INT, 32, 1});
    FAIL();
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), CAI_INVALID_ARGUMENT);
    EXPECT_NE(std::string(e.what()).find("set_buffer_dtype"), std::string::npos);
  }
}

TEST(TorchScript, MissingFile_IsInvalidArgumentNamingThePath) {
  try {
    LoadTorchScriptModel("/nonexistent/model.pt");
    FAIL();
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), CAI_INVALID_ARGUMENT);
    EXPECT_NE(std::string(e.what()).find("/nonexistent/model.pt"), std::string::npos);
  }
}

TEST(Zoo, Init_IndependentOfThreadCount) {
  const int threads = torch::get_num_threads();
  torch::set_num_threads(1);
  auto one = MakeZooModel(Config(ModelConfig::Arch::kGpt2), 77);
  torch::set_num_threads(4);
  auto four = MakeZooModel(Config(ModelConfig::Arch::kGpt2), 77);
  torch::set_num_threads(threads);
  for (uint32_t i = 0; i < one->NumParams(); ++i) {
    EXPECT_TRUE(torch::equal(ToFloat(one->ParamData(i)), ToFloat(four->ParamData(i))))
        << one->ParamInfo(i).name;
  }
}

// Relative L2 error of the low-precision model's gradients against fp32, per parameter.
void ExpectCloseToFp32(const cai_dtype& dtype, double loss_tolerance, double grad_tolerance) {
  for (auto arch : {ModelConfig::Arch::kGpt2, ModelConfig::Arch::kLlama}) {
    auto fp32 = MakeZooModel(Config(arch), 5), low = MakeZooModel(Config(arch), 5);
    low->SetComputeDtype(dtype);
    ASSERT_EQ(low->ParamInfo(0).dtype.code, dtype.code);
    ASSERT_EQ(low->ParamInfo(0).dtype.bits, 16);
    Batch batch(64);
    const double a = fp32->ForwardBackward(batch.tokens_desc.view, batch.targets_desc.view, true);
    const double b = low->ForwardBackward(batch.tokens_desc.view, batch.targets_desc.view, true);
    EXPECT_NEAR(a, b, loss_tolerance) << low->Describe();
    for (uint32_t i = 0; i < fp32->NumParams(); ++i) {
      const cai_tensor g = low->ParamGrad(i);
      EXPECT_EQ(g.dtype.code, dtype.code);
      torch::Tensor ref = ToFloat(fp32->ParamGrad(i)), got = ToFloat(g);
      const double err = (got - ref).norm().item<double>() / (ref.norm().item<double>() + 1e-12);
      EXPECT_LT(err, grad_tolerance) << low->ParamInfo(i).name;
    }
  }
}

TEST(Precision, Bf16Compute_CloseToFp32) {
  // bf16 keeps 8 mantissa bits: ~0.4% per rounding, a few percent through a 2-block model.
  ExpectCloseToFp32({CAI_DTYPE_BFLOAT, 16, 1}, 0.02, 0.1);
}

TEST(Precision, Fp16StorageOnCpu_ComputesInFp32CloseToFp32) {
  ExpectCloseToFp32({CAI_DTYPE_FLOAT, 16, 1}, 0.005, 0.02);
}

}  // namespace
}  // namespace cai
