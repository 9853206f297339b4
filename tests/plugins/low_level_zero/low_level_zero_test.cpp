// libcai_low_level_zero end to end: `cai train` on 1, 2 and 3 real ranks (subprocesses over
// Gloo), each compared with the single-process reference (`plugin.name=none`) on the same job —
// same global batch, same initial weights — on every step's loss and on the final checkpoint's
// "model/*" tensors; then its memory and communication volume from summary.json, checkpoints
// saved on N ranks and resumed on M, and its configuration errors.
//
// Tolerance (fp32): 1e-5 relative, losses against the reference's, weights by relative L2 error
// per tensor (tests/plugins/ddp/ddp_parity_test.cpp says why not element by element). bf16 and
// fp16 bounds are stated at their tests.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <string>
#include <vector>

#include "train_run.h"

namespace {

namespace fs = std::filesystem;
using cai::testing::ExpectMatches;
using cai::testing::kTinyGptJob;
using cai::testing::ModelElements;
using cai::testing::ModelTensorNames;
using cai::testing::PerRank;
using cai::testing::ReadCheckpointTensor;
using cai::testing::TrainRun;

constexpr double kFp32Tolerance = 1e-5;

fs::path RunDir(const std::string& name) { return fs::path(CAI_ZERO_TEST_RUNS) / name; }

TrainRun Reference(const std::string& name, std::vector<std::string> sets) {
  sets.push_back("plugin.name=none");
  return cai::testing::RunTrain(RunDir(name + "_ref"), kTinyGptJob, 1, sets, CAI_ZERO_MANIFEST);
}

// The estimate (`cai plan`'s) is each tier's measured peak, except where the run holds less or
// more than it can know: model.freeze (frozen parameters stay out of the buckets), no
// checkpoint (the estimate counts one: checkpoint.at_end is on by default) and gradient
// accumulation (stage 2 then keeps an fp32 shard; the estimate is for one micro-batch).
void ExpectEstimateIsThePeak(const TrainRun& run, const std::vector<std::string>& sets) {
  if (cai::testing::Mentions(sets, "model.freeze") ||
      cai::testing::Mentions(sets, "checkpoint.at_end=false") ||
      cai::testing::Mentions(sets, "train.grad_accum")) {
    return;
  }
  cai::testing::ExpectEstimateIsTheDevicePeak(run);
  cai::testing::ExpectEstimateIsTheHostPeak(run);
}

// `options` are keys of [plugin.low_level_zero] ("stage=2").
TrainRun Zero(const std::string& name, int nproc, const std::vector<std::string>& options,
              std::vector<std::string> sets = {}) {
  sets.push_back("plugin.name=low_level_zero");
  for (const std::string& o : options) sets.push_back("plugin.low_level_zero." + o);
  TrainRun run = cai::testing::RunTrain(RunDir(name + "_zero" + std::to_string(nproc)), kTinyGptJob,
                                        nproc, sets, CAI_ZERO_MANIFEST);
  ExpectEstimateIsThePeak(run, sets);
  return run;
}

// Elements each rank owns of a model with one bucket: ceil(Ψ / N).
double ShardElements(double psi, int nproc) { return std::ceil(psi / nproc); }

// GPT-2 ties lm_head to wte; clipping is active in every step.
TEST(LowLevelZero, Stage1_OneTwoThreeRanks_MatchReference) {
  const TrainRun ref = Reference("stage1", {});
  for (int nproc : {1, 2, 3}) {
    SCOPED_TRACE("ranks: " + std::to_string(nproc));
    const TrainRun zero = Zero("stage1", nproc, {"stage=1"});
    ExpectMatches(ref, zero, kFp32Tolerance);
    for (double norm : zero.grad_norms) EXPECT_GT(norm, 0.05);
  }
}

// Scale-sensitive: plain SGD without momentum, clipping or warmup (train_run.h), both stages;
// 3 ranks split 4 rows 2+1+1.
TEST(LowLevelZero, PlainSgd_TwoAndThreeRanksBothStages_MatchReference) {
  for (int nproc : {2, 3}) {
    std::vector<std::string> sets = cai::testing::kPlainSgdSets;
    if (nproc == 3) sets.push_back("train.global_batch=4");
    const TrainRun ref = Reference("sgd" + std::to_string(nproc), sets);
    for (int stage : {1, 2}) {
      SCOPED_TRACE("stage " + std::to_string(stage) + ", ranks: " + std::to_string(nproc));
      ExpectMatches(
          ref,
          Zero("sgd_s" + std::to_string(stage), nproc, {"stage=" + std::to_string(stage)}, sets),
          kFp32Tolerance);
    }
  }
}

// Buckets of 4096 elements: the model needs several (wte alone exceeds one), reduce-scatters
// overlap backward with at most three buckets' staging held (two in flight, one collecting;
// wte's gradient is ready a bucket early), and the plugin's max_norm
// replaces optimizer.max_grad_norm.
TEST(LowLevelZero, Stage2_SmallBucketsOneTwoThreeRanks_MatchReference) {
  const TrainRun ref = Reference("stage2", {});
  for (int nproc : {1, 2, 3}) {
    SCOPED_TRACE("ranks: " + std::to_string(nproc));
    ExpectMatches(
        ref,
        Zero("stage2", nproc, {"stage=2", "reduce_bucket_size_in_m=0.00390625", "max_norm=0.05"},
             {"optimizer.max_grad_norm=0"}),
        kFp32Tolerance);
  }
}

// Communication after backward instead of during it, fp32 reduction named explicitly, and the
// parameter all-gather left in flight until the next forward (or evaluation, or checkpoint).
TEST(LowLevelZero, NoOverlapAndAsyncAllGather_MatchReference) {
  const TrainRun ref = Reference("overlap", {});
  ExpectMatches(ref,
                Zero("overlap_s1", 2,
                     {"stage=1", "overlap_communication=false", "overlap_allgather=true",
                      "communication_dtype=\"fp32\""}),
                kFp32Tolerance);
  ExpectMatches(
      ref,
      Zero("overlap_s2", 3, {"stage=2", "overlap_allgather=true", "reduce_bucket_size_in_m=0.01"}),
      kFp32Tolerance);
}

// Masters and optimizer state on the host tier, updated by the host's CPU optimizer from a
// pinned copy of the gradient shard.
TEST(LowLevelZero, CpuOffloadStage1AndStage2_MatchReference) {
  const TrainRun ref = Reference("offload", {});
  for (int stage : {1, 2}) {
    for (int nproc : {2, 3}) {
      SCOPED_TRACE("stage " + std::to_string(stage) + ", ranks: " + std::to_string(nproc));
      ExpectMatches(ref,
                    Zero("offload_s" + std::to_string(stage), nproc,
                         {"stage=" + std::to_string(stage), "cpu_offload=true",
                          "reduce_bucket_size_in_m=0.01"}),
                    kFp32Tolerance);
    }
  }
}

// A frozen attention block stays out of the shards; the zoo's unused parameter gets a gradient
// on no rank: its slots reduce as zeros and, as in the reference (torch.optim skips a parameter
// without .grad), it is not updated — no weight decay either.
TEST(LowLevelZero, FrozenAndUnusedParameters_MatchReference) {
  const std::vector<std::string> sets = {"model.freeze=blocks.0.attn.*",
                                         "model.unused_parameter=true"};
  const TrainRun ref = Reference("frozen", sets);
  for (int stage : {1, 2}) {
    const int nproc = stage + 1;
    SCOPED_TRACE("stage " + std::to_string(stage) + ", ranks: " + std::to_string(nproc));
    const TrainRun zero =
        Zero("frozen_s" + std::to_string(stage), nproc, {"stage=" + std::to_string(stage)}, sets);
    ExpectMatches(ref, zero, kFp32Tolerance);
    ASSERT_FALSE(zero.checkpoint.empty());
    for (float v : ReadCheckpointTensor(zero.checkpoint, "model/unused.weight")) {
      EXPECT_EQ(v, 0.02f) << "the unused parameter changed";
    }
    // Frozen weights are model state: every checkpoint holds them, unchanged by training.
    const std::vector<std::string> names = ModelTensorNames(ref.checkpoint);
    EXPECT_EQ(std::count(names.begin(), names.end(), "model/blocks.0.attn.qkv.weight"), 1);
    EXPECT_EQ(ReadCheckpointTensor(zero.checkpoint, "model/blocks.0.attn.qkv.weight"),
              ReadCheckpointTensor(ref.checkpoint, "model/blocks.0.attn.qkv.weight"));
  }
}

// 4 micro-batches per step. Stage 1 accumulates the full gradient under no_sync and reduces it
// once per step; stage 2 keeps only its slice, so it reduce-scatters every micro-batch: 4x the
// reduce-scatter volume (what ColossalAI's stage 2 would cost, had it not refused no_sync).
TEST(LowLevelZero, Accumulation_Stage1ReducesOncePerStepStage2EveryMicroBatch) {
  const std::vector<std::string> sets = {"train.global_batch=16", "train.grad_accum=4"};
  const TrainRun ref = Reference("accum", sets);
  const TrainRun s1 = Zero("accum_s1", 2, {"stage=1"}, sets);
  const TrainRun s2 = Zero("accum_s2", 2, {"stage=2"}, sets);
  ExpectMatches(ref, s1, kFp32Tolerance);
  ExpectMatches(ref, s2, kFp32Tolerance);
  const double padded = 2 * ShardElements(ModelElements(ref.checkpoint), 2);
  for (double bytes : PerRank(s1, "comm_bytes_per_step_mean", "reduce_scatter")) {
    EXPECT_EQ(bytes, 4 * padded);
  }
  for (double bytes : PerRank(s2, "comm_bytes_per_step_mean", "reduce_scatter")) {
    EXPECT_EQ(bytes, 4 * 4 * padded);
  }
}

// ZeRO-1/2 move Ψ reduced + Ψ gathered per step (ZeRO paper §7, Rajbhandari et al. 2020):
// each rank hands reduce-scatter its whole padded gradient and all-gather its 1/N chunk, so
// over N ranks Ψ elements are gathered. Tolerance: with one bucket the padding is below N
// elements; beyond that only the control all-reduce of 8·(2 + tensors) bytes (global norm,
// overflow flag, per-tensor "got a gradient").
TEST(LowLevelZero, CommunicationPerStep_IsPsiReducedAndPsiGathered) {
  const TrainRun ref = Reference("bytes", {});
  ASSERT_EQ(ref.exit_code, 0) << ref.output;
  const double psi = ModelElements(ref.checkpoint);
  const double tensors = static_cast<double>(ModelTensorNames(ref.checkpoint).size());
  struct Case {
    int nproc;
    int stage;
    const char* precision;
    double element;
  };
  for (const Case& c : {Case{2, 2, "fp32", 4}, Case{3, 1, "bf16", 2}, Case{3, 2, "fp32", 4}}) {
    SCOPED_TRACE("stage " + std::to_string(c.stage) + ", " + c.precision + ", ranks " +
                 std::to_string(c.nproc));
    const TrainRun zero =
        Zero(std::string("bytes_s") + std::to_string(c.stage) + c.precision, c.nproc,
             {"stage=" + std::to_string(c.stage)}, {std::string("train.precision=") + c.precision});
    ASSERT_EQ(zero.exit_code, 0) << zero.output;
    const double shard = ShardElements(psi, c.nproc);
    EXPECT_LT(c.nproc * shard - psi, c.nproc);
    const std::vector<double> reduced = PerRank(zero, "comm_bytes_per_step_mean", "reduce_scatter");
    const std::vector<double> gathered = PerRank(zero, "comm_bytes_per_step_mean", "all_gather");
    const std::vector<double> control = PerRank(zero, "comm_bytes_per_step_mean", "all_reduce");
    ASSERT_EQ(reduced.size(), static_cast<size_t>(c.nproc)) << zero.summary;
    for (int r = 0; r < c.nproc; ++r) {
      EXPECT_EQ(reduced[r], c.element * c.nproc * shard) << "rank " << r;
      EXPECT_EQ(gathered[r], c.element * shard) << "rank " << r;
      EXPECT_EQ(control[r], 8 * (2 + tensors)) << "rank " << r;
    }
    // On the wire, measured: the reduce-scatter's ring sends (N-1)/N of its input, not an
    // all-reduce's 2(N-1)/N; the all-gather's N-1 times its shard.
    cai::testing::ExpectWireBytes(zero, "reduce_scatter", (c.nproc - 1.0) / c.nproc);
    cai::testing::ExpectWireBytes(zero, "all_gather", c.nproc - 1.0);
  }
}

// Per-rank model-state memory, from the memory pool's accounting (each figure is the size of
// the pool buffers the plugin holds; the tiers' peaks bound them). bf16 stage 2 on 3 ranks,
// AdamW (k = 2 state slots), one bucket, shard S = ceil(Ψ/3) (padding below one element per
// rank): optimizer state 8S, masters 4S (so 12Ψ/N + at most 12 bytes), gradient shard 2S,
// parameters 2Ψ (+ padding). The device tier's peak is these plus the one bucket's staging
// (2·3S) or the control values. With cpu_offload masters and state are the host tier's only
// buffers: its peak equals them exactly.
TEST(LowLevelZero, Memory_OptimizerStateAndMastersAreShardedPerRank) {
  const TrainRun ref = Reference("memory", {});
  ASSERT_EQ(ref.exit_code, 0) << ref.output;
  const double psi = ModelElements(ref.checkpoint);
  const double tensors = static_cast<double>(ModelTensorNames(ref.checkpoint).size());
  const double s3 = ShardElements(psi, 3);
  const TrainRun bf16 =
      Zero("memory_bf16", 3, {"stage=2"}, {"train.precision=bf16", "checkpoint.at_end=false"});
  ASSERT_EQ(bf16.exit_code, 0) << bf16.output;
  const auto state = PerRank(bf16, "strategy_bytes", "optimizer_state");
  const auto master = PerRank(bf16, "strategy_bytes", "master");
  const auto grads = PerRank(bf16, "strategy_bytes", "grads");
  const auto params = PerRank(bf16, "strategy_bytes", "params");
  const auto device = PerRank(bf16, "peak_bytes", "device");
  ASSERT_EQ(state.size(), 3u) << bf16.summary;
  for (int r = 0; r < 3; ++r) {
    SCOPED_TRACE("rank " + std::to_string(r));
    EXPECT_EQ(state[r], 8 * s3);
    EXPECT_EQ(master[r], 4 * s3);
    EXPECT_LE(state[r] + master[r], 12 * psi / 3 + 12);
    EXPECT_EQ(grads[r], 2 * s3);
    EXPECT_EQ(params[r], 2 * 3 * s3);
    const double held = state[r] + master[r] + grads[r] + params[r];
    EXPECT_GE(device[r], held);
    EXPECT_LE(device[r], held + std::max(2 * 3 * s3, 8 * (2 + tensors)));
  }

  const TrainRun offload =
      Zero("memory_offload", 2, {"stage=1", "cpu_offload=true"}, {"checkpoint.at_end=false"});
  ASSERT_EQ(offload.exit_code, 0) << offload.output;
  const double s2 = ShardElements(psi, 2);
  const auto host = PerRank(offload, "peak_bytes", "host");
  const auto off_state = PerRank(offload, "strategy_bytes", "optimizer_state");
  const auto off_master = PerRank(offload, "strategy_bytes", "master");
  ASSERT_EQ(host.size(), 2u) << offload.summary;
  for (int r = 0; r < 2; ++r) {
    SCOPED_TRACE("offload rank " + std::to_string(r));
    EXPECT_EQ(off_state[r], 8 * s2);
    EXPECT_EQ(off_master[r], 4 * s2);
    EXPECT_EQ(host[r], off_state[r] + off_master[r]);
  }
}

// Resumes `name`'s run directory (saved at step 3) on `nproc` ranks up to step 6.
TrainRun Resume(const std::string& name, int saved_nproc, int nproc,
                std::vector<std::string> sets) {
  sets.push_back("plugin.name=low_level_zero");
  sets.push_back("checkpoint.resume=true");
  TrainRun run =
      cai::testing::RunTrain(RunDir(name + "_zero" + std::to_string(saved_nproc)), kTinyGptJob,
                             nproc, sets, CAI_ZERO_MANIFEST, /*resume=*/true, "resumed.txt");
  ExpectEstimateIsThePeak(run, sets);
  return run;
}

// The checkpoint is the canonical per-parameter layout, so one saved on 2 ranks resumes on 3
// and one saved on 3 on 1, each continuing as an uninterrupted reference run. The second
// saves from offloaded masters and resumes without offload.
TEST(LowLevelZero, Checkpoint_SavedOnTwoResumesOnThreeAndSavedOnThreeResumesOnOne) {
  const std::vector<std::string> sets = {"optimizer.decay_steps=6"};
  const TrainRun ref = Reference("resume", sets);
  std::vector<std::string> first = sets;
  first.push_back("train.steps=3");

  std::vector<std::string> s2 = first;
  s2.push_back("plugin.low_level_zero.stage=2");
  ASSERT_EQ(Zero("resume_2to3", 2, {}, s2).exit_code, 0);
  std::vector<std::string> s2_resume = sets;
  s2_resume.push_back("plugin.low_level_zero.stage=2");
  const TrainRun to3 = Resume("resume_2to3", 2, 3, s2_resume);
  ASSERT_EQ(to3.exit_code, 0) << to3.output;
  EXPECT_NE(to3.output.find("saved by 2 ranks"), std::string::npos) << to3.output;
  ExpectMatches(ref, to3, kFp32Tolerance);

  std::vector<std::string> s1 = first;
  s1.push_back("plugin.low_level_zero.cpu_offload=true");
  ASSERT_EQ(Zero("resume_3to1", 3, {}, s1).exit_code, 0);
  const TrainRun to1 = Resume("resume_3to1", 3, 1, sets);
  ASSERT_EQ(to1.exit_code, 0) << to1.output;
  EXPECT_NE(to1.output.find("saved by 3 ranks"), std::string::npos) << to1.output;
  ExpectMatches(ref, to1, kFp32Tolerance);
}

// bf16 against the reference in bf16: the reference reduces nothing, ZeRO sums bf16 buckets
// over ranks, so gradients differ by bf16 rounding, which the fp32 masters carry on. The bounds
// are DDP's (train_run.h; ddp_parity_test.cpp says why AdamW's per tensor is loose), with AdamW
// at 2 ranks and plain SGD at 3. master_weights = false trains the bf16 values directly; it only
// has to train.
TEST(LowLevelZero, Bf16_MatchesReferenceWithinBf16Rounding) {
  const std::vector<std::string> sets = {"train.precision=bf16"};
  std::vector<std::string> sgd = cai::testing::kPlainSgdSets;
  sgd.push_back("train.precision=bf16");
  sgd.push_back("optimizer.lr=0.05");  // a rate at which the loss falls steadily
  const TrainRun ref = Reference("bf16", sets), ref_sgd = Reference("bf16_sgd", sgd);
  for (int stage : {1, 2}) {
    SCOPED_TRACE("stage " + std::to_string(stage));
    const std::string s = std::to_string(stage);
    ExpectMatches(ref, Zero("bf16_s" + s, 2, {"stage=" + s}, sets), cai::testing::kBf16AdamW);
    ExpectMatches(ref_sgd, Zero("bf16_sgd_s" + s, 3, {"stage=" + s}, sgd), cai::testing::kBf16Sgd);
  }
  const TrainRun lowp = Zero("bf16_nomaster", 3, {"stage=2", "master_weights=false"}, sets);
  ASSERT_EQ(lowp.exit_code, 0) << lowp.output;
  EXPECT_LT(lowp.losses.back(), lowp.losses.front());
  EXPECT_EQ(PerRank(lowp, "strategy_bytes", "master"), std::vector<double>(3, 0.0));
}

// fp16 with dynamic loss scaling from a scale too large for the tiny model's gradients: the
// first steps overflow on some shard, are skipped on every rank and back the scale off at the
// same steps as the reference; then training proceeds (losses within 1e-4, fp16's bound in
// the DDP tests).
TEST(LowLevelZero, Fp16_LossScalingSkipsTheStepsTheReferenceSkips) {
  const std::vector<std::string> sets = {"train.precision=fp16", "train.steps=8"};
  std::vector<std::string> ref_sets = sets, zero_sets = sets;
  for (const char* key : {"initial_scale=1048576", "hysteresis=1"}) {
    ref_sets.push_back(std::string("plugin.none.") + key);
    zero_sets.push_back(std::string("plugin.low_level_zero.") + key);
  }
  const TrainRun ref = Reference("fp16", ref_sets);
  const TrainRun zero = Zero("fp16", 3, {"stage=2"}, zero_sets);
  ASSERT_EQ(ref.exit_code, 0) << ref.output;
  EXPECT_TRUE(ref.skipped.front()) << "the first step should overflow at scale 2^20";
  EXPECT_FALSE(ref.skipped.back()) << "the scale should have backed off by the last step";
  ExpectMatches(ref, zero, cai::testing::kFp16AdamW);
}

// Each bad configuration fails before training, saying which key and what to do.
TEST(LowLevelZero, BadConfig_FailsWithAClearError) {
  struct Case {
    std::vector<std::string> options;
    std::vector<std::string> sets;
    std::vector<std::string> expected;
  };
  const std::vector<Case> cases = {
      {{"stage=3"}, {}, {"stage", "3"}},
      {{"reduce_bucket_size=1"}, {}, {"reduce_bucket_size_in_m"}},
      {{"communication_dtype=\"int8\""}, {}, {"communication_dtype", "bf16"}},
      {{"cpu_offload=true", "master_weights=false"}, {}, {"master_weights = false"}},
      {{"max_norm=1.0"}, {}, {"max_norm", "optimizer.max_grad_norm", "set only one"}},
      {{"min_scale=8", "max_scale=4"}, {}, {"min_scale 8", "exceeds max_scale 4"}},
  };
  for (size_t i = 0; i < cases.size(); ++i) {
    const TrainRun run = Zero("bad" + std::to_string(i), 1, cases[i].options, cases[i].sets);
    EXPECT_NE(run.exit_code, 0) << run.output;
    for (const std::string& text : cases[i].expected) {
      EXPECT_NE(run.output.find(text), std::string::npos)
          << "case " << i << ": no '" << text << "' in:\n"
          << run.output;
    }
  }
}

}  // namespace
