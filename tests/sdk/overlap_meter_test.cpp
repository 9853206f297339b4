// OverlapMeter on made-up timelines: what a strategy's overlap_ratio reports.
#include <gtest/gtest.h>

#include "cai/sdk/overlap.hpp"

namespace cai::sdk {
namespace {

using Clock = OverlapMeter::Clock;
using std::chrono::milliseconds;

const Clock::time_point t0{};

TEST(OverlapMeter, NoReductions_ReportsZero) { EXPECT_EQ(OverlapMeter().ratio(), 0.0); }

// Launched at 0, the thread computes until 60, then waits until 100: 60% hidden.
TEST(OverlapMeter, WaitAfterCompute_HiddenShareOfTheWindow) {
  OverlapMeter m;
  m.Launched(t0);
  m.Launched(t0 + milliseconds(10));  // later launches do not move the window's start
  m.Waited(t0 + milliseconds(60), t0 + milliseconds(100));
  m.Completed(t0 + milliseconds(100));
  EXPECT_NEAR(m.ratio(), 0.6, 1e-12);
}

// Synchronous reductions (every one waited as it runs) hide nothing.
TEST(OverlapMeter, SynchronousReductions_ReportZero) {
  OverlapMeter m;
  m.Waited(t0, t0 + milliseconds(30));  // Wait opens the window itself
  m.Launched(t0);
  m.Waited(t0 + milliseconds(30), t0 + milliseconds(50));
  m.Completed(t0 + milliseconds(50));
  EXPECT_NEAR(m.ratio(), 0.0, 1e-12);
}

// Windows add up over steps; a discarded step (a failed micro-batch) counts nothing.
TEST(OverlapMeter, StepsAccumulate_DiscardedStepIgnored) {
  OverlapMeter m;
  m.Launched(t0);
  m.Waited(t0 + milliseconds(90), t0 + milliseconds(100));  // 90 of 100 hidden
  m.Completed(t0 + milliseconds(100));
  m.Launched(t0 + milliseconds(200));
  m.Waited(t0 + milliseconds(200), t0 + milliseconds(500));  // abandoned
  m.Discard();
  m.Completed(t0 + milliseconds(600));  // no open window: nothing
  m.Launched(t0 + milliseconds(1000));
  m.Waited(t0 + milliseconds(1050), t0 + milliseconds(1100));  // 50 of 100 hidden
  m.Completed(t0 + milliseconds(1100));
  EXPECT_NEAR(m.ratio(), 140.0 / 200.0, 1e-12);
}

// The real clock: a wait of ~20 ms after ~20 ms of "compute" lands between the extremes.
TEST(OverlapMeter, WaitOnTheRealClock_CountsItsTime) {
  OverlapMeter m;
  m.Launched();
  const Clock::time_point start = Clock::now();
  while (Clock::now() - start < milliseconds(20)) {
  }
  m.Wait([] {
    const Clock::time_point w = Clock::now();
    while (Clock::now() - w < milliseconds(20)) {
    }
  });
  m.Completed();
  EXPECT_GT(m.ratio(), 0.05);
  EXPECT_LT(m.ratio(), 0.95);
}

}  // namespace
}  // namespace cai::sdk
