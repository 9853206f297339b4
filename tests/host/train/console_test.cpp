// What `cai train` prints for the user to watch: the step line, its progress-bar form, MFU and
// the run summary, as functions; tests/host/train/report_cli_test.cpp runs them end to end.
#include "train/console.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <vector>

#include "core/strings.h"
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

// A line wider than the terminal would wrap, and the carriage return would then redraw only its
// last row: the bar narrows, then goes, then the line is cut, always short of the last column.
TEST(Console, ProgressBar_FitsTheTerminalWidth) {
  const std::string line = cai::FormatStepLine(Line(4, NAN));  // 63 columns
  auto shown = [](const std::string& bar) {
    return bar.substr(1, bar.find_last_not_of(" \n"));  // without "\r" and the padding
  };
  const std::string wide = cai::FormatProgressBar(Line(4, NAN), 120);
  EXPECT_EQ(shown(wide), "[############............] " + line);
  EXPECT_EQ(cai::Columns(wide) - 1, 119u) << "padded to the width less one column";

  const std::string narrow = cai::FormatProgressBar(Line(4, NAN), 80);
  EXPECT_EQ(shown(narrow), "[######.......] " + line);  // 79 - 63 - 3 = 13 columns of bar
  EXPECT_EQ(cai::Columns(narrow) - 1, 79u);

  const std::string bare = cai::FormatProgressBar(Line(4, NAN), 70);
  EXPECT_EQ(shown(bare), line) << "no room for a bar of 6";

  const std::string cut = cai::FormatProgressBar(Line(8, NAN), 40);
  EXPECT_EQ(shown(cut), std::string(cai::FitColumns(cai::FormatStepLine(Line(8, NAN)), 39)));
  EXPECT_EQ(cut.back(), '\n');
  EXPECT_LE(cai::Columns(cut) - 2, 39u);
}

// PaLM's 6Ψ + 12·L·H·T, and MFU over every rank's peak.
TEST(Console, Mfu_IsModelFlopsOverThePeakOfEveryRank) {
  EXPECT_DOUBLE_EQ(cai::ModelFlopsPerToken(1000, 2, 32, 64), 6000.0 + 12.0 * 2 * 32 * 64);
  EXPECT_DOUBLE_EQ(cai::ModelFlopsPerToken(1000, 0, 32, 64), 6000.0);
  EXPECT_DOUBLE_EQ(cai::ModelFlopsUtilization(1e6, 100, 1e9, 2), 0.05);
  EXPECT_TRUE(std::isnan(cai::ModelFlopsUtilization(1e6, 100, 0, 2)));
}

// Tables only looked up do not count: positions, and a token embedding no unit reads as its
// matrix (an untied head); GPT-2's tied head reads its embedding, which then counts.
TEST(Console, MatmulParams_LeaveOutTablesOnlyLookedUp) {
  auto param = [](cai_param_role role, int64_t numel) {
    cai_param_info info{};
    info.role = role;
    info.numel = numel;
    return info;
  };
  const std::vector<cai_param_info> params = {
      param(CAI_ROLE_EMBEDDING, 1000), param(CAI_ROLE_POS_EMBEDDING, 100),
      param(CAI_ROLE_ATTN_QKV, 30), param(CAI_ROLE_NORM, 2), param(CAI_ROLE_LM_HEAD, 1000)};
  const uint32_t embedding = 0;
  cai_unit_info tied_head{};
  tied_head.num_reads = 1;
  tied_head.reads = &embedding;
  EXPECT_EQ(cai::MatmulParams(params, std::vector<cai_unit_info>{tied_head}), 2032);
  EXPECT_EQ(cai::MatmulParams(params, std::vector<cai_unit_info>{cai_unit_info{}}), 1032);
  EXPECT_EQ(cai::MatmulParams(params, {}), 1032);
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
  EXPECT_EQ(text.find("budget "), std::string::npos);  // none set, none shown
  s.device_budget = 3u << 30;
  CAI_EXPECT_CONTAINS(cai::FormatRunSummary(s),
                      "budget     3.00 GiB device per rank for buffers and LibTorch's tensors "
                      "together (memory.device_budget)");
}

}  // namespace
