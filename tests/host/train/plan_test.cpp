// `cai plan`: parameter counts from the config alone agree with the built model, and the
// strategy `auto` reports is the one `cai train` then uses.
#include "train/plan.h"

#include <gtest/gtest.h>

#include <filesystem>
#include <regex>

#include "model/model.h"
#include "util/subprocess.h"

namespace {

using cai::testing::RunCommand;

int64_t BuiltParams(const cai::ModelConfig& config) {
  auto model = cai::MakeZooModel(config, 1);
  int64_t total = 0;
  for (uint32_t i = 0; i < model->NumParams(); ++i) total += model->ParamInfo(i).numel;
  return total;
}

TEST(Plan, ZooModelSize_EqualsTheBuiltModelsParameterCount) {
  for (auto arch : {cai::ModelConfig::Arch::kGpt2, cai::ModelConfig::Arch::kLlama}) {
    for (bool bias : {true, false}) {
      cai::ModelConfig c;
      c.arch = arch;
      c.vocab_size = 300;
      c.n_ctx = 40;
      c.n_layer = 3;
      c.n_head = 4;
      c.n_kv_head = arch == cai::ModelConfig::Arch::kLlama ? 2 : 0;
      c.n_embd = 64;
      c.bias = bias;
      EXPECT_EQ(cai::ZooModelSize(c).params, BuiltParams(c))
          << (arch == cai::ModelConfig::Arch::kGpt2 ? "gpt2" : "llama") << " bias=" << bias;
    }
  }
}

TEST(Plan, Gpt2_124M_HasTheKnownParameterCount) {
  cai::ModelConfig c;                                 // defaults are GPT-2 small
  EXPECT_EQ(cai::ZooModelSize(c).params, 124439808);  // GPT-2 124M with tied embeddings
}

TEST(Plan, Cli_PrintsEveryStrategyAndAutosChoiceUsedByTrain) {
  auto plan =
      RunCommand(std::string("env -u CAI_PLUGIN_PATH -u CAI_PLUGIN_FILES HOME=/nonexistent ") +
                 CAI_EXE + " plan " + TINY_JOB + " --nproc 2");
  ASSERT_EQ(plan.code, 0) << plan.output;
  for (const char* s : {"ddp", "low_level_zero stage 1", "low_level_zero stage 2", "fsdp", "gemini",
                        "hybrid_parallel", "auto picks: "}) {
    CAI_EXPECT_CONTAINS(plan.output, s);
  }
  std::smatch m;
  ASSERT_TRUE(std::regex_search(plan.output, m, std::regex("auto picks: (\\S+)")));
  const std::string choice = m[1];

  char pattern[] = "/tmp/cai-plan-XXXXXX";
  std::filesystem::path dir = mkdtemp(pattern);
  auto train =
      RunCommand(std::string("env -u CAI_PLUGIN_PATH -u CAI_PLUGIN_FILES HOME=/nonexistent ") +
                 CAI_EXE + " train " + TINY_JOB + " --nproc 2 --run-dir " + dir.string() +
                 " --set plugin.name=auto --set train.steps=2");
  ASSERT_EQ(train.code, 0) << train.output;
  CAI_EXPECT_CONTAINS(train.output, "plugin.name = \"auto\" chose '" + choice + "'");
  CAI_EXPECT_CONTAINS(cai::testing::ReadFile((dir / "summary.json").string()),
                      "\"plugin\": \"" + choice + "\"");
  std::filesystem::remove_all(dir);

  auto single = RunCommand(std::string(CAI_EXE) + " plan " + TINY_JOB + " --nproc 1");
  CAI_EXPECT_CONTAINS(single.output, "auto picks: none");
}

}  // namespace
