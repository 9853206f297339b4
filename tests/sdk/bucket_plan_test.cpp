// The SDK bucket reducer's bucket assignment rule (cai/sdk/bucket_reducer.hpp), checked on its own.
#include <gtest/gtest.h>

#include <vector>

#include "cai/sdk/bucket_reducer.hpp"

namespace cai::sdk {
namespace {

using Ranges = std::vector<std::pair<size_t, size_t>>;
constexpr size_t kMiB = size_t{1} << 20;

TEST(SdkBucketPlan, FirstBucketClosesAtOneMiBThenAtTheCap) {
  // Ten 512 KiB gradients, 2 MiB cap: 1 MiB first, then 2 MiB buckets, then the remainder.
  const std::vector<size_t> bytes(10, kMiB / 2);
  EXPECT_EQ(PlanBuckets(bytes, 2 * kMiB), (Ranges{{0, 2}, {2, 6}, {6, 10}}));
}

TEST(SdkBucketPlan, GradientLargerThanTheCapGetsABucketOfItsOwn) {
  const std::vector<size_t> bytes = {100, 5 * kMiB, 100, 100};
  EXPECT_EQ(PlanBuckets(bytes, 2 * kMiB), (Ranges{{0, 2}, {2, 4}}));
  EXPECT_EQ(PlanBuckets(bytes, 2 * kMiB, 64), (Ranges{{0, 1}, {1, 2}, {2, 4}}));
}

TEST(SdkBucketPlan, EveryGradientLandsInExactlyOneBucketInOrder) {
  std::vector<size_t> bytes;
  for (size_t i = 0; i < 37; ++i) bytes.push_back((i * 7919) % 300000 + 4);
  const Ranges plan = PlanBuckets(bytes, 700000);
  ASSERT_FALSE(plan.empty());
  size_t next = 0;
  for (const auto& [first, last] : plan) {
    EXPECT_EQ(first, next);
    EXPECT_LT(first, last);
    next = last;
  }
  EXPECT_EQ(next, bytes.size());
}

TEST(SdkBucketPlan, ZeroCapGivesEachGradientItsOwnBucket) {
  const std::vector<size_t> bytes = {4, 8, 12};
  EXPECT_EQ(PlanBuckets(bytes, 0), (Ranges{{0, 1}, {1, 2}, {2, 3}}));
}

TEST(SdkBucketPlan, NoGradientsNoBuckets) { EXPECT_TRUE(PlanBuckets({}, 25 * kMiB).empty()); }

}  // namespace
}  // namespace cai::sdk
