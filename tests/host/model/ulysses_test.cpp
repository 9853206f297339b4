// DeepSpeed-Ulysses in the zoo's networks (apply_sequence_parallel, all_to_all), on 2 and 4
// ranks as threads over an in-memory group: every rank's loss is the whole sequence's, and the
// ranks' partial gradients sum to the unsplit model's; layouts it cannot split fail saying why.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <memory>
#include <string>
#include <vector>

#include "core/status.h"
#include "model/model.h"
#include "model/network.h"
#include "thread_group.h"
#include "torch_fixtures.h"

namespace cai {
namespace {

using testing::Alone;
using testing::ThreadGroup;

// torch_fixtures.h's two-block models, with room for 24 positions.
ModelConfig Config(ModelConfig::Arch arch, int64_t n_kv_head) {
  ModelConfig c = testing::Config(arch);
  c.n_ctx = 32;
  c.n_kv_head = n_kv_head;
  return c;
}

struct Pass {
  double loss = 0;
  std::vector<torch::Tensor> grads;  // by parameter
};

// One forward and backward through every unit, as the model service runs them.
Pass ForwardBackward(Network& net, const torch::Tensor& tokens, const torch::Tensor& targets) {
  torch::Tensor x = tokens;
  for (size_t u = 0; u < net.units.size(); ++u) x = net.Forward(u, x);
  torch::Tensor loss =
      net.CrossEntropy(x.reshape({-1, x.size(-1)}), net.LocalTargets(targets).reshape(-1), -100);
  loss.backward();
  Pass pass;
  pass.loss = loss.item<double>();
  for (const ParamSpec& p : net.params) pass.grads.push_back(p.tensor.grad().clone());
  return pass;
}

// `sp` threads, each with its own copy of the network (the same seed: the same weights).
std::vector<Pass> RunUlysses(const ModelConfig& config, int sp, uint64_t kernels,
                             const torch::Tensor& tokens, const torch::Tensor& targets) {
  ThreadGroup group(sp);
  std::vector<Pass> passes(sp);
  std::vector<std::unique_ptr<Network>> nets(sp);
  for (int r = 0; r < sp; ++r) {
    nets[r] = MakeZooNetwork(config, 7);
    nets[r]->EnableKernels(kernels);
  }
  testing::RunOnThreads(sp, [&](int r) {
    nets[r]->ApplySequenceParallel(group.Rank(r));
    passes[r] = ForwardBackward(*nets[r], tokens, targets);
  });
  return passes;
}

TEST(Ulysses, ShardedSequenceGivesTheWholeLossAndGradientsSummingToTheWhole) {
  struct Case {
    const char* name;
    ModelConfig config;
    int sp;
    uint64_t kernels;
  };
  const std::vector<Case> cases = {
      {"gpt2 sp 2", Config(ModelConfig::Arch::kGpt2, 0), 2, 0},
      {"gpt2 sp 4", Config(ModelConfig::Arch::kGpt2, 0), 4, 0},
      {"gpt2 sp 2, memory-efficient attention", Config(ModelConfig::Arch::kGpt2, 0), 2,
       CAI_MODEL_KERNEL_MEMORY_EFFICIENT_ATTENTION},
      {"llama gqa sp 2", Config(ModelConfig::Arch::kLlama, 2), 2, 0},
      {"llama sp 4", Config(ModelConfig::Arch::kLlama, 4), 4, 0},
  };
  torch::manual_seed(5);
  const torch::Tensor tokens = torch::randint(0, 64, {2, 24}, torch::kLong);
  torch::Tensor targets = torch::randint(0, 64, {2, 24}, torch::kLong);
  // Ignored targets, unevenly over the shards (all of the last shard's first row at sp 4).
  targets.index_put_({0, torch::indexing::Slice(18, 24)}, -100);
  targets.index_put_({1, 3}, -100);
  for (const Case& c : cases) {
    SCOPED_TRACE(c.name);
    std::unique_ptr<Network> whole = MakeZooNetwork(c.config, 7);
    whole->EnableKernels(c.kernels);
    const Pass ref = ForwardBackward(*whole, tokens, targets);
    const std::vector<Pass> passes = RunUlysses(c.config, c.sp, c.kernels, tokens, targets);
    for (int r = 0; r < c.sp; ++r) {
      EXPECT_NEAR(passes[r].loss, ref.loss, 1e-5 * ref.loss) << "rank " << r;
    }
    for (size_t i = 0; i < ref.grads.size(); ++i) {
      torch::Tensor sum = torch::zeros_like(ref.grads[i]);
      for (const Pass& p : passes) sum += p.grads[i];
      const double err = (sum - ref.grads[i]).abs().max().item<double>();
      const double scale = ref.grads[i].abs().max().item<double>();
      EXPECT_LE(err, 1e-5 * scale + 1e-9) << whole->params[i].name;
      // Partial: no rank holds the whole gradient of a matrix alone.
      if (ref.grads[i].dim() == 2) {
        EXPECT_GT((passes[0].grads[i] - ref.grads[i]).abs().max().item<double>(), 1e-3 * scale)
            << whole->params[i].name;
      }
    }
  }
}

std::string ErrorOf(const std::function<void()>& f) {
  try {
    f();
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}

TEST(Ulysses, LayoutsItCannotSplitFailSayingWhy) {
  const ModelConfig gpt = Config(ModelConfig::Arch::kGpt2, 0);
  EXPECT_NE(ErrorOf([&] { MakeZooNetwork(gpt, 1)->ApplySequenceParallel(Alone(0, 3)); })
                .find("equal share of the attention heads (n_head: 4); choose an sp size that "
                      "divides it"),
            std::string::npos);
  EXPECT_NE(
      ErrorOf([&] {
        MakeZooNetwork(Config(ModelConfig::Arch::kLlama, 2), 1)->ApplySequenceParallel(Alone(0, 4));
      }).find("key/value heads (n_kv_head: 2)"),
      std::string::npos);
  // After tensor parallelism, the heads each tensor-parallel rank holds.
  EXPECT_NE(ErrorOf([&] {
              std::unique_ptr<Network> net = MakeZooNetwork(gpt, 1);
              net->ApplyTensorParallel(Alone(0, 2), {});
              net->ApplySequenceParallel(Alone(0, 4));
            }).find("attention heads (n_head / tp: 2 per tensor-parallel rank)"),
            std::string::npos);
  EXPECT_NE(ErrorOf([&] {
              std::unique_ptr<Network> net = MakeZooNetwork(gpt, 1);
              TensorParallelOptions split_gather;
              split_gather.sequence_parallel = true;
              net->ApplyTensorParallel(Alone(0, 2), split_gather);
              net->ApplySequenceParallel(Alone(0, 2));
            }).find("(split_gather) already splits the sequence"),
            std::string::npos);
  EXPECT_NE(ErrorOf([&] {
              std::unique_ptr<Network> net = MakeZooNetwork(gpt, 1);
              net->ApplySequenceParallel(Alone(0, 2));
              net->ApplyTensorParallel(Alone(0, 2), {});
            }).find("apply tensor parallelism first"),
            std::string::npos);
  EXPECT_NE(ErrorOf([&] {
              std::unique_ptr<Network> net = MakeZooNetwork(gpt, 1);
              net->ApplySequenceParallel(Alone(0, 2));
              net->ApplySequenceParallel(Alone(0, 2));
            }).find("already applied"),
            std::string::npos);
  EXPECT_NE(ErrorOf([&] {
              std::unique_ptr<Network> net = MakeZooNetwork(gpt, 1);
              net->ApplySequenceParallel(Alone(1, 2));
              net->Forward(0, torch::zeros({2, 15}, torch::kLong));
            }).find("its length (15) must divide by sp_size"),
            std::string::npos);
}

}  // namespace
}  // namespace cai
