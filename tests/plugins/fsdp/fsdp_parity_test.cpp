// libcai_fsdp end to end: `cai train` on 1, 2 and 3 real ranks (subprocesses over Gloo), each
// compared with the single-process reference (`plugin.name=none`) on the same job: every
// step's loss, and the final checkpoint's "model/*" tensors by relative L2 error (why not
// element by element: see tests/plugins/ddp/ddp_parity_test.cpp). fp32 tolerance 1e-5.
//
// The job: tiny GPT-2 (its lm_head is tied to wte), two parameter groups with their own LR
// and weight decay, clipping at a norm every step exceeds, warmup into cosine decay. With 2
// and 3 ranks no unit divides evenly, so every shard carries padding.
//
// Communication and memory are asserted exactly from the layout rule (a unit of Ψ_u elements
// is padded to N·ceil(Ψ_u/N)) and the byte counters / pool peaks in summary.json.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <sstream>
#include <string>
#include <vector>

#include "checkpoint/checkpoint.h"
#include "checkpoint/rank_file.h"

namespace {

namespace fs = std::filesystem;

struct RunResult {
  int exit_code = -1;
  std::string output;
  std::vector<double> losses;
  std::vector<double> grad_norms;
  fs::path checkpoint;
  std::string summary;
};

std::string ReadFile(const fs::path& path) {
  std::ifstream in(path);
  std::stringstream text;
  text << in.rdbuf();
  return text.str();
}

double JsonNumber(const std::string& json, const std::string& key, size_t from = 0) {
  size_t at = json.find("\"" + key + "\":", from);
  if (at == std::string::npos) return NAN;
  return std::strtod(json.c_str() + at + key.size() + 3, nullptr);
}

const char* const kBaseJob = R"(
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
steps = 5
global_batch = 6
seq_len = 16
seed = 7
eval_every = 0
eval_batches = 1
threads = 1

[checkpoint]
at_end = true
)";

std::string Command(const fs::path& dir, int nproc, const std::vector<std::string>& sets) {
  std::string command = "CAI_PLUGIN_FILES='" CAI_FSDP_MANIFEST "' '" CAI_EXE "' train '" +
                        (dir / "job.toml").string() + "' --nproc " + std::to_string(nproc) +
                        " --run-dir '" + (dir / "run").string() + "'";
  for (const std::string& s : sets) command += " --set '" + s + "'";
  return command;
}

RunResult Collect(const fs::path& dir, int status, const std::string& output_file) {
  RunResult r;
  r.exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  r.output = ReadFile(dir / output_file);
  std::ifstream metrics(dir / "run" / "metrics.jsonl");
  for (std::string line; std::getline(metrics, line);) {
    r.losses.push_back(JsonNumber(line, "loss"));
    r.grad_norms.push_back(JsonNumber(line, "grad_norm"));
  }
  r.summary = ReadFile(dir / "run" / "summary.json");
  if (auto latest = cai::ckpt::FindLatestCheckpoint(dir / "run" / "checkpoints")) {
    r.checkpoint = *latest;
  }
  return r;
}

// Each test's runs in a folder of its own: ctest runs the tests of this binary in parallel
// processes, each with its own reference runs.
fs::path RunsDir() {
  return fs::path(CAI_FSDP_TEST_RUNS) /
         ::testing::UnitTest::GetInstance()->current_test_info()->name();
}

RunResult Train(const std::string& name, int nproc, const std::vector<std::string>& sets) {
  const fs::path dir = RunsDir() / name;
  fs::remove_all(dir);
  fs::create_directories(dir);
  std::ofstream(dir / "job.toml") << kBaseJob;
  const std::string command =
      Command(dir, nproc, sets) + " > '" + (dir / "output.txt").string() + "' 2>&1";
  return Collect(dir, std::system(command.c_str()), "output.txt");
}

// The reference of a job runs once per test binary: several tests compare with it.
const RunResult& Reference(const std::vector<std::string>& sets) {
  static std::map<std::vector<std::string>, RunResult> cache;
  auto it = cache.find(sets);
  if (it == cache.end()) {
    std::vector<std::string> with = sets;
    with.push_back("plugin.name=none");
    it = cache.emplace(sets, Train("ref" + std::to_string(cache.size()), 1, with)).first;
  }
  return it->second;
}

RunResult Fsdp(const std::string& name, int nproc, const std::string& strategy,
               std::vector<std::string> sets) {
  sets.push_back("plugin.name=fsdp");
  sets.push_back("plugin.fsdp.sharding_strategy=" + strategy);
  return Train(name + "_" + std::to_string(nproc), nproc, sets);
}

std::vector<float> ReadTensor(cai::ckpt::CheckpointReader& reader, const std::string& name) {
  const cai_checkpoint_api& api = *cai::CheckpointApi();
  cai_ckpt_tensor_info info{};
  info.struct_size = CAI_CKPT_TENSOR_INFO_STRUCT_SIZE;
  if (api.tensor_info(reader.handle(), name.c_str(), &info) != nullptr) {
    ADD_FAILURE() << "checkpoint has no tensor " << name;
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

// "model/*" tensors of a checkpoint and their element counts (the reference runs on one rank).
std::map<std::string, int64_t> ModelTensorSizes(const fs::path& checkpoint) {
  std::map<std::string, int64_t> sizes;
  cai::ckpt::RankFileReader file(checkpoint / cai::ckpt::RankFileName(0));
  for (const cai::ckpt::Entry& e : file.entries()) {
    if (e.kind == cai::ckpt::EntryKind::kTensor && e.name.rfind("model/", 0) == 0) {
      sizes[e.name] = static_cast<int64_t>(e.bytes / 4);
    }
  }
  return sizes;
}

void ExpectMatches(const RunResult& ref, const RunResult& run, double rtol = 1e-5) {
  ASSERT_EQ(ref.exit_code, 0) << ref.output;
  ASSERT_EQ(run.exit_code, 0) << run.output;
  ASSERT_FALSE(ref.losses.empty());
  ASSERT_EQ(run.losses.size(), ref.losses.size());
  for (size_t s = 0; s < ref.losses.size(); ++s) {
    EXPECT_NEAR(run.losses[s], ref.losses[s], rtol * std::abs(ref.losses[s]))
        << "loss of step " << s + 1;
    EXPECT_NEAR(run.grad_norms[s], ref.grad_norms[s], 1e-4 * ref.grad_norms[s])
        << "grad norm of step " << s + 1;
  }
  ASSERT_FALSE(ref.checkpoint.empty()) << ref.output;
  ASSERT_FALSE(run.checkpoint.empty()) << run.output;
  cai::ckpt::CheckpointReader expected(ref.checkpoint), actual(run.checkpoint);
  const auto sizes = ModelTensorSizes(ref.checkpoint);
  ASSERT_FALSE(sizes.empty());
  for (const auto& [name, numel] : sizes) {
    const std::vector<float> a = ReadTensor(actual, name), b = ReadTensor(expected, name);
    ASSERT_EQ(a.size(), b.size()) << name;
    double diff = 0, norm = 0;
    for (size_t i = 0; i < b.size(); ++i) {
      diff += (static_cast<double>(a[i]) - b[i]) * (static_cast<double>(a[i]) - b[i]);
      norm += static_cast<double>(b[i]) * b[i];
    }
    EXPECT_LE(std::sqrt(diff), rtol * std::sqrt(norm))
        << name << ": relative L2 error " << std::sqrt(diff / norm);
  }
}

// One rank's figures from summary.json.
struct RankFigures {
  double all_gather = NAN, reduce_scatter = NAN, all_reduce = NAN, device_peak = NAN;
};
std::vector<RankFigures> Figures(const RunResult& r) {
  std::vector<RankFigures> ranks;
  for (size_t at = r.summary.find("\"rank\":"); at != std::string::npos;
       at = r.summary.find("\"rank\":", at + 1)) {
    const size_t comm = r.summary.find("\"comm_bytes_per_step\":", at);
    ranks.push_back({JsonNumber(r.summary, "all_gather", comm),
                     JsonNumber(r.summary, "reduce_scatter", comm),
                     JsonNumber(r.summary, "all_reduce", comm),
                     JsonNumber(r.summary, "device", r.summary.find("\"peak_bytes\":", at))});
  }
  return ranks;
}

// The plugin's layout, recomputed from parameter names: blocks.<i>.* form unit i, the rest
// the root; a unit of Ψ_u elements has shards of ceil(Ψ_u / N).
struct Layout {
  int64_t psi = 0, params = 0;
  int64_t root_shard = 0, blocks_shard = 0, max_block_shard = 0, max_shard = 0;
};
Layout LayoutOf(const RunResult& ref, int64_t n) {
  std::map<std::string, int64_t> units;
  Layout l;
  for (const auto& [name, numel] : ModelTensorSizes(ref.checkpoint)) {
    const std::string p = name.substr(6);
    const std::string unit = p.rfind("blocks.", 0) == 0 ? p.substr(0, p.find('.', 7)) : "root";
    units[unit] += numel;
    l.psi += numel;
    ++l.params;
  }
  for (const auto& [unit, numel] : units) {
    const int64_t shard = (numel + n - 1) / n;
    l.max_shard = std::max(l.max_shard, shard);
    if (unit == "root") {
      l.root_shard = shard;
    } else {
      l.blocks_shard += shard;
      l.max_block_shard = std::max(l.max_block_shard, shard);
    }
  }
  return l;
}

// ZeRO-3's traffic, exactly: per micro-batch each rank hands all-gather its shard of every
// unit twice (forward and backward) except the root's, gathered once for both (SHARD_GRAD_OP:
// every unit once), and hands reduce-scatter its whole padded gradient once: ≈ 2 × 4Ψ/N + 4Ψ
// bytes. The step adds one all-reduce of the squared norm and the per-parameter used flags.
void ExpectZero3Bytes(const RunResult& ref, const RunResult& run, int n, bool full_shard,
                      int micro_batches = 1) {
  const Layout l = LayoutOf(ref, n);
  const double s = static_cast<double>(l.root_shard + l.blocks_shard);
  const std::vector<RankFigures> ranks = Figures(run);
  ASSERT_EQ(ranks.size(), static_cast<size_t>(n)) << run.summary;
  for (const RankFigures& f : ranks) {
    EXPECT_EQ(f.all_gather,
              4.0 * micro_batches * (full_shard ? 2 * l.blocks_shard + l.root_shard : s));
    EXPECT_EQ(f.reduce_scatter, 4.0 * micro_batches * n * s);
    EXPECT_EQ(f.all_reduce, 8.0 * (1 + l.params));
    // Within padding of Ψ: at most N - 1 elements per unit (root and 2 blocks).
    EXPECT_GE(f.reduce_scatter, 4.0 * micro_batches * l.psi);
    EXPECT_LE(f.reduce_scatter, 4.0 * micro_batches * (l.psi + (n - 1) * 3));
  }
}

// Per-rank model-state memory from the pool's peak (DEVICE tier): AdamW's 16 bytes per
// element of this rank's shards, plus at the peak of backward the root and one block gathered
// with their full gradient buffers, one reduce-scatter output and the step's sums. Well below
// a replica's 16Ψ.
// With prefetch, `prefetched` more blocks are gathered.
void ExpectShardedMemory(const RunResult& ref, const RunResult& run, int n, int prefetched = 0) {
  const Layout l = LayoutOf(ref, n);
  const double shards = 16.0 * (l.root_shard + l.blocks_shard);
  const double bound = shards + 8.0 * n * (l.root_shard + l.max_block_shard) +
                       4.0 * n * prefetched * l.max_block_shard + 4.0 * l.max_shard +
                       8.0 * (1 + l.params);
  const std::vector<RankFigures> ranks = Figures(run);
  ASSERT_EQ(ranks.size(), static_cast<size_t>(n)) << run.summary;
  for (const RankFigures& f : ranks) {
    EXPECT_GE(f.device_peak, shards);
    EXPECT_LE(f.device_peak, bound);
    EXPECT_LT(f.device_peak, 0.8 * 16.0 * l.psi);
  }
}

TEST(FsdpParity, Fsdp_OneRank_FullShardMatchesReference) {
  ExpectMatches(Reference({}), Fsdp("full", 1, "FULL_SHARD", {}));
}

// The tied wte/lm_head lives in the root unit; clipping is active at every step.
TEST(FsdpParity, Fsdp_TwoRanks_FullShardTiedEmbeddingMatchesReferenceWithZero3Bytes) {
  const RunResult& ref = Reference({});
  ASSERT_EQ(ref.exit_code, 0) << ref.output;
  const auto sizes = ModelTensorSizes(ref.checkpoint);
  EXPECT_TRUE(sizes.count("model/wte.weight"));
  for (const auto& [name, numel] : sizes) EXPECT_EQ(name.find("lm_head"), std::string::npos);
  const RunResult run = Fsdp("full", 2, "FULL_SHARD", {});
  ExpectMatches(ref, run);
  for (double norm : run.grad_norms) EXPECT_GT(norm, 0.05);
  ExpectZero3Bytes(ref, run, 2, true);
}

TEST(FsdpParity, Fsdp_ThreeRanks_FullShardMatchesReferenceWithZero3BytesAndMemory) {
  const RunResult& ref = Reference({});
  const RunResult run = Fsdp("full", 3, "FULL_SHARD", {});
  ExpectMatches(ref, run);
  ExpectZero3Bytes(ref, run, 3, true);
  ExpectShardedMemory(ref, run, 3);
}

TEST(FsdpParity, Fsdp_TwoRanks_ShardGradOpMatchesReferenceGatheringOnce) {
  const RunResult& ref = Reference({});
  const RunResult run = Fsdp("grad_op", 2, "SHARD_GRAD_OP", {});
  ExpectMatches(ref, run);
  ExpectZero3Bytes(ref, run, 2, false);
}

TEST(FsdpParity, Fsdp_ThreeRanks_ShardGradOpMatchesReferenceGatheringOnce) {
  const RunResult& ref = Reference({});
  const RunResult run = Fsdp("grad_op", 3, "SHARD_GRAD_OP", {});
  ExpectMatches(ref, run);
  ExpectZero3Bytes(ref, run, 3, false);
}

// Replicas: no gather, no reduce-scatter; gradients all-reduced unit by unit.
TEST(FsdpParity, Fsdp_TwoRanks_NoShardMatchesReference) {
  const RunResult& ref = Reference({});
  const RunResult run = Fsdp("no_shard", 2, "NO_SHARD", {});
  ExpectMatches(ref, run);
  const Layout l = LayoutOf(ref, 1);
  for (const RankFigures& f : Figures(run)) {
    EXPECT_EQ(f.all_gather, 0);
    EXPECT_EQ(f.reduce_scatter, 0);
    EXPECT_EQ(f.all_reduce, 4.0 * l.psi + 8.0 * (1 + l.params));
  }
}

// Prefetch: the next block's all-gather is in flight while a block computes, forward and
// backward. Same results, same bytes; the peak shows the extra block actually held.
TEST(FsdpParity, Fsdp_ThreeRanks_PrefetchMatchesReferenceHoldingOneMoreBlock) {
  const RunResult& ref = Reference({});
  const RunResult run =
      Fsdp("prefetch", 3, "FULL_SHARD",
           {"plugin.fsdp.forward_prefetch=true", "plugin.fsdp.backward_prefetch=pre"});
  ExpectMatches(ref, run);
  ExpectZero3Bytes(ref, run, 3, true);
  ExpectShardedMemory(ref, run, 3, 1);
  const Layout l = LayoutOf(ref, 3);
  const double without = 16.0 * (l.root_shard + l.blocks_shard) +
                         8.0 * 3 * (l.root_shard + l.max_block_shard) + 4.0 * l.max_shard;
  for (const RankFigures& f : Figures(run)) EXPECT_GT(f.device_peak, without);
}

// auto_wrap = none: the whole model is one root unit, gathered once per micro-batch.
TEST(FsdpParity, Fsdp_ThreeRanks_NoWrapOneFlatParameterMatchesReference) {
  const RunResult& ref = Reference({});
  const RunResult run = Fsdp("no_wrap", 3, "FULL_SHARD", {"plugin.fsdp.auto_wrap=none"});
  ExpectMatches(ref, run);
  const Layout l = LayoutOf(ref, 3);
  const double shard = static_cast<double>((l.psi + 2) / 3);
  for (const RankFigures& f : Figures(run)) {
    EXPECT_EQ(f.all_gather, 4.0 * shard);
    EXPECT_EQ(f.reduce_scatter, 4.0 * 3 * shard);
  }
}

// 4 rows over 3 ranks are 2+1+1: the host's loss weights keep the SUM exact.
TEST(FsdpParity, Fsdp_ThreeRanks_UnevenBatchMatchesReference) {
  const std::vector<std::string> sets = {"train.global_batch=4"};
  ExpectMatches(Reference(sets), Fsdp("uneven", 3, "FULL_SHARD", sets));
}

TEST(FsdpParity, Fsdp_ThreeRanks_LlamaMatchesReference) {
  const std::vector<std::string> sets = {"model.kind=llama", "model.n_kv_head=1"};
  ExpectMatches(Reference(sets), Fsdp("llama", 3, "FULL_SHARD", sets));
}

// A frozen block matrix stays whole on every rank and unchanged; the unused parameter (root
// unit) gets a gradient on no rank and, as in the reference, is not updated at all — its
// shard slices on different ranks included.
TEST(FsdpParity, Fsdp_ThreeRanks_FrozenAndUnusedParametersMatchReference) {
  const std::vector<std::string> sets = {"model.freeze=blocks.0.mlp.*",
                                         "model.unused_parameter=true"};
  const RunResult& ref = Reference(sets);
  for (const char* strategy : {"FULL_SHARD", "SHARD_GRAD_OP"}) {
    const RunResult run = Fsdp(std::string("frozen_") + strategy, 3, strategy, sets);
    ExpectMatches(ref, run);
    ASSERT_FALSE(run.checkpoint.empty());
    cai::ckpt::CheckpointReader reader(run.checkpoint);
    for (float v : ReadTensor(reader, "model/unused.weight")) ASSERT_EQ(v, 0.02f);
  }
}

// 4 micro-batches per step; without no_sync every micro-batch reduce-scatters its gradients
// into the shard sums.
TEST(FsdpParity, Fsdp_TwoRanks_GradientAccumulationMatchesReference) {
  const std::vector<std::string> sets = {"train.global_batch=16", "train.grad_accum=4"};
  const RunResult& ref = Reference(sets);
  const RunResult run = Fsdp("accum", 2, "FULL_SHARD", sets);
  ExpectMatches(ref, run);
  ExpectZero3Bytes(ref, run, 2, true, 4);
}

// Saved on 2 ranks at step 3, resumed on 3: each rank reads only its slices of the canonical
// layout, and training goes on exactly as the reference's uninterrupted run.
TEST(FsdpParity, Fsdp_SaveOnTwoRanksResumeOnThree_MatchesReference) {
  const std::vector<std::string> sets = {"optimizer.decay_steps=5"};
  const RunResult& ref = Reference(sets);
  ASSERT_EQ(ref.exit_code, 0) << ref.output;
  RunResult first = Fsdp("resume", 2, "FULL_SHARD", {"optimizer.decay_steps=5", "train.steps=3"});
  ASSERT_EQ(first.exit_code, 0) << first.output;
  const fs::path dir = RunsDir() / "resume_2";
  const std::string command =
      Command(dir, 3, {"optimizer.decay_steps=5", "plugin.name=fsdp", "checkpoint.resume=true"}) +
      " > '" + (dir / "resumed.txt").string() + "' 2>&1";
  RunResult resumed = Collect(dir, std::system(command.c_str()), "resumed.txt");
  ASSERT_EQ(resumed.exit_code, 0) << resumed.output;
  ASSERT_EQ(resumed.losses.size(), 5u) << resumed.output;  // steps 1-3, then 4-5 appended
  ExpectMatches(ref, resumed);
}

// What is not implemented yet is refused with a message naming it, never ignored.
TEST(FsdpParity, Fsdp_UnimplementedOptionsFailClearly) {
  const std::vector<std::pair<std::vector<std::string>, std::string>> cases = {
      {{"plugin.fsdp.sharding_strategy=HYBRID_SHARD"}, "HYBRID_SHARD"},
      {{"plugin.fsdp.backward_prefetch=post"}, "backward_prefetch = \"post\""},
      {{"plugin.fsdp.cpu_offload=true"}, "cpu_offload = true"},
      {{"plugin.fsdp.auto_wrap=size"}, "auto_wrap = \"size\""},
  };
  int k = 0;
  for (const auto& [sets, what] : cases) {
    std::vector<std::string> with = sets;
    with.push_back("plugin.name=fsdp");
    with.push_back("train.steps=1");
    const RunResult r = Train("refused" + std::to_string(k++), 1, with);
    EXPECT_NE(r.exit_code, 0) << what;
    EXPECT_NE(r.output.find(what), std::string::npos) << r.output;
    EXPECT_NE(r.output.find("not implemented yet"), std::string::npos) << r.output;
  }
  // Mixed precision: the manifest and capabilities say fp32 only, so the host refuses first.
  const RunResult bf16 = Train("refused_bf16", 1, {"plugin.name=fsdp", "train.precision=bf16"});
  EXPECT_NE(bf16.exit_code, 0);
  EXPECT_NE(bf16.output.find("'fsdp' does not train in bf16"), std::string::npos) << bf16.output;
}

}  // namespace
