// A checkpoint saved by one strategy resumes under every other, at another world size, with
// its optimizer state: the run saves after 3 of 6 steps, the other strategy loads it and trains
// steps 4-6, and every step's loss and grad_norm and every final tensor agree with the
// uninterrupted single-process reference within 1e-5 (fp32; AdamW's moments and the lr
// schedule must carry over for steps 4-6 to agree). The job freezes a block's MLP and has an
// unused parameter, so frozen and never-updated tensors cross strategies too.
//
// fsdp's sharded checkpoints hold no canonical tensor of a trainable parameter; the host reads
// those through the layout's index (host/src/checkpoint), so every strategy loads them.
//
// World sizes rotate over 1, 2 and 3 so that each loader meets each world size and no pair
// loads at the world size it saved with unless the rotation lands there.
#include <gtest/gtest.h>
#include <unistd.h>

#include <filesystem>
#include <string>
#include <vector>

#include "train_run.h"

namespace {

namespace fs = std::filesystem;

using cai::testing::ExpectMatches;
using cai::testing::TrainRun;

struct Strategy {
  const char* name;  // names the test and run directories
  std::vector<std::string> sets;
};

const std::vector<Strategy>& Strategies() {
  static const std::vector<Strategy> all = {
      {"none", {"plugin.name=none"}},
      {"ddp", {"plugin.name=ddp", "plugin.ddp.find_unused_parameters=true"}},
      {"zero1", {"plugin.name=low_level_zero", "plugin.low_level_zero.stage=1"}},
      {"zero2", {"plugin.name=low_level_zero", "plugin.low_level_zero.stage=2"}},
      {"fsdp_full", {"plugin.name=fsdp", "plugin.fsdp.sharding_strategy=FULL_SHARD"}},
      // Shard groups of one rank, replicated across the others: each replica's rank 0 holds
      // every shard, the layout furthest from FULL_SHARD's.
      {"fsdp_hybrid",
       {"plugin.name=fsdp", "plugin.fsdp.sharding_strategy=HYBRID_SHARD",
        "plugin.fsdp.shard_group_size=1"}},
  };
  return all;
}

std::vector<std::string> JobSets(const Strategy& s, std::vector<std::string> extra) {
  std::vector<std::string> sets = {"optimizer.decay_steps=6", "model.freeze=blocks.0.mlp.*",
                                   "model.unused_parameter=true"};
  sets.insert(sets.end(), s.sets.begin(), s.sets.end());
  sets.insert(sets.end(), extra.begin(), extra.end());
  return sets;
}

TrainRun Train(const fs::path& dir, int nproc, const std::vector<std::string>& sets,
               bool resume = false) {
  return cai::testing::RunTrain(dir, cai::testing::kTinyGptJob, nproc, sets, CAI_MATRIX_MANIFESTS,
                                resume, resume ? "resumed.txt" : "output.txt");
}

const TrainRun& Uninterrupted() {
  static const TrainRun run =
      Train(fs::path(CAI_MATRIX_TEST_RUNS) / ("uninterrupted_" + std::to_string(::getpid())), 1,
            JobSets(Strategies()[0], {}));
  return run;
}

class ResumeMatrix : public ::testing::TestWithParam<size_t> {};

TEST_P(ResumeMatrix, EveryStrategyResumesThisOnesCheckpoint_MatchesUninterruptedRun) {
  const TrainRun& whole = Uninterrupted();
  ASSERT_EQ(whole.exit_code, 0) << whole.output;
  const size_t i = GetParam();
  const Strategy& saver = Strategies()[i];
  const int saved_on = 1 + static_cast<int>(i % 3);
  for (size_t j = 0; j < Strategies().size(); ++j) {
    const Strategy& loader = Strategies()[j];
    const int resumed_on =
        loader.name == std::string("none") ? 1 : 1 + static_cast<int>((i + j + 1) % 3);
    const std::string pair = std::string(saver.name) + "_" + std::to_string(saved_on) + "_to_" +
                             loader.name + "_" + std::to_string(resumed_on);
    SCOPED_TRACE(pair);
    const fs::path dir = fs::path(CAI_MATRIX_TEST_RUNS) / pair;
    const TrainRun first = Train(dir, saved_on, JobSets(saver, {"train.steps=3"}));
    ASSERT_EQ(first.exit_code, 0) << first.output;
    // fsdp saves its sharded layout (the default) as the saver; as the loader it writes the
    // canonical one at the end, which the comparison with the reference reads.
    std::vector<std::string> resume = {"checkpoint.resume=true"};
    if (loader.sets[0] == "plugin.name=fsdp") resume.push_back("plugin.fsdp.state_dict_type=full");
    const TrainRun resumed = Train(dir, resumed_on, JobSets(loader, resume), /*resume=*/true);
    ASSERT_EQ(resumed.exit_code, 0) << resumed.output;
    EXPECT_NE(resumed.output.find("(step 3, saved by " + std::to_string(saved_on)),
              std::string::npos)
        << resumed.output;
    ExpectMatches(whole, resumed, 1e-5);
  }
}

INSTANTIATE_TEST_SUITE_P(Savers, ResumeMatrix, ::testing::Range<size_t>(0, 6),
                         [](const ::testing::TestParamInfo<size_t>& info) {
                           return std::string(Strategies()[info.param].name);
                         });

}  // namespace
