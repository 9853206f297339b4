#include "train_run.h"

#include <gtest/gtest.h>

#include <algorithm>

#include "checkpoint/rank_file.h"

namespace cai::testing {

namespace fs = std::filesystem;

const char* const kTinyGptJob = R"(
[model]
kind = "gpt2"
n_layer = 2
n_head = 2
n_embd = 32
n_ctx = 32

[optimizer]
kind = "adamw"
lr = 0.003
weight_decay = 0.1
no_decay_lr = 0.001
no_decay_weight_decay = 0.01
max_grad_norm = 0.05
warmup_steps = 2

[train]
steps = 6
global_batch = 6
seq_len = 16
seed = 7
eval_every = 0
eval_batches = 1
threads = 1

[checkpoint]
at_end = true
)";

const std::vector<std::string> kPlainSgdSets = {
    "optimizer.kind=sgd",        "optimizer.lr=0.5",         "optimizer.momentum=0",
    "optimizer.weight_decay=0",  "optimizer.no_decay_lr=0",  "optimizer.no_decay_weight_decay=0",
    "optimizer.max_grad_norm=0", "optimizer.warmup_steps=0", "optimizer.min_lr_ratio=1"};

TrainRun RunTrain(const fs::path& dir, const std::string& job, int nproc,
                  const std::vector<std::string>& sets, const std::string& manifest, bool resume,
                  const std::string& output_name) {
  return conformance::RunTrain({.cai = CAI_EXE,
                                .dir = dir,
                                .job = job,
                                .nproc = nproc,
                                .sets = sets,
                                .plugin_files = manifest,
                                .resume = resume,
                                .output_name = output_name});
}

std::vector<double> PerRank(const TrainRun& run, const std::string& object,
                            const std::string& field) {
  std::vector<double> values;
  const std::string key = "\"" + object + "\":";
  for (size_t at = run.summary.find(key); at != std::string::npos;
       at = run.summary.find(key, at + 1)) {
    values.push_back(JsonNumber(run.summary, field, at));
  }
  return values;
}

void ExpectWireBytes(const TrainRun& run, const std::string& op, double factor) {
  const std::vector<double> handed = PerRank(run, "comm_bytes_per_step_mean", op);
  const std::vector<double> wire = PerRank(run, "wire_bytes_per_step_mean", op);
  ASSERT_FALSE(handed.empty()) << run.summary;
  ASSERT_EQ(wire.size(), handed.size()) << run.summary;
  for (size_t r = 0; r < handed.size(); ++r) {
    const double algorithm = factor * handed[r];
    EXPECT_GE(wire[r], 0.999 * algorithm) << op << " on rank " << r << ", handed " << handed[r];
    EXPECT_LE(wire[r], 1.05 * algorithm) << op << " on rank " << r << ", handed " << handed[r];
  }
}

bool Mentions(const std::vector<std::string>& sets, const std::string& part) {
  return std::any_of(sets.begin(), sets.end(),
                     [&](const std::string& s) { return s.find(part) != std::string::npos; });
}

namespace {

// `peak_keys`: the peak_bytes tiers whose peaks the estimate covers, summed.
void ExpectEstimateIsThePeak(const TrainRun& run, const std::string& estimate_key,
                             const std::vector<std::string>& peak_keys) {
  if (run.exit_code != 0) return;
  const std::vector<double> estimate = PerRank(run, "memory_estimate_per_rank", estimate_key);
  ASSERT_EQ(estimate.size(), 1u) << run.summary;
  std::vector<double> peaks;
  for (const std::string& key : peak_keys) {
    const std::vector<double> tier = PerRank(run, "peak_bytes", key);
    ASSERT_FALSE(tier.empty()) << key << "\n" << run.summary;
    peaks.resize(tier.size(), 0);
    for (size_t r = 0; r < tier.size(); ++r) peaks[r] += tier[r];
  }
  for (size_t r = 0; r < peaks.size(); ++r) {
    EXPECT_GE(peaks[r], estimate[0]) << estimate_key << ", rank " << r << "\n" << run.summary;
    EXPECT_LE(peaks[r], estimate[0] + 64) << estimate_key << ", rank " << r << "\n" << run.summary;
  }
}

}  // namespace

void ExpectEstimateIsTheDevicePeak(const TrainRun& run) {
  ExpectEstimateIsThePeak(run, "device_bytes", {"device"});
}

void ExpectEstimateIsTheHostPeak(const TrainRun& run) {
  ExpectEstimateIsThePeak(run, "host_bytes", {"host", "pinned_host"});
}

std::vector<float> ReadCheckpointTensor(const fs::path& checkpoint, const std::string& name) {
  try {
    return conformance::ReadCheckpointTensor(checkpoint, name);
  } catch (const std::exception& e) {
    ADD_FAILURE() << e.what();
    return {};
  }
}

double ModelElements(const fs::path& checkpoint) {
  double bytes = 0;
  ckpt::RankFileReader file(checkpoint / ckpt::RankFileName(0));
  for (const ckpt::Entry& e : file.entries()) {
    if (e.kind == ckpt::EntryKind::kTensor && e.name.rfind("model/", 0) == 0) {
      bytes += static_cast<double>(e.bytes);
    }
  }
  return bytes / 4;
}

void ExpectMatches(const TrainRun& ref, const TrainRun& run, double rtol) {
  ExpectMatches(ref, run, conformance::Tolerance(rtol));
}

void ExpectMatches(const TrainRun& ref, const TrainRun& run, conformance::Tolerance tolerance) {
  ASSERT_EQ(ref.exit_code, 0) << ref.output;
  ASSERT_EQ(run.exit_code, 0) << run.output;
  const conformance::Comparison c = conformance::Compare(ref, run, tolerance);
  ASSERT_TRUE(c.error.empty()) << c.error;
  EXPECT_FALSE(c.weights_by_eval_loss) << run.checkpoint << " has no model/* tensors";
  EXPECT_EQ(c.grad_norms_not_reported, 0u) << "the strategy reported no grad_norm";
  for (const conformance::Mismatch& m : c.mismatches) ADD_FAILURE() << m.Describe();
  // The margin each test's bound leaves, in its log.
  std::printf("compared with the reference: %s\n", c.Summary().c_str());
}

}  // namespace cai::testing
