// A rank killed (SIGKILL) at a random point of a checkpoint save leaves the last complete
// checkpoint intact: the run resumes from it and goes on as the uninterrupted reference does,
// within 1e-5 (loss and grad_norm of every step after the one it resumed from, every final
// tensor). 50 kills: ddp on 2 ranks saving every step, the killed rank and the point (a tensor
// or meta entry, the rank file's end, COMPLETE, the rename into place, `latest`) drawn from a
// seeded generator, so a failure names a case that reruns alike. The host's fault point
// (CAI_TEST_KILL_IN_SAVE, host/src/checkpoint) stops the rank where the save is.
#include <gtest/gtest.h>
#include <stdlib.h>
#include <unistd.h>

#include <algorithm>
#include <filesystem>
#include <random>
#include <regex>
#include <string>
#include <vector>

#include "checkpoint/rank_file.h"
#include "train_run.h"

namespace {

namespace fs = std::filesystem;

using cai::testing::TrainRun;

const std::vector<std::string> kSets = {"optimizer.decay_steps=6", "checkpoint.every=1"};
// 50 cases in 5 test processes (ctest runs them side by side), each counting the save points
// once.
constexpr int kShards = 5, kCasesPerShard = 10;

TrainRun Train(const fs::path& dir, int nproc, std::vector<std::string> sets, bool resume = false) {
  sets.insert(sets.begin(), kSets.begin(), kSets.end());
  return cai::testing::RunTrain(dir, cai::testing::kTinyGptJob, nproc, sets, CAI_DDP_MANIFEST,
                                resume, resume ? "resumed.txt" : "output.txt");
}

const TrainRun& Reference() {
  static const TrainRun run =
      Train(fs::path(CAI_RESUME_TEST_RUNS) / ("kill_reference_" + std::to_string(::getpid())), 1,
            {"plugin.name=none"});
  return run;
}

// Save points per rank over a whole run, from an uninterrupted ddp run's checkpoints: one per
// entry of the rank's file and one for finishing it, per save; rank 0 three more per save.
std::vector<long> SavePoints() {
  static const std::vector<long> points = [] {
    const TrainRun run =
        Train(fs::path(CAI_RESUME_TEST_RUNS) / ("kill_count_" + std::to_string(::getpid())), 2,
              {"plugin.name=ddp"});
    EXPECT_EQ(run.exit_code, 0) << run.output;
    std::vector<long> n(2, 0);
    for (const auto& step : fs::directory_iterator(run.checkpoint.parent_path())) {
      if (!std::regex_match(step.path().filename().string(), std::regex("step-[0-9]+"))) continue;
      for (int r = 0; r < 2; ++r) {
        n[r] +=
            static_cast<long>(cai::ckpt::RankFileReader(step.path() / cai::ckpt::RankFileName(r))
                                  .entries()
                                  .size()) +
            1 + (r == 0 ? 3 : 0);
      }
    }
    return n;
  }();
  return points;
}

// One case: kill, resume, compare.
void KillAndResume(int index, const std::vector<long>& points) {
  const TrainRun& reference = Reference();
  ASSERT_EQ(reference.exit_code, 0) << reference.output;
  std::mt19937 rng(1000 + index);
  const int rank = static_cast<int>(rng() % 2);
  const long point = 1 + static_cast<long>(rng() % static_cast<unsigned long>(points[rank]));
  const std::string where = std::to_string(rank) + ":" + std::to_string(point);
  SCOPED_TRACE("case " + std::to_string(index) + ": CAI_TEST_KILL_IN_SAVE=" + where + " of " +
               std::to_string(points[rank]));
  const fs::path dir = fs::path(CAI_RESUME_TEST_RUNS) / ("kill_" + std::to_string(index));

  ::setenv("CAI_TEST_KILL_IN_SAVE", where.c_str(), 1);
  const TrainRun killed = Train(dir, 2, {"plugin.name=ddp"});
  ::unsetenv("CAI_TEST_KILL_IN_SAVE");
  ASSERT_NE(killed.exit_code, 0) << "the run was not killed:\n" << killed.output;

  const TrainRun resumed =
      Train(dir, 2, {"plugin.name=ddp", "checkpoint.resume=true"}, /*resume=*/true);
  ASSERT_EQ(resumed.exit_code, 0) << resumed.output;
  // Steps after the checkpoint it resumed from (all of them when the kill came before the first
  // save completed) are the last lines of metrics.jsonl.
  std::smatch m;
  const bool from_checkpoint =
      std::regex_search(resumed.output, m, std::regex("resumed from .*\\(step ([0-9]+)"));
  // A kill after the last save's final point leaves nothing to run: its last step, logged
  // before the kill, and the checkpoint are compared.
  const int64_t from =
      std::min<int64_t>(from_checkpoint ? std::stoll(m[1]) + 1 : 1, reference.steps.back());
  const size_t tail = static_cast<size_t>(reference.steps.back() - from + 1);
  ASSERT_GE(resumed.steps.size(), tail) << resumed.output;
  TrainRun last = resumed;
  for (auto* v : {&last.losses, &last.grad_norms}) v->erase(v->begin(), v->end() - tail);
  last.steps.erase(last.steps.begin(), last.steps.end() - tail);
  last.skipped.erase(last.skipped.begin(), last.skipped.end() - tail);
  const cai::conformance::Comparison c =
      cai::conformance::Compare(reference, last, cai::conformance::Tolerance(1e-5), from);
  EXPECT_TRUE(c.ok()) << c.error << (c.mismatches.empty() ? "" : c.mismatches[0].Describe());
  std::printf("case %d: killed at %s of %ld; resumed from step %lld: %s\n", index, where.c_str(),
              points[rank], static_cast<long long>(from - 1), c.Summary().c_str());
}

class KillInSave : public ::testing::TestWithParam<int> {};

TEST_P(KillInSave, PreviousCheckpointLoadsAndTheRunResumesLikeTheReference) {
  const std::vector<long> points = SavePoints();
  ASSERT_GT(points[0], 0);
  ASSERT_GT(points[1], 0);
  for (int i = 0; i < kCasesPerShard; ++i) KillAndResume(GetParam() * kCasesPerShard + i, points);
}

INSTANTIATE_TEST_SUITE_P(Shards, KillInSave, ::testing::Range(0, kShards));

}  // namespace
