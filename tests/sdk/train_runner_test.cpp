// The behaviour checks' comparison of two runs (sdk/conformance/src/train_runner.h) on runs
// made up here: what is compared, what is not (a NaN grad_norm), what replaces the weights when
// a strategy saves in its own layout, and what a difference says.
#include "train_runner.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <cmath>
#include <filesystem>
#include <string>
#include <vector>

#include "checkpoint/checkpoint.h"

namespace {

namespace fs = std::filesystem;
using cai::conformance::Compare;
using cai::conformance::Comparison;
using cai::conformance::Mismatch;
using cai::conformance::TrainRun;

class TempDir {
 public:
  TempDir() {
    char pattern[] = "/tmp/cai-train-runner-test-XXXXXX";
    path_ = mkdtemp(pattern);
  }
  ~TempDir() { fs::remove_all(path_); }
  const fs::path& path() const { return path_; }

 private:
  fs::path path_;
};

// A one-rank checkpoint of step `step` in `run_dir` holding `tensors` (fp32, 1-D).
fs::path SaveCheckpoint(const fs::path& run_dir, int64_t step,
                        const std::vector<std::pair<std::string, std::vector<float>>>& tensors) {
  cai::ckpt::CheckpointWriter writer(run_dir, step, 0, 1, "test");
  for (const auto& [name, values] : tensors) {
    int64_t numel = static_cast<int64_t>(values.size()), stride = 1;
    cai_tensor t{const_cast<float*>(values.data()),
                 {CAI_DEVICE_CPU, 0},
                 1,
                 {CAI_DTYPE_FLOAT, 32, 1},
                 &numel,
                 &stride,
                 0};
    EXPECT_EQ(cai::CheckpointApi()->write_tensor(writer.handle(), name.c_str(), &t), nullptr);
  }
  return writer.Commit([] {});
}

TrainRun MadeUpRun(std::vector<double> losses, std::vector<double> grad_norms, fs::path checkpoint,
                   double eval_loss = NAN) {
  TrainRun r;
  r.exit_code = 0;
  for (size_t i = 0; i < losses.size(); ++i) r.steps.push_back(static_cast<int64_t>(i) + 1);
  r.losses = std::move(losses);
  r.grad_norms = std::move(grad_norms);
  r.skipped.assign(r.losses.size(), false);
  r.checkpoint = std::move(checkpoint);
  r.eval_loss = eval_loss;
  return r;
}

TEST(TrainRunner, JsonNull_IsNaN) {
  EXPECT_TRUE(std::isnan(cai::conformance::JsonNumber(R"({"grad_norm": null})", "grad_norm")));
  EXPECT_EQ(cai::conformance::JsonNumber(R"({"grad_norm": 2.5})", "grad_norm"), 2.5);
}

TEST(TrainRunner, SameRuns_MatchWithZeroError) {
  TempDir dir;
  const fs::path ckpt = SaveCheckpoint(dir.path(), 2, {{"model/w", {1, 2, 3}}});
  const TrainRun run = MadeUpRun({5.0, 4.0}, {2.0, 1.5}, ckpt);
  const Comparison c = Compare(run, run, 1e-5);
  EXPECT_TRUE(c.ok()) << c.error;
  EXPECT_EQ(c.largest(), 0);
  EXPECT_EQ(c.tensors, 1u);
}

TEST(TrainRunner, LossOffAtStepTwo_NamesStepExpectedAndGot) {
  TempDir dir;
  const fs::path ckpt = SaveCheckpoint(dir.path(), 2, {{"model/w", {1, 2, 3}}});
  const Comparison c = Compare(MadeUpRun({5.0, 4.0}, {2.0, 1.5}, ckpt),
                               MadeUpRun({5.0, 4.4}, {2.0, 1.5}, ckpt), 1e-5);
  ASSERT_EQ(c.mismatches.size(), 1u);
  EXPECT_EQ(c.mismatches[0].Describe(),
            "step 2 loss: expected 4, got 4.4 (relative error 1.0e-01 > 1e-05)");
}

// Local SGD has no global gradient: NaN is reported as such, not compared.
TEST(TrainRunner, GradNormReportedAsNaN_IsNotComparedButSaidSo) {
  TempDir dir;
  const fs::path ckpt = SaveCheckpoint(dir.path(), 2, {{"model/w", {1, 2, 3}}});
  const Comparison c = Compare(MadeUpRun({5.0, 4.0}, {2.0, 1.5}, ckpt),
                               MadeUpRun({5.0, 4.0}, {NAN, NAN}, ckpt), 1e-5);
  EXPECT_TRUE(c.ok());
  EXPECT_EQ(c.grad_norms_not_reported, 2u);
  EXPECT_NE(c.Summary().find("grad_norm n/a: reported as NaN, no global gradient"),
            std::string::npos)
      << c.Summary();
}

TEST(TrainRunner, WeightsOff_NameTheTensorAndItsRelativeL2Error) {
  TempDir a, b;
  const fs::path expected = SaveCheckpoint(a.path(), 2, {{"model/w", {3, 4}}, {"model/b", {1}}});
  const fs::path got = SaveCheckpoint(b.path(), 2, {{"model/w", {3, 4.5}}, {"model/b", {1}}});
  const Comparison c = Compare(MadeUpRun({5.0, 4.0}, {2.0, 1.5}, expected),
                               MadeUpRun({5.0, 4.0}, {2.0, 1.5}, got), 1e-5);
  ASSERT_EQ(c.mismatches.size(), 1u);
  EXPECT_EQ(c.mismatches[0].kind, Mismatch::Kind::kWeights);
  EXPECT_EQ(c.mismatches[0].tensor, "model/w");
  EXPECT_DOUBLE_EQ(c.mismatches[0].error, 0.1);  // ||(0, 0.5)|| / ||(3, 4)||
  EXPECT_EQ(c.tensors, 2u);
}

// A strategy that saves in its own layout is compared through the final eval loss.
TEST(TrainRunner, CheckpointInItsOwnLayout_ComparesTheFinalEvalLoss) {
  TempDir a, b;
  const fs::path expected = SaveCheckpoint(a.path(), 2, {{"model/w", {3, 4}}});
  const fs::path got = SaveCheckpoint(b.path(), 2, {{"mine/w.0", {3}}, {"mine/w.1", {4}}});
  const Comparison same = Compare(MadeUpRun({5.0, 4.0}, {2.0, 1.5}, expected, 3.5),
                                  MadeUpRun({5.0, 4.0}, {2.0, 1.5}, got, 3.5), 1e-5);
  EXPECT_TRUE(same.ok()) << same.error;
  EXPECT_TRUE(same.weights_by_eval_loss);
  const Comparison off = Compare(MadeUpRun({5.0, 4.0}, {2.0, 1.5}, expected, 3.5),
                                 MadeUpRun({5.0, 4.0}, {2.0, 1.5}, got, 3.6), 1e-5);
  ASSERT_EQ(off.mismatches.size(), 1u);
  EXPECT_EQ(off.mismatches[0].kind, Mismatch::Kind::kEvalLoss);
}

// A resumed run reports only the steps after its checkpoint.
TEST(TrainRunner, ResumedRun_ComparesFromItsFirstStep) {
  TempDir dir;
  const fs::path ckpt = SaveCheckpoint(dir.path(), 3, {{"model/w", {1}}, {"optim/w/0", {2}}});
  const TrainRun whole = MadeUpRun({5.0, 4.0, 3.0}, {2.0, 1.5, 1.0}, ckpt);
  TrainRun resumed = MadeUpRun({3.0}, {1.0}, ckpt);
  resumed.steps = {3};
  const Comparison c = Compare(whole, resumed, 1e-5, 3, "");
  EXPECT_TRUE(c.ok()) << c.error;
  EXPECT_EQ(c.steps, 1u);
  EXPECT_EQ(c.tensors, 2u);  // every tensor, optimizer state included
  const Comparison wrong = Compare(whole, whole, 1e-5, 3, "");
  EXPECT_EQ(wrong.error, "expected steps 3 to 3 in metrics.jsonl, got 3 lines");
}

}  // namespace
