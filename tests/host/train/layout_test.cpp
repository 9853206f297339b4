// The host under a strategy's parallel_layout (ABI 1.3), through `cai train` on real ranks with
// the paired fixtures (plugins/paired_replicas.cpp): replicas of two ranks that train on the same
// rows, one of each pair reporting the loss. Each run must match the single-process reference
// step by step (loss, grad_norm, eval loss, final weights): that holds only if the host gives
// both ranks of a replica the same rows, splits the batch over the replicas (not the ranks) and
// counts each replica's loss once. Tolerance 1e-5 relative, as the data-parallel strategies'
// fp32 parity (tests/plugins/ddp says why relative L2 per tensor).
#include <gtest/gtest.h>

#include <cmath>
#include <filesystem>
#include <string>
#include <vector>

#include "train_run.h"

namespace {

namespace fs = std::filesystem;
using cai::testing::ExpectMatches;
using cai::testing::TrainRun;

// Two micro-batches per step (so no_sync and the pipeline's micro-batches are exercised), and an
// evaluation every third step.
const std::vector<std::string> kSets = {"train.grad_accum=2", "train.global_batch=8",
                                        "train.eval_every=3", "train.eval_batches=2"};
constexpr double kFp32Tolerance = 1e-5;

TrainRun Train(const std::string& name, int nproc, const std::string& plugin,
               std::vector<std::string> sets = {}) {
  sets.insert(sets.begin(), kSets.begin(), kSets.end());  // later sets win
  sets.push_back("plugin.name=" + plugin);
  // A directory per test: ctest runs the tests in processes of their own, side by side, and
  // each runs its own reference.
  const fs::path dir = fs::path(CAI_LAYOUT_TEST_RUNS) /
                       ::testing::UnitTest::GetInstance()->current_test_info()->name() / name;
  return cai::testing::RunTrain(
      dir, cai::testing::kTinyGptJob, nproc, sets,
      std::string(CAI_PAIRED_REPLICAS_MANIFEST) + ":" + CAI_PAIRED_PIPELINE_MANIFEST);
}

const TrainRun& Reference() {
  static const TrainRun ref = Train("reference", 1, "none");
  return ref;
}

void ExpectMatchesReference(const TrainRun& run) {
  const TrainRun& ref = Reference();
  ASSERT_EQ(run.exit_code, 0) << run.command << "\n" << run.output;
  ExpectMatches(ref, run, kFp32Tolerance);
  ASSERT_FALSE(std::isnan(ref.eval_loss));
  EXPECT_NEAR(run.eval_loss, ref.eval_loss, kFp32Tolerance * ref.eval_loss);
  EXPECT_NE(run.output.find("data-parallel replica(s) of 2 rank(s)"), std::string::npos)
      << run.output;
}

// data_parallel_size 1: both ranks take the whole batch. Split by world rank, each would see
// half of it; counted on both ranks, the loss would double.
TEST(ParallelLayout, TwoRanksOneReplica_MatchesReference) {
  ExpectMatchesReference(Train("paired2", 2, "paired_replicas"));
}

// data_parallel_size 2: ranks 0 and 1 take the first half of each batch, ranks 2 and 3 the
// second; ranks 0 and 2 report.
TEST(ParallelLayout, FourRanksTwoReplicas_MatchesReference) {
  ExpectMatchesReference(Train("paired4", 4, "paired_replicas"));
}

// Through execute_pipeline: one call per step with the replica's two micro-batches, whose
// args.loss only the reporting rank fills (the other writes -1, which must not count); the
// fixture fails if forward_backward or no_sync is called.
TEST(ParallelLayout, Pipelined_OneCallPerStep_MatchesReference) {
  ExpectMatchesReference(Train("pipeline2", 2, "paired_pipeline"));
}

// A layout the host cannot honour is refused after boost, the same way on every rank, naming
// what is wrong.
TEST(ParallelLayout, BadLayouts_AreRefusedNamingTheFault) {
  struct Case {
    std::string name, set, message;
  };
  const std::vector<Case> cases = {
      {"no_pipeline", "plugin.paired_replicas.pipelines=true",
       "strategy 'paired_replicas' (parallel_layout): it asks for execute_pipeline (pipelines = "
       "true) but lacks CAI_CAP_PIPELINE or execute_pipeline"},
      {"indivisible", "plugin.paired_replicas.data_parallel_size=3",
       "rank 0 reports data_parallel_size 3, which does not divide the world of 2 ranks"},
      {"two_reporters", "plugin.paired_replicas.every_rank_reports=true",
       "replica 0 has 2 ranks with reports_loss; exactly one must report, or its loss is "
       "counted more than once"},
      {"too_few_rows", "train.global_batch=1",
       "data-parallel replica 0 (of 1) holds 1 sequences of the global batch but "
       "train.grad_accum = 2; raise train.global_batch to at least 2 or lower train.grad_accum"},
  };
  for (const Case& c : cases) {
    const TrainRun run = Train("bad_" + c.name, 2, "paired_replicas", {c.set});
    EXPECT_NE(run.exit_code, 0) << c.name;
    EXPECT_NE(run.output.find(c.message), std::string::npos) << c.name << ":\n" << run.output;
  }
}

}  // namespace
