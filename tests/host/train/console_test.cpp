// What `cai train` prints for the user to watch: the step line, its progress-bar form, MFU and
// the run summary, as functions; tests/host/train/report_cli_test.cpp runs them end to end.
#include "train/console.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>

#include "util/subprocess.h"

namespace {

cai::StepLine Line(int64_t step, double mfu) {
  cai::StepLine line;
  line.step = step;
  line.steps = 8;
  line.loss = 5.4321;
  line.lr = 3e-3;
  line.tokens_per_s = 1234;
  line.mfu = mfu;
  line.eta_s = 65;
  return line;
}

TEST(Console, StepLine_ShowsMfuOrADashWhenThePeakIsUnknown) {
  EXPECT_EQ(cai::FormatStepLine(Line(3, 0.4123)),
            "step 3/8  loss 5.4321  lr 3.00e-03  1234 tok/s  MFU 41.2%  ETA 1m5s");
  EXPECT_EQ(cai::FormatStepLine(Line(3, NAN)),
            "step 3/8  loss 5.4321  lr 3.00e-03  1234 tok/s  MFU –  ETA 1m5s");
}

TEST(Console, ProgressBar_OverwritesInPlaceAndEndsTheLineAfterTheLastStep) {
  const std::string middle = cai::FormatProgressBar(Line(4, NAN));
  EXPECT_EQ(middle.rfind("\r[############............] step 4/8", 0), 0u) << middle;
  EXPECT_EQ(middle.find('\n'), std::string::npos);
  const std::string last = cai::FormatProgressBar(Line(8, NAN));
  EXPECT_EQ(last.rfind("\r[########################] step 8/8", 0), 0u) << last;
  EXPECT_EQ(last.back(), '\n');
}

// PaLM's 6Ψ + 12·L·H·T, and MFU over every rank's peak.
TEST(Console, Mfu_IsModelFlopsOverThePeakOfEveryRank) {
  EXPECT_DOUBLE_EQ(cai::ModelFlopsPerToken(1000, 2, 32, 64), 6000.0 + 12.0 * 2 * 32 * 64);
  EXPECT_DOUBLE_EQ(cai::ModelFlopsPerToken(1000, 0, 32, 64), 6000.0);
  EXPECT_DOUBLE_EQ(cai::ModelFlopsUtilization(1e6, 100, 1e9, 2), 0.05);
  EXPECT_TRUE(std::isnan(cai::ModelFlopsUtilization(1e6, 100, 0, 2)));
}

TEST(Console, RunSummary_FitsOnAScreenAndNamesTheResolvedConfiguration) {
  cai::RunSummary s;
  s.model = "gpt2 n_layer=2";
  s.params = 34688;
  s.strategy = "low_level_zero";
  s.strategy_options = "stage = 2\ncpu_offload = true\n";
  s.world_size = 2;
  s.precision = "bf16";
  s.memory = cai::RunSummary::Memory{3u << 20, 1u << 20, "(2+2+12)Ψ/N"};
  s.run_dir = "runs/x";
  const std::string text = cai::FormatRunSummary(s);
  CAI_EXPECT_CONTAINS(text, "Ψ          34688 parameters");
  CAI_EXPECT_CONTAINS(text, "strategy   low_level_zero (stage = 2, cpu_offload = true)");
  CAI_EXPECT_CONTAINS(text, "3.0 MiB device + 1.0 MiB host per rank");
  CAI_EXPECT_CONTAINS(text, "set train.peak_flops");
  CAI_EXPECT_CONTAINS(text, "runs/x/config.resolved.toml");
  EXPECT_LT(std::count(text.begin(), text.end(), '\n'), 25) << text;
}

}  // namespace
