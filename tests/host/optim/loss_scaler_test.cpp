// LossScaler: GradScaler growth and backoff, hysteresis, clamps, state round trip.
#include "optim/loss_scaler.h"

#include <gtest/gtest.h>

#include "core/status.h"

namespace cai {
namespace {

LossScalerConfig Config(int64_t growth_interval, int64_t hysteresis) {
  LossScalerConfig c;
  c.initial_scale = 1024;
  c.growth_interval = growth_interval;
  c.hysteresis = hysteresis;
  c.min_scale = 1;
  c.max_scale = 4096;
  return c;
}

TEST(LossScaler, CleanSteps_GrowScaleEveryInterval) {
  LossScaler s(Config(3, 1));
  EXPECT_FALSE(s.Update(false));
  EXPECT_FALSE(s.Update(false));
  EXPECT_EQ(s.scale(), 1024);
  EXPECT_FALSE(s.Update(false));
  EXPECT_EQ(s.scale(), 2048);
  EXPECT_EQ(s.state().clean_steps, 0);
  for (int i = 0; i < 3; ++i) s.Update(false);
  EXPECT_EQ(s.scale(), 4096);
  for (int i = 0; i < 3; ++i) s.Update(false);
  EXPECT_EQ(s.scale(), 4096);  // clamped at max_scale
}

TEST(LossScaler, OverflowWithoutHysteresis_BacksOffAndRestartsGrowthCount) {
  LossScaler s(Config(3, 1));
  s.Update(false);
  s.Update(false);
  EXPECT_TRUE(s.Update(true));
  EXPECT_EQ(s.scale(), 512);
  EXPECT_EQ(s.state().clean_steps, 0);
  s.Update(false);
  s.Update(false);
  EXPECT_EQ(s.scale(), 512);
  s.Update(false);
  EXPECT_EQ(s.scale(), 1024);
}

TEST(LossScaler, Hysteresis_BacksOffOnlyAfterConsecutiveOverflows) {
  LossScaler s(Config(100, 3));
  EXPECT_EQ(s.state().overflows_left, 2);
  EXPECT_TRUE(s.Update(true));
  EXPECT_TRUE(s.Update(true));
  EXPECT_EQ(s.scale(), 1024);  // two overflows tolerated
  EXPECT_TRUE(s.Update(true));
  EXPECT_EQ(s.scale(), 512);  // the third backs off
  EXPECT_TRUE(s.Update(true));
  EXPECT_EQ(s.scale(), 256);  // and so does every further consecutive one
  EXPECT_FALSE(s.Update(false));
  EXPECT_EQ(s.state().overflows_left, 2);  // a clean step restores the tolerance
  EXPECT_TRUE(s.Update(true));
  EXPECT_EQ(s.scale(), 256);
}

TEST(LossScaler, Backoff_IsClampedAtMinScale) {
  LossScalerConfig c = Config(100, 1);
  c.initial_scale = 2;
  LossScaler s(c);
  s.Update(true);
  EXPECT_EQ(s.scale(), 1);
  s.Update(true);
  EXPECT_EQ(s.scale(), 1);
}

TEST(LossScaler, StateRoundTrip_ContinuesIdentically) {
  LossScaler a(Config(4, 2));
  a.Update(false);
  a.Update(true);
  a.Update(false);
  a.Update(false);
  LossScaler b(Config(4, 2));
  b.set_state(a.state());
  for (bool inf : {false, false, true, true, false, false, false, false}) {
    EXPECT_EQ(a.Update(inf), b.Update(inf));
    EXPECT_EQ(a.scale(), b.scale());
    EXPECT_EQ(a.state().clean_steps, b.state().clean_steps);
    EXPECT_EQ(a.state().overflows_left, b.state().overflows_left);
  }
}

TEST(LossScaler, InvalidConfigOrState_IsRefused) {
  LossScalerConfig c = Config(4, 2);
  c.backoff_factor = 1.5;
  EXPECT_THROW(LossScaler{c}, Error);
  c = Config(4, 0);
  EXPECT_THROW(LossScaler{c}, Error);
  c = Config(4, 2);
  c.initial_scale = 1e9;  // above max_scale
  EXPECT_THROW(LossScaler{c}, Error);
  LossScaler s(Config(4, 2));
  EXPECT_THROW(s.set_state({1024, 4, 0}), Error);  // clean_steps must be < growth_interval
  EXPECT_THROW(s.set_state({1024, 0, 2}), Error);  // overflows_left must be < hysteresis
  EXPECT_THROW(s.set_state({-1, 0, 0}), Error);
  EXPECT_EQ(s.scale(), 1024);
}

}  // namespace
}  // namespace cai
