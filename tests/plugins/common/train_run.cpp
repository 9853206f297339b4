#include "train_run.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstdlib>
#include <fstream>
#include <map>
#include <sstream>

#include "checkpoint/checkpoint.h"
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

std::string ReadFile(const fs::path& path) {
  std::ifstream in(path);
  std::stringstream text;
  text << in.rdbuf();
  return text.str();
}

namespace {

// Where the value of "key" starts in a JSON text, or npos.
size_t JsonValue(const std::string& json, const std::string& key, size_t from = 0) {
  size_t at = json.find("\"" + key + "\":", from);
  if (at == std::string::npos) return at;
  at += key.size() + 3;
  while (at < json.size() && json[at] == ' ') ++at;
  return at;
}

}  // namespace

double JsonNumber(const std::string& json, const std::string& key, size_t from) {
  const size_t at = JsonValue(json, key, from);
  return at == std::string::npos ? NAN : std::strtod(json.c_str() + at, nullptr);
}

TrainRun RunTrain(const fs::path& dir, const std::string& job, int nproc,
                  const std::vector<std::string>& sets, const std::string& manifest, bool resume,
                  const std::string& output_name) {
  if (!resume) {
    fs::remove_all(dir);
    fs::create_directories(dir);
    std::ofstream(dir / "job.toml") << job;
  }
  std::string command = "CAI_PLUGIN_FILES='" + manifest + "' '" CAI_EXE "' train '" +
                        (dir / "job.toml").string() + "' --nproc " + std::to_string(nproc) +
                        " --run-dir '" + (dir / "run").string() + "'";
  for (const std::string& s : sets) command += " --set '" + s + "'";
  command += " > '" + (dir / output_name).string() + "' 2>&1";
  TrainRun r;
  const int status = std::system(command.c_str());
  r.exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  r.output = ReadFile(dir / output_name);
  std::ifstream metrics(dir / "run" / "metrics.jsonl");
  for (std::string line; std::getline(metrics, line);) {
    r.losses.push_back(JsonNumber(line, "loss"));
    r.grad_norms.push_back(JsonNumber(line, "grad_norm"));
    const size_t skipped = JsonValue(line, "skipped");
    r.skipped.push_back(skipped != std::string::npos && line.compare(skipped, 4, "true") == 0);
  }
  r.summary = ReadFile(dir / "run" / "summary.json");
  if (auto latest = ckpt::FindLatestCheckpoint(dir / "run" / "checkpoints")) {
    r.checkpoint = *latest;
  }
  return r;
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

std::vector<float> ReadCheckpointTensor(const fs::path& checkpoint, const std::string& name) {
  ckpt::CheckpointReader reader(checkpoint);
  const cai_checkpoint_api& api = *CheckpointApi();
  cai_ckpt_tensor_info info{};
  info.struct_size = CAI_CKPT_TENSOR_INFO_STRUCT_SIZE;
  cai_status* status = api.tensor_info(reader.handle(), name.c_str(), &info);
  if (status) {
    ADD_FAILURE() << checkpoint << " has no tensor " << name;
    return {};
  }
  int64_t numel = 1;
  for (int32_t d = 0; d < info.ndim; ++d) numel *= info.shape[d];
  std::vector<float> values(static_cast<size_t>(numel));
  int64_t stride = 1;
  cai_tensor dst{
      values.data(), {CAI_DEVICE_CPU, 0}, 1, {CAI_DTYPE_FLOAT, 32, 1}, &numel, &stride, 0};
  EXPECT_EQ(api.read_tensor(reader.handle(), name.c_str(), 0, 0, &dst), nullptr) << name;
  return values;
}

std::vector<std::string> ModelTensorNames(const fs::path& checkpoint) {
  std::vector<std::string> names;
  ckpt::RankFileReader file(checkpoint / ckpt::RankFileName(0));
  for (const ckpt::Entry& e : file.entries()) {
    if (e.kind == ckpt::EntryKind::kTensor && e.name.rfind("model/", 0) == 0) {
      names.push_back(e.name);
    }
  }
  return names;
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
  ASSERT_EQ(ref.exit_code, 0) << ref.output;
  ASSERT_EQ(run.exit_code, 0) << run.output;
  ASSERT_FALSE(ref.losses.empty());
  ASSERT_EQ(run.losses.size(), ref.losses.size());
  for (size_t s = 0; s < ref.losses.size(); ++s) {
    EXPECT_NEAR(run.losses[s], ref.losses[s], rtol * std::abs(ref.losses[s]))
        << "loss of step " << s + 1;
  }
  ASSERT_FALSE(ref.checkpoint.empty()) << ref.output;
  ASSERT_FALSE(run.checkpoint.empty()) << run.output;
  const std::vector<std::string> names = ModelTensorNames(ref.checkpoint);
  ASSERT_FALSE(names.empty());
  for (const std::string& name : names) {
    const std::vector<float> a = ReadCheckpointTensor(run.checkpoint, name);
    const std::vector<float> b = ReadCheckpointTensor(ref.checkpoint, name);
    ASSERT_EQ(a.size(), b.size()) << name;
    double diff = 0, norm = 0;
    for (size_t i = 0; i < b.size(); ++i) {
      const double d = static_cast<double>(a[i]) - b[i];
      diff += d * d;
      norm += static_cast<double>(b[i]) * b[i];
    }
    EXPECT_LE(std::sqrt(diff), rtol * std::sqrt(norm))
        << name << ": relative L2 error " << std::sqrt(diff / norm);
  }
}

}  // namespace cai::testing
