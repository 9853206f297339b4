// The conformance suite's behaviour checks can fail: a plugin whose only bug is averaging
// gradients over ranks instead of summing them (c_replica built with CAI_REDUCE_AVG) trains
// exactly like the reference on 1 rank and must fail the 2-rank SGD check, the message saying
// at which step the loss differed and by how much; and without a `cai` program to train with
// they fail saying how to get one.
#include <gtest/gtest.h>

#include <iostream>
#include <string>

#include "util/subprocess.h"

namespace {

using cai::testing::RunCommand;

TEST(Conformance, GradientsAveragedOverRanks_FailTheTwoRankSgdCheck) {
  const auto check = RunCommand("'" CAI_EXE "' plugins check '" CAI_C_REPLICA_AVG_MANIFEST "'");
  std::cout << check.output;
  EXPECT_EQ(check.code, 1);
  CAI_EXPECT_CONTAINS(check.output,
                      "[ PASS ] trains like the reference on 1 rank (SGD, no clipping)");
  CAI_EXPECT_CONTAINS(check.output,
                      "[ FAIL ] trains like the reference on 2 ranks (SGD, no clipping): step 2 "
                      "loss: expected ");
  // Summed gradients have twice the averaged ones' norm from the first step on.
  CAI_EXPECT_CONTAINS(check.output, "step 1 grad_norm: expected ");
  CAI_EXPECT_CONTAINS(check.output, "runs in ");
}

TEST(Conformance, NoCaiProgram_BehaviourChecksFailSayingHowToGetOne) {
  const auto check =
      RunCommand("'" CAI_CONFORMANCE_EXE "' --cai /nonexistent/cai '" CAI_C_REPLICA_MANIFEST "'");
  EXPECT_EQ(check.code, 1) << check.output;
  CAI_EXPECT_CONTAINS(check.output,
                      "[ FAIL ] trains with `cai train` (behaviour checks): /nonexistent/cai does "
                      "not exist; install the cai package (the host) or pass --cai PATH");
  CAI_EXPECT_CONTAINS(
      check.output, "[ PASS ] manifest's [abi] min_host_minor is what the library needs: both 1.0");
}

}  // namespace
