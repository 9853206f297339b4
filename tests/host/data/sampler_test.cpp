#include "data/sampler.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <numeric>

#include "core/status.h"

namespace cai::data {
namespace {

// Token i has id i % 251 so every window's content identifies where it came from.
std::vector<Token> Stream(size_t n) {
  std::vector<Token> tokens(n);
  for (size_t i = 0; i < n; ++i) tokens[i] = static_cast<Token>(i % 251);
  return tokens;
}

TEST(WindowSampler, SameSeedAndStep_GiveTheSameGlobalBatch) {
  const std::vector<Token> tokens = Stream(10000);
  const SamplerOptions options{.seq_len = 16, .global_batch = 8, .seed = 42};
  const WindowSampler a(tokens, options);
  const WindowSampler b(tokens, options);
  for (int64_t step : {0, 1, 77, 3}) {
    EXPECT_EQ(a.GlobalBatchStarts(step), b.GlobalBatchStarts(step)) << "step " << step;
  }
  EXPECT_NE(a.GlobalBatchStarts(0), a.GlobalBatchStarts(1));
  const WindowSampler other_seed(tokens, {.seq_len = 16, .global_batch = 8, .seed = 43});
  EXPECT_NE(a.GlobalBatchStarts(0), other_seed.GlobalBatchStarts(0));
}

TEST(WindowSampler, GlobalBatch_MatchesPinnedValues) {
  // Pinned values: a change here changes which data every existing run resumes on.
  const std::vector<Token> tokens = Stream(1000);
  const WindowSampler sampler(tokens, {.seq_len = 10, .global_batch = 4, .seed = 1});
  EXPECT_EQ(sampler.GlobalBatchStarts(0), (std::vector<int64_t>{30, 520, 860, 180}));
}

TEST(WindowSampler, EachEpoch_VisitsEveryWindowOnce) {
  const std::vector<Token> tokens = Stream(16 * 12 + 1);  // 12 windows of 16
  const WindowSampler sampler(tokens, {.seq_len = 16, .global_batch = 4, .seed = 7});
  ASSERT_EQ(sampler.window_count(), 12);
  std::vector<int64_t> epoch0, epoch1;
  for (int64_t step = 0; step < 3; ++step) {
    for (int64_t s : sampler.GlobalBatchStarts(step)) epoch0.push_back(s);
    for (int64_t s : sampler.GlobalBatchStarts(step + 3)) epoch1.push_back(s);
  }
  EXPECT_NE(epoch0, epoch1) << "the order should change between epochs";
  std::vector<int64_t> all(12);
  for (int64_t w = 0; w < 12; ++w) all[static_cast<size_t>(w)] = w * 16;
  std::sort(epoch0.begin(), epoch0.end());
  std::sort(epoch1.begin(), epoch1.end());
  EXPECT_EQ(epoch0, all);
  EXPECT_EQ(epoch1, all);
}

TEST(WindowSampler, TargetsAreTokensShiftedByOne) {
  const std::vector<Token> tokens = Stream(1000);
  const WindowSampler sampler(tokens, {.seq_len = 5, .global_batch = 2, .seed = 0});
  const std::vector<int64_t> starts{10, 300};
  const Batch batch = sampler.Gather(starts);
  EXPECT_EQ(batch.rows, 2);
  EXPECT_EQ(batch.seq_len, 5);
  EXPECT_EQ(batch.tokens, (std::vector<int64_t>{10, 11, 12, 13, 14, 49, 50, 51, 52, 53}));
  EXPECT_EQ(batch.targets, (std::vector<int64_t>{11, 12, 13, 14, 15, 50, 51, 52, 53, 54}));
  EXPECT_DOUBLE_EQ(batch.loss_weight, 1.0);
}

TEST(ShareOfRank, SevenRowsOverThreeRanks_SplitThreeTwoTwo) {
  const RankShare r0 = ShareOfRank(7, 0, 3), r1 = ShareOfRank(7, 1, 3), r2 = ShareOfRank(7, 2, 3);
  EXPECT_EQ(r0.first, 0);
  EXPECT_EQ(r0.count, 3);
  EXPECT_EQ(r1.first, 3);
  EXPECT_EQ(r1.count, 2);
  EXPECT_EQ(r2.first, 5);
  EXPECT_EQ(r2.count, 2);
  EXPECT_DOUBLE_EQ(r0.weight + r1.weight + r2.weight, 1.0);
  EXPECT_DOUBLE_EQ(r0.weight, 3.0 / 7.0);
}

TEST(ShareOfRank, FewerRowsThanRanksOrBadRank_AreRejected) {
  EXPECT_THROW(ShareOfRank(2, 0, 3), Error);
  EXPECT_THROW(ShareOfRank(8, 3, 3), Error);
  EXPECT_THROW(ShareOfRank(8, -1, 3), Error);
}

class RankSlices : public ::testing::TestWithParam<int> {};

TEST_P(RankSlices, UnionOverRanks_EqualsTheGlobalBatch) {
  const int world = GetParam();
  const std::vector<Token> tokens = Stream(5000);
  const WindowSampler sampler(tokens, {.seq_len = 8, .global_batch = 7, .seed = 3});
  for (int64_t step : {0, 5}) {
    const Batch global = sampler.Gather(sampler.GlobalBatchStarts(step));
    std::vector<int64_t> tokens_union, targets_union;
    double weight = 0;
    for (int rank = 0; rank < world; ++rank) {
      for (const Batch& micro : sampler.RankMicroBatches(step, rank, world, 2)) {
        EXPECT_LE(micro.rows, 2);
        EXPECT_EQ(micro.tokens.size(), static_cast<size_t>(micro.rows * 8));
        tokens_union.insert(tokens_union.end(), micro.tokens.begin(), micro.tokens.end());
        targets_union.insert(targets_union.end(), micro.targets.begin(), micro.targets.end());
        weight += micro.loss_weight;
      }
    }
    EXPECT_EQ(tokens_union, global.tokens) << world << " ranks, step " << step;
    EXPECT_EQ(targets_union, global.targets);
    EXPECT_DOUBLE_EQ(weight, 1.0);
  }
}

INSTANTIATE_TEST_SUITE_P(OneTwoThreeRanks, RankSlices, ::testing::Values(1, 2, 3));

TEST(SplitTokens, EvalIsTheDisjointTail) {
  const std::vector<Token> tokens = Stream(1000);
  const TokenSplit split = SplitTokens(tokens, 0.1);
  EXPECT_EQ(split.train.size(), 900u);
  EXPECT_EQ(split.eval.size(), 100u);
  EXPECT_EQ(split.train.data() + split.train.size(), split.eval.data());
  EXPECT_EQ(SplitTokens(tokens, 0.0).eval.size(), 0u);
  EXPECT_THROW(SplitTokens(tokens, 1.0), Error);
}

TEST(WindowSampler, Unshuffled_WalksWindowsInOrderAndWraps) {
  const std::vector<Token> tokens = Stream(5 * 4 + 1);  // 5 windows of 4
  const WindowSampler eval(tokens, {.seq_len = 4, .global_batch = 2, .seed = 9, .shuffle = false});
  EXPECT_EQ(eval.GlobalBatchStarts(0), (std::vector<int64_t>{0, 4}));
  EXPECT_EQ(eval.GlobalBatchStarts(1), (std::vector<int64_t>{8, 12}));
  EXPECT_EQ(eval.GlobalBatchStarts(2), (std::vector<int64_t>{16, 0}));
}

TEST(WindowSampler, StreamShorterThanOneSequence_ErrorSaysWhatItNeeds) {
  const std::vector<Token> tokens = Stream(8);
  try {
    WindowSampler(tokens, {.seq_len = 8, .global_batch = 1, .seed = 0});
    FAIL() << "accepted 8 tokens for seq_len 8";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("has 8 tokens"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("needs 9"), std::string::npos) << e.what();
  }
}

}  // namespace
}  // namespace cai::data
