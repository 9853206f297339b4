// `cai train` with checkpoint.at_start, `cai export` and model.init_from as users run them: the
// step-0 checkpoint of a run started from exported weights exports to the same bytes; and the
// model keys with PyTorch's and Hugging Face's defaults.
#include <gtest/gtest.h>
#include <unistd.h>

#include <filesystem>
#include <string>

#include "model/model.h"
#include "train/job.h"
#include "util/subprocess.h"
#include "util/temp_dir.h"

namespace {

namespace fs = std::filesystem;
using cai::testing::ReadFile;
using cai::testing::Result;
using cai::testing::RunCommand;

// Paths as strings: these tests put them into command lines.
class TempDir : public cai::testing::TempDir {
 public:
  TempDir() : cai::testing::TempDir("cai-interop-cli") {}
  std::string operator/(const std::string& name) const {
    return (cai::testing::TempDir::operator/(name)).string();
  }
};

Result Cai(const std::string& args) {
  return RunCommand(
      "env -u CAI_PLUGIN_PATH -u CAI_PLUGIN_FILES -u RANK -u WORLD_SIZE -u SLURM_PROCID "
      "-u OMPI_COMM_WORLD_RANK HOME=/nonexistent " +
      std::string(CAI_EXE) + " " + args);
}

TEST(Interop, AtStartThenExportThenInitFrom_ReproducesTheWeightsByteForByte) {
  for (const std::string model : {"--set model.kind=gpt2",
                                  "--set model.kind=llama "
                                  "--set model.n_kv_head=1"}) {
    TempDir dir;
    const std::string train =
        std::string("train ") + TINY_JOB + " " + model +
        " --set train.steps=1 --set train.eval_every=0 "
        "--set checkpoint.at_start=true --set checkpoint.at_end=true --run-dir ";
    const Result first = Cai(train + (dir / "a") + " --set train.seed=77");
    ASSERT_EQ(first.code, 0) << first.output;
    ASSERT_TRUE(fs::exists(dir / "a/checkpoints/step-000000/COMPLETE")) << first.output;
    const Result exported = Cai("export " + (dir / "a/checkpoints/step-000000") +
                                " --format safetensors " + (dir / "hf_a"));
    ASSERT_EQ(exported.code, 0) << exported.output;
    CAI_EXPECT_CONTAINS(ReadFile(dir / "hf_a/config.json"), "\"torch_dtype\": \"float32\"");

    // Another seed, the exported weights: its step-0 checkpoint holds them exactly.
    const Result second =
        Cai(train + (dir / "b") + " --set train.seed=5 --set model.init_from=" + (dir / "hf_a"));
    ASSERT_EQ(second.code, 0) << second.output;
    const Result again = Cai("export " + (dir / "b/checkpoints/step-000000") +
                             " --format safetensors " + (dir / "hf_b"));
    ASSERT_EQ(again.code, 0) << again.output;
    // (EXPECT_TRUE: the files are binary, and gtest would print them whole.)
    EXPECT_TRUE(ReadFile(dir / "hf_a/model.safetensors") ==
                ReadFile(dir / "hf_b/model.safetensors"));

    // The run directory stands for its latest checkpoint; trained weights differ from step 0.
    ASSERT_EQ(Cai("export " + (dir / "b") + " --format safetensors " + (dir / "hf_b1")).code, 0);
    EXPECT_TRUE(ReadFile(dir / "hf_a/model.safetensors") !=
                ReadFile(dir / "hf_b1/model.safetensors"));
    CAI_EXPECT_CONTAINS(ReadFile(dir / "hf_b1/model.safetensors").substr(0, 200),
                        "\"cai_step\": \"1\"");

    const Result imported = Cai("import " + (dir / "hf_a"));
    ASSERT_EQ(imported.code, 0) << imported.output;
    CAI_EXPECT_CONTAINS(imported.output, "[model]\n");
    CAI_EXPECT_CONTAINS(imported.output, "init_from = \"" + (dir / "hf_a") + "\"");
  }
}

// fsdp on 2 ranks saving its sharded layout and its full state dict: the same weights, put
// back together from the shards, export to the same bytes.
TEST(Interop, FsdpShardedAndFullCheckpoints_ExportTheSameBytes) {
  TempDir dir;
  for (const std::string type : {"sharded", "full"}) {
    const Result run =
        Cai(std::string("train ") + TINY_JOB +
            " --nproc 2 --set plugin.name=fsdp --set plugin.fsdp.state_dict_type=" + type +
            " --set train.steps=2 --set train.eval_every=0 "
            "--set checkpoint.at_end=true --run-dir " +
            (dir / type));
    ASSERT_EQ(run.code, 0) << run.output;
    const Result exported =
        Cai("export " + (dir / type) + " --format safetensors " + (dir / ("hf_" + type)));
    ASSERT_EQ(exported.code, 0) << exported.output;
  }
  EXPECT_TRUE(ReadFile(dir / "hf_sharded/model.safetensors") ==
              ReadFile(dir / "hf_full/model.safetensors"));
}

TEST(Interop, ModelKeys_LlamaWithoutBiasesUnlessAskedAndHfEpsilonsReachTheZoo) {
  const cai::JobConfig gpt2 = cai::LoadJob({}, {});
  EXPECT_TRUE(cai::ZooModelConfig(*gpt2.model).bias);
  EXPECT_EQ(cai::GetInt(*gpt2.model, "ignore_index"), -100);
  const cai::JobConfig llama = cai::LoadJob({}, {"model.kind=llama"});
  EXPECT_FALSE(cai::ZooModelConfig(*llama.model).bias);
  CAI_EXPECT_CONTAINS(llama.resolved_toml, "bias = false");  // what ran, for a rerun
  const cai::JobConfig biased =
      cai::LoadJob({}, {"model.kind=llama", "model.bias=true", "model.norm_eps=1e-6",
                        "model.rope_theta=500000.0", "model.init_std=0.01"});
  const cai::ModelConfig c = cai::ZooModelConfig(*biased.model);
  EXPECT_TRUE(c.bias);
  EXPECT_DOUBLE_EQ(c.norm_eps, 1e-6);
  EXPECT_DOUBLE_EQ(c.rope_theta, 500000.0);
  EXPECT_DOUBLE_EQ(c.init_std, 0.01);
}

TEST(Interop, ExportWithoutFormatOrJob_SaysWhatIsMissing) {
  TempDir dir;
  const Result no_format = Cai("export " + (dir / "x") + " " + (dir / "out"));
  EXPECT_NE(no_format.code, 0);
  CAI_EXPECT_CONTAINS(no_format.output, "--format is required");
  const Result missing = Cai("export " + (dir / "x") + " --format safetensors " + (dir / "out"));
  EXPECT_NE(missing.code, 0);
  CAI_EXPECT_CONTAINS(missing.output, "not a complete checkpoint");
}

}  // namespace
