// sdk/examples/local_sgd end to end through `cai train`: with sync_every = 1 it is DDP exactly
// (the reference's losses, grad norms and weights, and ddp's), with any optimizer; with
// sync_every = 2 the odd steps are local (no global gradient: grad_norm null) and the replicas
// agree again after each even one.
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

// Both plugins discoverable: the reference is built in, ddp is the peer.
const std::string kPlugins = std::string(CAI_LOCAL_SGD_MANIFEST) + ":" + CAI_DDP_MANIFEST;

TrainRun Train(const std::string& name, int nproc, std::vector<std::string> sets,
               const std::string& plugin) {
  sets.push_back("plugin.name=" + plugin);
  return cai::testing::RunTrain(fs::path(CAI_LOCAL_SGD_TEST_RUNS) / name, cai::testing::kTinyGptJob,
                                nproc, sets, kPlugins);
}

// Plain SGD (scale-sensitive) on 2 and 3 ranks, 3 splitting 4 rows unevenly, and AdamW with
// clipping on 2, also with an unused and frozen parameters.
TEST(LocalSgd, SyncEveryStep_IsDdpExactly) {
  for (int nproc : {2, 3}) {
    SCOPED_TRACE(std::to_string(nproc) + " ranks");
    std::vector<std::string> sets = cai::testing::kPlainSgdSets;
    if (nproc == 3) sets.push_back("train.global_batch=4");
    const std::string n = std::to_string(nproc);
    const TrainRun ref = Train("sgd_ref" + n, 1, sets, "none");
    ExpectMatches(ref, Train("sgd_local" + n, nproc, sets, "local_sgd"), 1e-5);
    ExpectMatches(ref, Train("sgd_ddp" + n, nproc, sets, "ddp"), 1e-5);
  }
  ExpectMatches(Train("adamw_ref", 1, {}, "none"), Train("adamw_local", 2, {}, "local_sgd"), 1e-5);
  // A parameter no rank gives a gradient is left alone (torch.optim), frozen ones are kept.
  const std::vector<std::string> odd = {"model.unused_parameter=true",
                                        "model.freeze=blocks.0.attn.*"};
  ExpectMatches(Train("odd_ref", 1, odd, "none"), Train("odd_local", 2, odd, "local_sgd"), 1e-5);
}

TEST(LocalSgd, SyncEveryTwo_OddStepsAreLocal) {
  const std::vector<std::string> sets = {"plugin.local_sgd.sync_every=2"};
  const TrainRun run = Train("every2", 2, sets, "local_sgd");
  ASSERT_EQ(run.exit_code, 0) << run.output;
  ASSERT_EQ(run.grad_norms.size(), 6u);
  for (size_t s = 0; s < run.grad_norms.size(); ++s) {
    // Steps 1, 3, 5 are local: each rank stepped on its own gradient.
    EXPECT_EQ(std::isnan(run.grad_norms[s]), s % 2 == 0) << "step " << s + 1;
  }
  EXPECT_LT(run.losses.back(), run.losses.front());
  // Not DDP: local steps move the replicas apart, the average differs from the global step.
  const TrainRun ref = Train("every2_ref", 1, {}, "none");
  ASSERT_EQ(ref.exit_code, 0) << ref.output;
  EXPECT_GT(std::abs(run.losses[2] - ref.losses[2]), 1e-6 * ref.losses[2]);
}

}  // namespace
