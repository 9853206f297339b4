// TorchScript models under a tensor-parallel policy: the rewritten forward on 2 and 4 ranks
// (threads of this process over an in-memory group) gives the unsplit model's loss and each
// rank the slices of its gradients; policies that do not fit fail naming what and where.
#include <gtest/gtest.h>
#include <torch/torch.h>
#include <unistd.h>

#include <filesystem>
#include <string>
#include <vector>

#include "core/status.h"
#include "model/network.h"
#include "model/tensor_parallel.h"
#include "script_gpt.h"
#include "thread_group.h"

namespace cai {
namespace {

using testing::Alone;
using testing::kScriptGptPolicy;
using testing::SaveScriptGpt;
using testing::ScriptGptShape;
using testing::ThreadGroup;
using testing::WriteText;

std::string TempPath(const std::string& name) {
  return (std::filesystem::temp_directory_path() /
          ("cai_torchscript_tp_" + std::to_string(::getpid())) / name)
      .string();
}

struct Step {
  double loss = 0;
  std::vector<ParamSpec> params;  // after backward; tensor.grad() holds the gradient
};

// Three forward/backward passes, gradients accumulating: the graph executor profiles the first
// runs and optimises the later ones, and both must keep the inserted collectives.
Step TrainStep(Network& net, const torch::Tensor& tokens, const torch::Tensor& targets) {
  Step step;
  for (int pass = 0; pass < 3; ++pass) {
    torch::Tensor logits = net.Forward(0, tokens);
    torch::Tensor loss =
        net.CrossEntropy(logits.reshape({-1, logits.size(-1)}), targets.reshape(-1), -100);
    loss.backward();
    step.loss = loss.item<double>();
  }
  step.params = net.params;
  return step;
}

size_t QkvIndex(const Network& net) {
  for (size_t i = 0; i < net.params.size(); ++i) {
    if (net.params[i].name == "blocks.l0.attn.qkv.weight") return i;
  }
  throw std::runtime_error("no blocks.l0.attn.qkv.weight");
}

class TorchScriptTp : public ::testing::Test {
 protected:
  void SetUp() override {
    model_ = SaveScriptGpt(TempPath("gpt.pt"));
    policy_ = WriteText(TempPath("policy.toml"), kScriptGptPolicy);
  }
  // The message of applying `policy` to `model` (tp `size`); empty when it applies.
  static std::string ApplyError(const std::string& model, const std::string& policy, int size = 2) {
    try {
      std::unique_ptr<Network> net = LoadTorchScriptNetwork(model, policy);
      net->ApplyTensorParallel(Alone(0, size), {});
    } catch (const Error& e) {
      return e.what();
    }
    return "";
  }
  std::string PolicyError(const std::string& text, const std::string& model = "", int size = 2) {
    return ApplyError(model.empty() ? model_ : model, WriteText(TempPath("bad.toml"), text), size);
  }
  std::string model_, policy_;
};

TEST_F(TorchScriptTp, PolicySplitsLikeTheUnsplitModel) {
  torch::manual_seed(3);
  const torch::Tensor tokens = torch::randint(0, 256, {2, 24}, torch::kLong);
  const torch::Tensor targets = torch::randint(0, 256, {2, 24}, torch::kLong);
  std::unique_ptr<Network> whole = LoadTorchScriptNetwork(model_);
  const Step ref = TrainStep(*whole, tokens, targets);
  for (int n : {2, 4}) {
    ThreadGroup group(n);
    std::vector<Step> steps(n);
    std::vector<std::unique_ptr<Network>> nets(n);
    for (int r = 0; r < n; ++r) nets[r] = LoadTorchScriptNetwork(model_, policy_);
    testing::RunOnThreads(n, [&](int r) {
      nets[r]->ApplyTensorParallel(group.Rank(r), {});
      steps[r] = TrainStep(*nets[r], tokens, targets);
    });
    for (int r = 0; r < n; ++r) {
      SCOPED_TRACE("tp " + std::to_string(n) + " rank " + std::to_string(r));
      EXPECT_NEAR(steps[r].loss, ref.loss, 1e-5 * std::abs(ref.loss));
      int split = 0;
      for (size_t i = 0; i < ref.params.size(); ++i) {
        const ParamSpec& p = steps[r].params[i];
        ASSERT_EQ(p.name, ref.params[i].name);
        ASSERT_EQ(p.global_shape, ref.params[i].tensor.sizes().vec()) << p.name;
        ASSERT_TRUE(ref.params[i].tensor.grad().defined()) << ref.params[i].name;
        ParamSpec expected;
        expected.tensor = ref.params[i].tensor.grad().clone();
        expected.global_shape = p.global_shape;
        if (p.tp_dim >= 0) {
          ++split;
          tp::SliceParam(expected, p.tp_dim, p.tp_blocks, p.tp_padded / p.tp_blocks, Alone(r, n));
        }
        ASSERT_TRUE(p.tensor.grad().defined()) << p.name;
        ASSERT_EQ(p.tensor.grad().sizes(), expected.tensor.sizes()) << p.name;
        const double err = (p.tensor.grad() - expected.tensor).abs().max().item<double>();
        const double scale = expected.tensor.abs().max().item<double>();
        EXPECT_LE(err, 1e-5 * scale + 1e-9) << p.name;
      }
      // Per block: q/k/v, MLP up (weight and bias), attention output and MLP down (weights);
      // the head's weight (its bias is added after the gather, whole).
      EXPECT_EQ(split, 2 * 5 + 1);
    }
    // The fused q/k/v keeps each rank's q, k and v heads together: rank r's rows are the r-th
    // part of each of the three blocks.
    const size_t i = QkvIndex(*whole);
    const ParamSpec& qkv = steps[1].params[i];
    EXPECT_EQ(qkv.tp_dim, 0);
    EXPECT_EQ(qkv.tp_blocks, 3);
    for (int b = 0; b < 3; ++b) {
      EXPECT_TRUE(torch::equal(qkv.tensor.narrow(0, b * 32 / n, 32 / n),
                               ref.params[i].tensor.narrow(0, b * 32 + 32 / n, 32 / n)))
          << "block " << b;
    }
  }
}

TEST_F(TorchScriptTp, PoliciesThatDoNotFitFailClearly) {
  auto expect = [](const std::string& message, const std::vector<std::string>& parts) {
    ASSERT_FALSE(message.empty()) << "applied";
    for (const std::string& part : parts) {
      EXPECT_NE(message.find(part), std::string::npos) << message << "\n  lacks: " << part;
    }
  };
  expect(PolicyError("colum = [\"head\"]\n"), {"bad.toml", "unknown key 'colum'"});
  expect(PolicyError("column = [\"head\"\n"), {"bad.toml", "malformed TOML at line"});
  expect(PolicyError("column = [1]\n"), {"column must be an array of strings"});
  expect(PolicyError("heads = [\"blocks.*.attn.n_head\"]\n"), {"names no column- or row-"});
  expect(PolicyError("column = [\"blocks.*.attn.qkvx\"]\n"),
         {"column[0] = \"blocks.*.attn.qkvx\" matches no module", "blocks.l0.attn.qkv"});
  expect(PolicyError("column = [\"head\"]\nrow = [\"he*\"]\n"),
         {"'head' is both column- and row-parallel"});
  expect(PolicyError("row = [\"head\"]\ngather_output = [\"head\"]\n"),
         {"gather_output \"head\" matches 'head', which is not column-parallel"});
  expect(PolicyError("column = [\"head\"]\n[fused]\nhead = 0\n"),
         {"fused.\"head\" must be a positive integer"});
  expect(PolicyError("column = [\"head\"]\nheads = [\"blocks.*.attn.qkv.weight\"]\n"),
         {"heads[0] matches attribute 'blocks.l0.attn.qkv.weight', a Tensor"});
  expect(PolicyError("column = [\"head\"]\nheads = [\"n_heads\"]\n"),
         {"heads[0] = \"n_heads\" matches no attribute", "Final"});
  // The head read through .t(): the policy cannot tell which dimension is the output.
  ScriptGptShape transposed;
  transposed.head = "transposed";
  const std::string model = SaveScriptGpt(TempPath("transposed.pt"), transposed);
  expect(PolicyError("column = [\"head\"]\ngather_output = [\"head\"]\n", model),
         {"'head.weight' is read by aten::t", "transposed.pt"});
  // 32 features do not split over 3 ranks, nor do 96 q/k/v features in 3 blocks of 32.
  expect(ApplyError(model_, policy_, 3),
         {"'blocks.l0.attn.proj.weight': input features (32) must divide by tp (3)"});
  expect(
      PolicyError("column = [\"blocks.*.attn.qkv\"]\n[fused]\n\"blocks.*.attn.qkv\" = 3\n", "", 3),
      {"'blocks.l0.attn.qkv.weight': output features (96) must divide by tp (3) × fused "
       "blocks (3)"});
  expect(ApplyError(model_, ""), {"no tensor-parallel policy", "model.tp_policy"});
  try {
    TensorParallelOptions sequence;
    sequence.sequence_parallel = true;
    LoadTorchScriptNetwork(model_, policy_)->ApplyTensorParallel(Alone(0, 2), sequence);
    ADD_FAILURE() << "sequence parallelism applied to a TorchScript model";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), CAI_UNIMPLEMENTED);
    EXPECT_NE(std::string(e.what()).find("sequence parallelism"), std::string::npos) << e.what();
  }
  // A failed apply changes nothing: the same network applies a fitting size afterwards.
  std::unique_ptr<Network> net = LoadTorchScriptNetwork(model_, policy_);
  EXPECT_THROW(net->ApplyTensorParallel(Alone(0, 3), {}), Error);
  const ParamSpec& qkv = net->params[QkvIndex(*net)];
  EXPECT_EQ(qkv.tensor.size(0), 96);
  net->ApplyTensorParallel(Alone(0, 2), {});
  EXPECT_EQ(qkv.tensor.size(0), 48);
  try {
    net->ApplyTensorParallel(Alone(0, 2), {});
    ADD_FAILURE() << "applied twice";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("already applied"), std::string::npos) << e.what();
  }
}

}  // namespace
}  // namespace cai
