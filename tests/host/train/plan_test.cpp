// `cai plan`: parameter counts from the config alone agree with the built model, and the
// strategy `auto` reports is the one `cai train` then uses.
#include "train/plan.h"

#include <gtest/gtest.h>
#include <toml++/toml.h>

#include <filesystem>
#include <regex>

#include "loader/config.h"
#include "loader/registry.h"
#include "model/model.h"
#include "services/host_table.h"
#include "train/job.h"
#include "util/subprocess.h"

namespace {

using cai::testing::RunCommand;

// ZooModelSize, from the config alone, is the built model parameter by parameter: the count
// (Ψ), and the layout estimate_memory receives (each parameter's elements and unit, each unit's
// kind), for both architectures with and without biases, GQA and a given MLP width included.
TEST(Plan, ZooModelSize_IsTheBuiltModelParameterByParameter) {
  for (auto arch : {cai::ModelConfig::Arch::kGpt2, cai::ModelConfig::Arch::kLlama}) {
    for (bool bias : {true, false}) {
      for (int64_t ffn : {0, 96}) {
        cai::ModelConfig c;
        c.arch = arch;
        c.vocab_size = 300;
        c.n_ctx = 40;
        c.n_layer = 3;
        c.n_head = 4;
        c.n_kv_head = arch == cai::ModelConfig::Arch::kLlama ? 2 : 0;
        c.n_embd = 64;
        c.ffn_hidden = ffn;
        c.bias = bias;
        const std::string what =
            std::string(arch == cai::ModelConfig::Arch::kGpt2 ? "gpt2" : "llama") +
            " bias=" + std::to_string(bias) + " ffn_hidden=" + std::to_string(ffn);
        const cai::ModelSize size = cai::ZooModelSize(c);
        auto model = cai::MakeZooModel(c, 1);
        int64_t total = 0;
        std::vector<int64_t> numel;
        std::vector<int32_t> unit;
        for (uint32_t i = 0; i < model->NumParams(); ++i) {
          const cai_param_info info = model->ParamInfo(i);
          total += info.numel;
          if (info.tied_to >= 0) continue;
          numel.push_back(info.numel);
          unit.push_back(info.unit);
        }
        EXPECT_EQ(size.params, total) << what;
        EXPECT_EQ(size.param_numel, numel) << what;
        EXPECT_EQ(size.param_unit, unit) << what;
        std::vector<int32_t> kinds;
        for (uint32_t u = 0; u < model->NumUnits(); ++u) kinds.push_back(model->UnitInfo(u).kind);
        EXPECT_EQ(size.unit_kind, kinds) << what;
      }
    }
  }
}

TEST(Plan, Gpt2_124M_HasTheKnownParameterCount) {
  cai::ModelConfig c;                                 // defaults are GPT-2 small
  EXPECT_EQ(cai::ZooModelSize(c).params, 124439808);  // GPT-2 124M with tied embeddings
}

// An enforced device budget is what the plan sizes against, and the plan says what it counts.
TEST(Plan, Cli_EnforcedDeviceBudget_IsTheDeviceMemoryAndIsExplained) {
  auto plan =
      RunCommand(std::string("env -u CAI_PLUGIN_PATH -u CAI_PLUGIN_FILES HOME=/nonexistent ") +
                 CAI_EXE + " plan " + TINY_JOB + " --nproc 2 --set memory.device_budget=768MiB " +
                 "--set launch.device_memory_gib=2");
  ASSERT_EQ(plan.code, 0) << plan.output;
  CAI_EXPECT_CONTAINS(plan.output, "device memory per rank 768.0 MiB");
  CAI_EXPECT_CONTAINS(plan.output,
                      "memory.device_budget 768.0 MiB is enforced: the strategy's DEVICE buffers "
                      "and LibTorch's own tensors count against it together");
  CAI_EXPECT_CONTAINS(plan.output, "the budget is an accounting boundary");
}

TEST(Plan, Cli_PrintsEveryStrategyAndAutosChoiceUsedByTrain) {
  auto plan =
      RunCommand(std::string("env -u CAI_PLUGIN_PATH -u CAI_PLUGIN_FILES HOME=/nonexistent ") +
                 CAI_EXE + " plan " + TINY_JOB + " --nproc 2");
  ASSERT_EQ(plan.code, 0) << plan.output;
  for (const char* s : {"ddp", "low_level_zero (stage = 1)", "low_level_zero (stage = 2)",
                        "low_level_zero (stage = 2, cpu_offload = true)", "fsdp", "gemini",
                        "hybrid_parallel (pp_size = 2, zero_stage = 1)", "auto picks: "}) {
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

// The plan's figures are the plugins' own: each configuration's entry equals what the loaded
// plugin's estimate_memory returns for those options.
TEST(Plan, Estimates_AreThePluginsOwnForTheOptionsSized) {
  cai::JobConfig job = cai::LoadJob(TINY_JOB, {});
  const cai::Plan plan = cai::MakePlan(job, 2, {CAI_BUILD_PLUGIN_DIR}, cai::HostServicesTable());
  const cai::StrategyEstimate* offload = nullptr;
  for (const cai::StrategyEstimate& e : plan.estimates) {
    if (e.name == "low_level_zero (stage = 2, cpu_offload = true)") offload = &e;
  }
  ASSERT_NE(offload, nullptr);
  ASSERT_TRUE(offload->estimated);
  for (const cai::PluginRecord& r :
       cai::DiscoverPlugins(cai::PluginSearchPath({CAI_BUILD_PLUGIN_DIR}))) {
    if (r.manifest.name != "low_level_zero" || !r.error.empty()) continue;
    const cai::LoadedPlugin& plugin = cai::LoadPlugin(r.manifest, cai::HostServicesTable());
    toml::table table = toml::parse("stage = 2\ncpu_offload = true\n");
    auto config = cai::ValidateConfig(plugin.schema, &table, "test");
    cai_memory_estimate_args args{};
    args.struct_size = CAI_MEMORY_ESTIMATE_ARGS_STRUCT_SIZE;
    args.config = config.get();
    args.num_params = plan.size.params;
    args.largest_unit_numel = plan.size.largest_unit;
    args.world_size = 2;
    args.precision = CAI_PRECISION_FP32;
    args.optimizer_state_slots = 2;
    args.num_layout_params = static_cast<uint32_t>(plan.size.param_numel.size());
    args.param_numel = plan.size.param_numel.data();
    args.param_unit = plan.size.param_unit.data();
    args.num_layout_units = static_cast<uint32_t>(plan.size.unit_kind.size());
    args.unit_kind = plan.size.unit_kind.data();
    cai_memory_estimate out{};
    out.struct_size = CAI_MEMORY_ESTIMATE_STRUCT_SIZE;
    ASSERT_EQ(plugin.api->estimate_memory(&args, &out), nullptr);
    EXPECT_EQ(offload->device_bytes, out.device_bytes);
    EXPECT_EQ(offload->host_bytes, out.host_bytes);
    EXPECT_GT(out.host_bytes, 0u);
    return;
  }
  FAIL() << "low_level_zero is not installed beside the cai under test";
}

// With a device budget only low_level_zero stage 2 with cpu_offload fits, auto runs exactly
// that (stage 2, offload on), and keeps the options the user gave the plugin.
TEST(Plan, Auto_RunsTheConfigurationItSized) {
  char pattern[] = "/tmp/cai-auto-XXXXXX";
  std::filesystem::path dir = mkdtemp(pattern);
  // Ψ = 34688 fp32, Adam, one bucket: stage 2 needs 4Ψ parameters, a bucket's staging 4Ψ and
  // (4 + 8)Ψ/2 shards = 485,632 B per rank, with offload 346,880 B; 0.0004 GiB is 429,497 B.
  auto train =
      RunCommand(std::string("env -u CAI_PLUGIN_PATH -u CAI_PLUGIN_FILES HOME=/nonexistent ") +
                 CAI_EXE + " train " + TINY_JOB + " --nproc 2 --run-dir " + dir.string() +
                 " --set plugin.name=auto --set train.steps=2 --set launch.device_memory_gib=0.0004"
                 " --set plugin.low_level_zero.reduce_bucket_size_in_m=0.5");
  ASSERT_EQ(train.code, 0) << train.output;
  CAI_EXPECT_CONTAINS(train.output, "chose 'low_level_zero'");
  const std::string resolved = cai::testing::ReadFile((dir / "config.resolved.toml").string());
  CAI_EXPECT_CONTAINS(resolved, "name = \"low_level_zero\"");
  CAI_EXPECT_CONTAINS(resolved, "stage = 2");
  CAI_EXPECT_CONTAINS(resolved, "cpu_offload = true");
  CAI_EXPECT_CONTAINS(resolved, "reduce_bucket_size_in_m = 0.5");
  const std::string log = cai::testing::ReadFile((dir / "logs/rank-0.log").string());
  CAI_EXPECT_CONTAINS(log, "stage 2");
  CAI_EXPECT_CONTAINS(log, "masters and state offloaded to the host");
  std::filesystem::remove_all(dir);
}

}  // namespace
