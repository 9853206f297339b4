// Sequence parallelism in the zoo's networks (apply_sequence_parallel): DeepSpeed-Ulysses
// (all_to_all) and ring attention over the zigzag split (ring_attn), on 2 to 4 ranks as threads
// over an in-memory group: every rank's loss is the whole sequence's, and the ranks' partial
// gradients sum to the unsplit model's; layouts a mode cannot split fail saying why.
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
std::vector<Pass> RunSequenceParallel(const ModelConfig& config, int sp, int32_t mode,
                                      uint64_t kernels, const torch::Tensor& tokens,
                                      const torch::Tensor& targets, bool bf16 = false) {
  ThreadGroup group(sp);
  std::vector<Pass> passes(sp);
  std::vector<std::unique_ptr<Network>> nets(sp);
  for (int r = 0; r < sp; ++r) {
    nets[r] = MakeZooNetwork(config, 7);
    nets[r]->EnableKernels(kernels);
    if (bf16) nets[r]->SetComputeType(torch::kBFloat16);
  }
  testing::RunOnThreads(sp, [&](int r) {
    nets[r]->ApplySequenceParallel(group.Rank(r), mode);
    passes[r] = ForwardBackward(*nets[r], tokens, targets);
  });
  return passes;
}

struct Case {
  const char* name;
  ModelConfig config;
  int sp;
  uint64_t kernels;
};

// Each case against the unsplit network on the same tokens: every rank's loss within 1e-5 of
// the whole one, the ranks' gradients summing to the whole within 1e-5 of each tensor's scale.
void ExpectShardsSumToTheWhole(int32_t mode, const std::vector<Case>& cases) {
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
    const std::vector<Pass> passes =
        RunSequenceParallel(c.config, c.sp, mode, c.kernels, tokens, targets);
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

TEST(Ulysses, ShardedSequenceGivesTheWholeLossAndGradientsSummingToTheWhole) {
  ExpectShardsSumToTheWhole(
      CAI_SEQUENCE_PARALLEL_ALL_TO_ALL,
      {
          {"gpt2 sp 2", Config(ModelConfig::Arch::kGpt2, 0), 2, 0},
          {"gpt2 sp 4", Config(ModelConfig::Arch::kGpt2, 0), 4, 0},
          {"gpt2 sp 2, memory-efficient attention", Config(ModelConfig::Arch::kGpt2, 0), 2,
           CAI_MODEL_KERNEL_MEMORY_EFFICIENT_ATTENTION},
          {"llama gqa sp 2", Config(ModelConfig::Arch::kLlama, 2), 2, 0},
          {"llama sp 4", Config(ModelConfig::Arch::kLlama, 4), 4, 0},
      });
}

// 24 positions: chunks of 6 at sp 2, 4 at sp 3, 3 at sp 4. Every head count: ring attention
// keeps them all on every rank (Llama 4 heads / 2 kv heads at sp 3).
TEST(RingAttention, ZigzagShardsGiveTheWholeLossAndGradientsSummingToTheWhole) {
  ExpectShardsSumToTheWhole(
      CAI_SEQUENCE_PARALLEL_RING_ATTN,
      {
          {"gpt2 sp 2", Config(ModelConfig::Arch::kGpt2, 0), 2, 0},
          {"gpt2 sp 3", Config(ModelConfig::Arch::kGpt2, 0), 3, 0},
          {"gpt2 sp 4", Config(ModelConfig::Arch::kGpt2, 0), 4, 0},
          {"llama gqa sp 2", Config(ModelConfig::Arch::kLlama, 2), 2, 0},
          {"llama gqa sp 3, fused kernels", Config(ModelConfig::Arch::kLlama, 2), 3,
           CAI_MODEL_KERNEL_FUSED_NORMALIZATION | CAI_MODEL_KERNEL_FUSED_ACTIVATION},
      });
}

// The zigzag split itself: rank r of sp holds chunks r and 2·sp − 1 − r, so the tokens its
// embedding looks up and the targets its loss reads are those positions.
TEST(RingAttention, RanksHoldTheZigzagChunks) {
  const torch::Tensor positions = torch::arange(24, torch::kLong).unsqueeze(0);
  for (int r = 0; r < 3; ++r) {
    std::unique_ptr<Network> net = MakeZooNetwork(Config(ModelConfig::Arch::kGpt2, 0), 1);
    net->ApplySequenceParallel(Alone(r, 3), CAI_SEQUENCE_PARALLEL_RING_ATTN);
    const torch::Tensor mine = net->LocalTargets(positions);
    const torch::Tensor expected =
        torch::cat({torch::arange(4 * r, 4 * r + 4), torch::arange(4 * (5 - r), 4 * (6 - r))})
            .unsqueeze(0);
    EXPECT_TRUE(torch::equal(mine, expected)) << "rank " << r << ": " << mine;
  }
}

// bf16 compute with fp32 softmax statistics, as the unsplit attention: within bf16's rounding.
TEST(RingAttention, Bf16FollowsTheUnsplitNetwork) {
  const ModelConfig config = Config(ModelConfig::Arch::kLlama, 2);
  torch::manual_seed(5);
  const torch::Tensor tokens = torch::randint(0, 64, {2, 24}, torch::kLong);
  const torch::Tensor targets = torch::randint(0, 64, {2, 24}, torch::kLong);
  std::unique_ptr<Network> whole = MakeZooNetwork(config, 7);
  whole->SetComputeType(torch::kBFloat16);
  const Pass ref = ForwardBackward(*whole, tokens, targets);
  const std::vector<Pass> passes = RunSequenceParallel(config, 2, CAI_SEQUENCE_PARALLEL_RING_ATTN,
                                                       0, tokens, targets, /*bf16=*/true);
  EXPECT_NEAR(passes[0].loss, ref.loss, 1e-2 * ref.loss);
  for (size_t i = 0; i < ref.grads.size(); ++i) {
    const torch::Tensor sum = passes[0].grads[i] + passes[1].grads[i];
    const double scale = ref.grads[i].abs().max().item<double>();
    EXPECT_LE((sum - ref.grads[i]).abs().max().item<double>(), 5e-2 * scale + 1e-6)
        << whole->params[i].name;
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

constexpr int32_t kUlysses = CAI_SEQUENCE_PARALLEL_ALL_TO_ALL;
constexpr int32_t kRingAttn = CAI_SEQUENCE_PARALLEL_RING_ATTN;

TEST(Ulysses, LayoutsItCannotSplitFailSayingWhy) {
  const ModelConfig gpt = Config(ModelConfig::Arch::kGpt2, 0);
  EXPECT_NE(ErrorOf([&] { MakeZooNetwork(gpt, 1)->ApplySequenceParallel(Alone(0, 3), kUlysses); })
                .find("equal share of the attention heads (n_head: 4); choose an sp size that "
                      "divides it"),
            std::string::npos);
  EXPECT_NE(ErrorOf([&] {
              MakeZooNetwork(Config(ModelConfig::Arch::kLlama, 2), 1)
                  ->ApplySequenceParallel(Alone(0, 4), kUlysses);
            }).find("key/value heads (n_kv_head: 2)"),
            std::string::npos);
  // After tensor parallelism, the heads each tensor-parallel rank holds.
  EXPECT_NE(ErrorOf([&] {
              std::unique_ptr<Network> net = MakeZooNetwork(gpt, 1);
              net->ApplyTensorParallel(Alone(0, 2), {});
              net->ApplySequenceParallel(Alone(0, 4), kUlysses);
            }).find("attention heads (n_head / tp: 2 per tensor-parallel rank)"),
            std::string::npos);
  for (int32_t mode : {kUlysses, kRingAttn}) {
    EXPECT_NE(ErrorOf([&] {
                std::unique_ptr<Network> net = MakeZooNetwork(gpt, 1);
                TensorParallelOptions split_gather;
                split_gather.sequence_parallel = true;
                net->ApplyTensorParallel(Alone(0, 2), split_gather);
                net->ApplySequenceParallel(Alone(0, 2), mode);
              }).find("(split_gather) already splits the sequence"),
              std::string::npos)
        << "mode " << mode;
  }
  EXPECT_NE(ErrorOf([&] {
              std::unique_ptr<Network> net = MakeZooNetwork(gpt, 1);
              net->ApplySequenceParallel(Alone(0, 2), kUlysses);
              net->ApplyTensorParallel(Alone(0, 2), {});
            }).find("apply tensor parallelism first"),
            std::string::npos);
  EXPECT_NE(ErrorOf([&] {
              std::unique_ptr<Network> net = MakeZooNetwork(gpt, 1);
              net->ApplySequenceParallel(Alone(0, 2), kUlysses);
              net->ApplySequenceParallel(Alone(0, 2), kUlysses);
            }).find("already applied"),
            std::string::npos);
  EXPECT_NE(ErrorOf([&] {
              std::unique_ptr<Network> net = MakeZooNetwork(gpt, 1);
              net->ApplySequenceParallel(Alone(1, 2), kUlysses);
              net->Forward(0, torch::zeros({2, 15}, torch::kLong));
            }).find("its length (15) must divide by sp_size"),
            std::string::npos);
}

TEST(RingAttention, LayoutsItCannotSplitFailSayingWhy) {
  const ModelConfig gpt = Config(ModelConfig::Arch::kGpt2, 0);
  // Two chunks per rank: 21 positions divide by 3 (Ulysses would take them) but not by 6.
  EXPECT_NE(ErrorOf([&] {
              std::unique_ptr<Network> net = MakeZooNetwork(gpt, 1);
              net->ApplySequenceParallel(Alone(1, 3), kRingAttn);
              net->Forward(0, torch::zeros({2, 21}, torch::kLong));
            })
                .find("2 x sp_size = 6 equal chunks, two per rank of the sequence-parallel group: "
                      "its length (21) must divide by 6"),
            std::string::npos);
}

}  // namespace
}  // namespace cai
