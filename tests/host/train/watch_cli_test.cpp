// What a user watches, as users run it: `cai train`'s summary and step lines (a progress bar on a
// terminal only), and `cai report` drawing real runs, or refusing bad input clearly.
#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <regex>
#include <string>

#include "util/subprocess.h"
#include "util/temp_dir.h"

namespace {

namespace fs = std::filesystem;
using cai::testing::ReadFile;
using cai::testing::Result;
using cai::testing::RunCommand;

const char* const kEnv =
    "env -u CAI_PLUGIN_PATH -u CAI_PLUGIN_FILES -u RANK -u WORLD_SIZE -u SLURM_PROCID "
    "-u OMPI_COMM_WORLD_RANK HOME=/nonexistent ";

Result Cai(const std::string& args, const std::string& env = "") {
  return RunCommand(kEnv + env + " " + CAI_EXE + " " + args);
}

std::string TinyTrain(const fs::path& run_dir) {
  return std::string("train ") + TINY_JOB + " --set train.steps=3 --set train.eval_every=0 " +
         "--run-dir " + run_dir.string();
}

bool OnPath(const std::string& program) {
  return RunCommand("command -v " + program + " >/dev/null").code == 0;
}

// Two tiny runs of the reference, trained once for every test of the suite.
class Report : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    dir_ = new cai::testing::TempDir("cai-report");
    for (const char* name : {"alpha", "beta"}) {
      const Result r = Cai(TinyTrain(*dir_ / name));
      ASSERT_EQ(r.code, 0) << r.output;
    }
  }
  static void TearDownTestSuite() {
    delete dir_;
    dir_ = nullptr;
  }
  static std::string Run(const std::string& name) { return (*dir_ / name).string(); }
  static cai::testing::TempDir* dir_;
};
cai::testing::TempDir* Report::dir_ = nullptr;

TEST_F(Report, TwoRuns_OneSvgNamingBothWithTheirStrategy) {
  if (!OnPath("gnuplot")) GTEST_SKIP() << "gnuplot not installed (apt-get install gnuplot-nox)";
  const std::string out = Run("both.svg");
  const Result r = Cai("report " + Run("alpha") + " " + Run("beta") + " -o " + out);
  ASSERT_EQ(r.code, 0) << r.output;
  CAI_EXPECT_CONTAINS(r.output, "report of 2 runs in " + out);
  const std::string svg = ReadFile(out);
  CAI_EXPECT_CONTAINS(svg, "<svg");
  CAI_EXPECT_CONTAINS(svg, "</svg>");
  CAI_EXPECT_CONTAINS(svg, "alpha (none)");
  CAI_EXPECT_CONTAINS(svg, "beta (none)");
  CAI_EXPECT_CONTAINS(svg, "peak memory per rank");
}

TEST_F(Report, Png_IsAPng) {
  if (!OnPath("gnuplot")) GTEST_SKIP() << "gnuplot not installed (apt-get install gnuplot-nox)";
  const std::string out = Run("alpha.png");
  const Result r = Cai("report " + Run("alpha") + " --output " + out);
  ASSERT_EQ(r.code, 0) << r.output;
  EXPECT_EQ(ReadFile(out).substr(1, 3), "PNG");
}

TEST_F(Report, WithoutGnuplot_NamesThePackageToInstall) {
  const Result r = Cai("report " + Run("alpha") + " -o " + Run("x.svg"), "PATH=/nonexistent");
  EXPECT_NE(r.code, 0);
  CAI_EXPECT_CONTAINS(r.output, "gnuplot, which is not on PATH");
  CAI_EXPECT_CONTAINS(r.output, "apt-get install gnuplot-nox");
}

TEST_F(Report, BadInput_SaysWhichFileOrArgumentAndWhatToDo) {
  if (!OnPath("gnuplot")) GTEST_SKIP() << "gnuplot not installed; it is checked first";
  fs::create_directories(*dir_ / "empty");
  fs::create_directories(*dir_ / "broken");
  fs::copy_file(*dir_ / "alpha/metrics.jsonl", *dir_ / "broken/metrics.jsonl");
  std::ofstream(*dir_ / "broken/summary.json") << "{\"plugin\": ";
  const struct {
    std::string args, message;
  } cases[] = {
      {"report " + Run("empty"), Run("empty/metrics.jsonl") + ": not found"},
      {"report " + Run("nowhere"), Run("nowhere") + ": no such directory"},
      {"report " + Run("broken"), Run("broken/summary.json") + ": malformed JSON"},
      {"report " + Run("alpha") + " --bogus", "unknown option '--bogus'"},
      {"report " + Run("alpha") + " -o out.pdf", "-o out.pdf: the image is drawn as SVG or PNG"},
      {"report " + Run("alpha") + " -o", "-o needs a file name"},
      {"report", "needs a run directory"},
  };
  for (const auto& c : cases) {
    const Result r = Cai(c.args);
    EXPECT_NE(r.code, 0) << c.args;
    CAI_EXPECT_CONTAINS(r.output, "cai: error: " + c.message);
  }
}

// The summary replaces the ~60-line resolved configuration: Ψ, the strategy, where the
// configuration went; and without a terminal the steps are plain log lines, MFU unknown.
TEST(Watch, Train_PrintsAShortSummaryAndPlainStepLinesWithoutATerminal) {
  cai::testing::TempDir dir("cai-watch");
  const Result r = Cai(TinyTrain(dir / "run"));
  ASSERT_EQ(r.code, 0) << r.output;
  const size_t begin = r.output.find("cai: training\n");
  const size_t end = r.output.find("config.resolved.toml", begin);
  ASSERT_NE(begin, std::string::npos) << r.output;
  ASSERT_NE(end, std::string::npos) << r.output;
  const std::string summary = r.output.substr(begin, end - begin);
  CAI_EXPECT_CONTAINS(summary, "Ψ          34688 parameters");
  CAI_EXPECT_CONTAINS(summary, "strategy   none");
  EXPECT_LT(std::count(summary.begin(), summary.end(), '\n'), 25) << summary;
  EXPECT_EQ(r.output.find("[optimizer]"), std::string::npos) << r.output;
  EXPECT_EQ(r.output.find('\r'), std::string::npos) << r.output;
  CAI_EXPECT_CONTAINS(r.output, "[info] step 1/3  loss ");
  CAI_EXPECT_CONTAINS(r.output, "MFU –");
}

// On a terminal (a pseudo-terminal from script(1)) the step line is rewritten in place.
TEST(Watch, Train_OnATerminal_UpdatesTheStepLineInPlaceWithMfu) {
  if (!OnPath("script")) GTEST_SKIP() << "script(1) (util-linux) not installed";
  cai::testing::TempDir dir("cai-watch");
  const Result r = RunCommand("script -qec '" + std::string(kEnv) + CAI_EXE + " " +
                              TinyTrain(dir / "run") + " --set train.peak_flops=1e12' /dev/null");
  ASSERT_EQ(r.code, 0) << r.output;
  CAI_EXPECT_CONTAINS(r.output, "\r[########................] step 1/3  loss ");
  CAI_EXPECT_CONTAINS(r.output, "\r[########################] step 3/3  loss ");
  EXPECT_EQ(r.output.find("[info] step 1/3"), std::string::npos) << r.output;
  CAI_EXPECT_CONTAINS(ReadFile((dir / "run/metrics.jsonl").string()), "\"mfu\": ");
}

// Under the local launcher the ranks write to pipes, but the launcher's terminal still gets rank
// 0's bar as it changes, tagged like every line of the ranks.
TEST(Watch, TrainTwoRanks_OnATerminal_UpdatesRankZerosStepLineInPlace) {
  if (!OnPath("script")) GTEST_SKIP() << "script(1) (util-linux) not installed";
  cai::testing::TempDir dir("cai-watch");
  const Result r =
      RunCommand("script -qec '" + std::string(kEnv) + CAI_EXE + " " + TinyTrain(dir / "run") +
                 " --nproc 2 --set plugin.name=ddp' /dev/null");
  ASSERT_EQ(r.code, 0) << r.output;
  // The launcher draws the last bar of what it read at once: under load two steps can arrive
  // together, so which steps get a bar of their own is not fixed, only that one is redrawn.
  EXPECT_TRUE(
      std::regex_search(r.output, std::regex(R"(\r\[rank 0\] \[#+\.*\] step [1-3]/3  loss )")))
      << r.output;
  CAI_EXPECT_CONTAINS(r.output, "[rank 0] [########################] step 3/3  loss ");
  EXPECT_EQ(r.output.find("[info] step 1/3"), std::string::npos) << r.output;
}

}  // namespace
