// libcai_fsdp end to end: `cai train` on 1, 2, 3 and 4 real ranks (subprocesses over Gloo),
// each compared with the single-process reference (`plugin.name=none`) on the same job: every
// step's loss and grad norm, and the final checkpoint's "model/*" tensors by relative L2 error
// (tests/plugins/common/train_run.h). fp32 tolerance 1e-5.
//
// The job (kTinyGptJob): tiny GPT-2 (its lm_head is tied to wte), two parameter groups with
// their own LR and weight decay, clipping at a norm every step exceeds, warmup into cosine
// decay. With 2 and 3 ranks no unit divides evenly, so every shard carries padding.
//
// Communication and memory are asserted exactly from the layout rule (a unit of Ψ_u elements
// is padded to G·ceil(Ψ_u/G)), the unit sizes the plugin logs (checked against Ψ) and the
// byte counters, pool peaks and the plugin's forward peak in summary.json and the log.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <map>
#include <sstream>
#include <string>
#include <tuple>
#include <vector>

#include "checkpoint/checkpoint.h"
#include "checkpoint/rank_file.h"
#include "shift_model.h"
#include "train_run.h"

namespace {

namespace fs = std::filesystem;
using cai::testing::kTinyGptJob;
using cai::testing::ModelElements;
using cai::testing::PerRank;
using cai::testing::ReadCheckpointTensor;
using cai::testing::TrainRun;

// Each test's runs in a folder of its own: ctest runs the tests of this binary in parallel
// processes, each with its own reference runs.
fs::path RunsDir() {
  return fs::path(CAI_FSDP_TEST_RUNS) /
         ::testing::UnitTest::GetInstance()->current_test_info()->name();
}

TrainRun Train(const std::string& name, int nproc, const std::vector<std::string>& sets,
               bool resume = false, const std::string& output = "output.txt") {
  return cai::testing::RunTrain(RunsDir() / name, kTinyGptJob, nproc, sets, CAI_FSDP_MANIFEST,
                                resume, output);
}

// The reference of a job runs once per test process: several runs compare with it.
const TrainRun& Reference(const std::vector<std::string>& sets) {
  static std::map<std::vector<std::string>, TrainRun> cache;
  auto it = cache.find(sets);
  if (it == cache.end()) {
    std::vector<std::string> with = sets;
    with.push_back("plugin.name=none");
    it = cache.emplace(sets, Train("ref" + std::to_string(cache.size()), 1, with)).first;
  }
  return it->second;
}

// Losses, grad norms (computed here across shards), skipped flags and every final weight
// tensor (train_run.h) within `rtol`.
void ExpectParity(const TrainRun& ref, const TrainRun& run, double rtol) {
  cai::testing::ExpectMatches(ref, run, rtol);
}

// An fsdp run; its checkpoint is the consolidated one (state_dict_type = full) unless `sets`
// asks otherwise, so it compares with the reference's tensor by tensor. Its memory estimate
// is its device peak (train_run.h), except where the layout lists more than trains
// (model.freeze) or no_sync keeps every unit's gradient (train.grad_accum), which no estimate
// is told of, and for TorchScript models, whose layout is unknown before they load.
TrainRun Fsdp(const std::string& name, int nproc, const std::string& strategy,
              std::vector<std::string> sets) {
  const bool chooses = cai::testing::Mentions(sets, "state_dict_type");
  sets.push_back("plugin.name=fsdp");
  sets.push_back("plugin.fsdp.sharding_strategy=" + strategy);
  if (!chooses) sets.push_back("plugin.fsdp.state_dict_type=full");
  TrainRun run = Train(name + "_" + std::to_string(nproc), nproc, sets);
  if (!cai::testing::Mentions(sets, "model.freeze") &&
      !cai::testing::Mentions(sets, "train.grad_accum") &&
      !cai::testing::Mentions(sets, "model.kind=torchscript")) {
    cai::testing::ExpectEstimateIsTheDevicePeak(run);
    cai::testing::ExpectEstimateIsTheHostPeak(run);
  }
  return run;
}

// 16-bit training against the reference in the same precision: the reference reduces
// nothing, fsdp sums 16-bit gradients over ranks, so gradients differ by that rounding and
// Adam's normalised steps carry it into every small-gradient weight. Checked: every step's
// loss and grad norm within `step_tol` relative, and each "model/*" tensor within `tensor_tol`
// relative L2 (train_run.h: a whole-model norm would hide a small tensor's error).
void ExpectLowPrecisionParity(const TrainRun& ref, const TrainRun& run,
                              cai::conformance::Tolerance tolerance) {
  cai::testing::ExpectMatches(ref, run, tolerance);
}

// The units the plugin built, from its log line "unit sizes: root=9280 blocks.0=12704 ...";
// their sizes must add up to the reference's Ψ.
struct Layout {
  int64_t psi = 0;
  int64_t root = 0;                // s_root
  int64_t units = 0;               // Σ s_u over the non-root units
  int64_t max_unit = 0;            // max s_u over the non-root units
  int64_t shards = 0;              // S = s_root + units
  std::vector<std::string> names;  // non-root units
};
Layout LayoutOf(const TrainRun& ref, const TrainRun& run, int64_t g) {
  Layout l;
  const size_t at = run.output.find("unit sizes:");
  EXPECT_NE(at, std::string::npos) << run.output;
  if (at == std::string::npos) return l;
  std::istringstream line(run.output.substr(at + 11, run.output.find('\n', at) - at - 11));
  for (std::string item; line >> item;) {
    const size_t eq = item.find('=');
    const std::string name = item.substr(0, eq);
    const int64_t numel = std::stoll(item.substr(eq + 1));
    const int64_t shard = (numel + g - 1) / g;
    l.psi += numel;
    if (name == "root") {
      l.root = shard;
    } else {
      l.units += shard;
      l.max_unit = std::max(l.max_unit, shard);
      l.names.push_back(name);
    }
  }
  l.shards = l.root + l.units;
  EXPECT_EQ(static_cast<double>(l.psi), ModelElements(ref.checkpoint));
  return l;
}

// Trainable tensors of the reference (the used flags of the step's all-reduce).
double TrainableParams(const TrainRun& ref) {
  return static_cast<double>(cai::testing::ModelTensorNames(ref.checkpoint).size());
}

// ZeRO-3's traffic, exactly, per rank and step: each micro-batch hands all-gather its shard
// of every unit twice (forward and backward) except the root's, gathered once for both
// (SHARD_GRAD_OP: every unit once), e bytes per element, and hands reduce-scatter its whole
// padded gradient once per reduction (every micro-batch, or once a step under no_sync),
// e_r bytes per element: ≈ 2 × eΨ/G + e_rΨ. The step adds one all-reduce of the squared norm,
// the overflow flag and the per-parameter used flags.
struct Bytes {
  int g = 1;
  bool full_shard = true;
  int micro_batches = 1;
  int reductions = 1;
  double e = 4, e_reduce = 4;
};
void ExpectZero3Bytes(const TrainRun& ref, const TrainRun& run, const Bytes& b,
                      double trainable = -1) {
  const Layout l = LayoutOf(ref, run, b.g);
  if (trainable < 0) trainable = TrainableParams(ref);
  const std::vector<double> gather = PerRank(run, "comm_bytes_per_step_mean", "all_gather");
  const std::vector<double> scatter = PerRank(run, "comm_bytes_per_step_mean", "reduce_scatter");
  const std::vector<double> reduce = PerRank(run, "comm_bytes_per_step_mean", "all_reduce");
  ASSERT_FALSE(gather.empty()) << run.summary;
  for (size_t r = 0; r < gather.size(); ++r) {
    EXPECT_EQ(gather[r], b.e * b.micro_batches *
                             static_cast<double>(b.full_shard ? 2 * l.units + l.root : l.shards))
        << "rank " << r;
    EXPECT_EQ(scatter[r], b.e_reduce * b.reductions * b.g * static_cast<double>(l.shards));
    EXPECT_EQ(reduce[r], 8.0 * (2 + trainable));
    // Within padding of Ψ: at most G - 1 elements per unit.
    EXPECT_GE(scatter[r], b.e_reduce * b.reductions * l.psi);
    EXPECT_LE(scatter[r], b.e_reduce * b.reductions * (l.psi + (b.g - 1) * (1.0 + l.names.size())));
  }
  // On the wire, measured: rings send (G-1)/G of the reduce-scatter's input and G-1 times the
  // all-gather's, not an all-reduce's 2(G-1)/G.
  cai::testing::ExpectWireBytes(run, "reduce_scatter", (b.g - 1.0) / b.g);
  cai::testing::ExpectWireBytes(run, "all_gather", b.g - 1.0);
}

// The plugin's "peak parameter bytes in forward N" (the last one: every rank logs it once).
std::vector<double> ForwardPeaks(const TrainRun& run) {
  std::vector<double> peaks;
  const std::string key = "peak parameter bytes in forward ";
  for (size_t at = run.output.find(key); at != std::string::npos;
       at = run.output.find(key, at + 1)) {
    peaks.push_back(std::strtod(run.output.c_str() + at + key.size(), nullptr));
  }
  return peaks;
}

// Per-rank memory, fp32 Adam (16 bytes per element of the shards S ≈ Ψ/G):
//  - model state, the pool's DEVICE peak: 16·S, plus at the peak of backward one unit gathered
//    with its gradient buffer and the previous unit's gradient still in its asynchronous
//    reduce-scatter (3 × 4·G·s_max), plus the root's two buffers, which stay gathered
//    throughout (the tied wte lives there, as in PyTorch's root FSDP instance), `prefetched`
//    more gathered units, two reduce-scatter outputs (the one in flight and the next) and the
//    step's sums;
//  - parameters during forward, the plugin's own peak: Ψ/G (4·S) + (prefetch + 1) gathered
//    units + the root, exactly.
void ExpectShardedMemory(const TrainRun& ref, const TrainRun& run, int g, int prefetched = 0) {
  const Layout l = LayoutOf(ref, run, g);
  const double shards = 16.0 * l.shards;
  const double bound = shards + 3 * 4.0 * g * l.max_unit + 2 * 4.0 * g * l.root +
                       4.0 * g * prefetched * l.max_unit + 2 * 4.0 * l.max_unit +
                       8.0 * (2 + TrainableParams(ref));
  const std::vector<double> peaks = PerRank(run, "peak_bytes", "device");
  ASSERT_EQ(peaks.size(), static_cast<size_t>(g)) << run.summary;
  for (double peak : peaks) {
    EXPECT_GE(peak, shards);
    EXPECT_LE(peak, bound);
    // Well below a replica's 16Ψ, though one block of this small model is ~1/6 of Ψ.
    EXPECT_LT(peak, 0.85 * 16.0 * l.psi);
  }
  const std::vector<double> forward = ForwardPeaks(run);
  ASSERT_EQ(forward.size(), static_cast<size_t>(g)) << run.output;
  const size_t units_ahead = std::min<size_t>(prefetched + 1, l.names.size());
  for (double peak : forward) {
    EXPECT_EQ(peak, 4.0 * l.shards + 4.0 * g * (l.root + units_ahead * l.max_unit));
  }
}

TEST(FsdpParity, OneRank_FullShardMatchesReference) {
  ExpectParity(Reference({}), Fsdp("full", 1, "FULL_SHARD", {}), 1e-5);
}

// The tied wte/lm_head lives in the root unit; clipping is active at every step.
TEST(FsdpParity, TwoRanks_FullShardTiedEmbeddingMatchesReferenceWithZero3Bytes) {
  const TrainRun& ref = Reference({});
  ASSERT_EQ(ref.exit_code, 0) << ref.output;
  const std::vector<std::string> names = cai::testing::ModelTensorNames(ref.checkpoint);
  EXPECT_NE(std::find(names.begin(), names.end(), "model/wte.weight"), names.end());
  for (const std::string& name : names) EXPECT_EQ(name.find("lm_head"), std::string::npos);
  const TrainRun run = Fsdp("full", 2, "FULL_SHARD", {});
  ExpectParity(ref, run, 1e-5);
  for (double norm : run.grad_norms) EXPECT_GT(norm, 0.05);
  ExpectZero3Bytes(ref, run, {.g = 2});
}

TEST(FsdpParity, ThreeRanks_FullShardMatchesReferenceWithZero3BytesAndMemory) {
  const TrainRun& ref = Reference({});
  const TrainRun run = Fsdp("full", 3, "FULL_SHARD", {});
  ExpectParity(ref, run, 1e-5);
  ExpectZero3Bytes(ref, run, {.g = 3});
  ExpectShardedMemory(ref, run, 3);
}

TEST(FsdpParity, TwoAndThreeRanks_ShardGradOpMatchesReferenceGatheringOnce) {
  const TrainRun& ref = Reference({});
  for (int n : {2, 3}) {
    const TrainRun run = Fsdp("grad_op", n, "SHARD_GRAD_OP", {});
    ExpectParity(ref, run, 1e-5);
    ExpectZero3Bytes(ref, run, {.g = n, .full_shard = false});
  }
}

// Replicas: no gather, no reduce-scatter; gradients all-reduced unit by unit.
TEST(FsdpParity, TwoRanks_NoShardMatchesReference) {
  const TrainRun& ref = Reference({});
  const TrainRun run = Fsdp("no_shard", 2, "NO_SHARD", {});
  ExpectParity(ref, run, 1e-5);
  const Layout l = LayoutOf(ref, run, 1);
  for (double b : PerRank(run, "comm_bytes_per_step_mean", "all_gather")) EXPECT_EQ(b, 0);
  for (double b : PerRank(run, "comm_bytes_per_step_mean", "reduce_scatter")) EXPECT_EQ(b, 0);
  for (double b : PerRank(run, "comm_bytes_per_step_mean", "all_reduce")) {
    EXPECT_EQ(b, 4.0 * l.psi + 8.0 * (2 + TrainableParams(ref)));
  }
}

// 4 ranks as 2 nodes of 2 (shard_group_size = 2): units sharded over each pair, the gradient shard
// all-reduced between the pairs. Gathers and reduce-scatters move G = 2's bytes; the replicas'
// all-reduce adds 4·S.
TEST(FsdpParity, FourRanks_HybridShardTwoByTwoAndOneNodeOfTwoMatchReference) {
  const TrainRun& ref = Reference({});
  const TrainRun run = Fsdp("hybrid", 4, "HYBRID_SHARD", {"plugin.fsdp.shard_group_size=2"});
  ExpectParity(ref, run, 1e-5);
  const Layout l = LayoutOf(ref, run, 2);
  const std::vector<double> gather = PerRank(run, "comm_bytes_per_step_mean", "all_gather");
  ASSERT_EQ(gather.size(), 4u);
  for (double b : gather) EXPECT_EQ(b, 4.0 * (2 * l.units + l.root));
  for (double b : PerRank(run, "comm_bytes_per_step_mean", "reduce_scatter")) {
    EXPECT_EQ(b, 4.0 * 2 * l.shards);
  }
  for (double b : PerRank(run, "comm_bytes_per_step_mean", "all_reduce")) {
    EXPECT_EQ(b, 4.0 * l.shards + 8.0 * (2 + TrainableParams(ref)));
  }
  EXPECT_NE(run.output.find("2 shards x 2 replicas"), std::string::npos) << run.output;

  // Without shard_group_size a node's ranks form the shard group: `cai train --nproc 2` sets
  // LOCAL_WORLD_SIZE = 2, so 2 ranks are one node and HYBRID_SHARD shards over both.
  const TrainRun node = Fsdp("hybrid_node", 2, "HYBRID_SHARD", {});
  ExpectParity(ref, node, 1e-5);
  EXPECT_NE(node.output.find("2 shards x 1 replicas"), std::string::npos) << node.output;
}

// Prefetch: the next block's all-gather is in flight while a block computes, forward and
// backward. Same results, same bytes; the peaks show the extra block actually held.
TEST(FsdpParity, ThreeRanks_PrefetchPreMatchesReferenceHoldingOneMoreBlock) {
  const TrainRun& ref = Reference({});
  const TrainRun run =
      Fsdp("prefetch", 3, "FULL_SHARD",
           {"plugin.fsdp.forward_prefetch=true", "plugin.fsdp.backward_prefetch=pre"});
  ExpectParity(ref, run, 1e-5);
  ExpectZero3Bytes(ref, run, {.g = 3});
  ExpectShardedMemory(ref, run, 3, 1);
}

// backward_prefetch = post and a deeper forward prefetch on a 4-block model: at most
// prefetch_limit = 2 units ahead, so forward holds the running block and two more.
TEST(FsdpParity, ThreeRanks_PrefetchPostWithLimitTwoMatchesReference) {
  const std::vector<std::string> sets = {"model.n_layer=4"};
  const TrainRun& ref = Reference(sets);
  std::vector<std::string> with = sets;
  for (const char* s : {"plugin.fsdp.forward_prefetch=true", "plugin.fsdp.backward_prefetch=post",
                        "plugin.fsdp.prefetch_limit=2"}) {
    with.push_back(s);
  }
  const TrainRun run = Fsdp("post", 3, "FULL_SHARD", with);
  ExpectParity(ref, run, 1e-5);
  ExpectZero3Bytes(ref, run, {.g = 3});
  ExpectShardedMemory(ref, run, 3, 2);
}

// auto_wrap = size: blocks merged until a unit holds min_num_params elements; here the two
// blocks (12,704 each) form one unit.
TEST(FsdpParity, ThreeRanks_WrapBySizeMergesBlocksAndMatchesReference) {
  const TrainRun& ref = Reference({});
  const TrainRun run = Fsdp("size", 3, "FULL_SHARD",
                            {"plugin.fsdp.auto_wrap=size", "plugin.fsdp.min_num_params=20000"});
  ExpectParity(ref, run, 1e-5);
  const Layout l = LayoutOf(ref, run, 3);
  ASSERT_EQ(l.names.size(), 1u);
  EXPECT_EQ(l.names[0], "blocks.0+blocks.1");
  ExpectZero3Bytes(ref, run, {.g = 3});
}

// auto_wrap = none: the whole model is one root unit, gathered once per micro-batch.
TEST(FsdpParity, ThreeRanks_NoWrapOneFlatParameterMatchesReference) {
  const TrainRun& ref = Reference({});
  const TrainRun run = Fsdp("no_wrap", 3, "FULL_SHARD", {"plugin.fsdp.auto_wrap=none"});
  ExpectParity(ref, run, 1e-5);
  const Layout l = LayoutOf(ref, run, 3);
  EXPECT_TRUE(l.names.empty());
  ExpectZero3Bytes(ref, run, {.g = 3});
}

// 4 rows over 3 ranks are 2+1+1: the host's loss weights keep the SUM exact.
// Scale-sensitive: plain SGD without momentum, clipping or warmup (train_run.h); 3 ranks split
// 4 rows 2+1+1, and SHARD_GRAD_OP reduces through the same reduce-scatter.
TEST(FsdpParity, TwoAndThreeRanks_PlainSgdMatchesReference) {
  for (int nproc : {2, 3}) {
    SCOPED_TRACE(std::to_string(nproc) + " ranks");
    std::vector<std::string> sets = cai::testing::kPlainSgdSets;
    if (nproc == 3) sets.push_back("train.global_batch=4");
    const TrainRun& ref = Reference(sets);
    ExpectParity(ref, Fsdp("sgd", nproc, "FULL_SHARD", sets), 1e-5);
    if (nproc == 3) ExpectParity(ref, Fsdp("sgd_grad_op", nproc, "SHARD_GRAD_OP", sets), 1e-5);
  }
}

TEST(FsdpParity, ThreeRanks_UnevenBatchMatchesReference) {
  const std::vector<std::string> sets = {"train.global_batch=4"};
  ExpectParity(Reference(sets), Fsdp("uneven", 3, "FULL_SHARD", sets), 1e-5);
}

TEST(FsdpParity, ThreeRanks_LlamaMatchesReference) {
  const std::vector<std::string> sets = {"model.kind=llama", "model.n_kv_head=1"};
  ExpectParity(Reference(sets), Fsdp("llama", 3, "FULL_SHARD", sets), 1e-5);
}

// A frozen block matrix stays whole on every rank and unchanged; the unused parameter (root
// unit) gets a gradient on no rank and, as in the reference, is not updated at all — its
// shard slices on different ranks included.
TEST(FsdpParity, ThreeRanks_FrozenAndUnusedParametersMatchReference) {
  const std::vector<std::string> sets = {"model.freeze=blocks.0.mlp.*",
                                         "model.unused_parameter=true"};
  const TrainRun& ref = Reference(sets);
  for (const char* strategy : {"FULL_SHARD", "SHARD_GRAD_OP"}) {
    const TrainRun run = Fsdp(std::string("frozen_") + strategy, 3, strategy, sets);
    ExpectParity(ref, run, 1e-5);
    ASSERT_FALSE(run.checkpoint.empty());
    for (float v : ReadCheckpointTensor(run.checkpoint, "model/unused.weight")) {
      ASSERT_EQ(v, 0.02f);
    }
  }
}

// mixed_precision's buffer_dtype on a TorchScript model whose forward reads a buffer: cast to
// bf16 (2 ranks) or fp16 (3 ranks), it trains exactly as the reference does on the same model
// saved with that buffer already rounded, within 1e-5, and unlike the reference on the fp32
// buffer, which the default (buffer_dtype = model) matches.
TEST(FsdpParity, TwoAndThreeRanks_BufferDtypeCastsTheModelsBuffers) {
  const auto script = [](const std::string& round_to) {
    const fs::path path = RunsDir() / ("shift" + round_to + ".pt");
    cai::testing::SaveShiftModel(path, round_to);
    return std::vector<std::string>{"model.kind=torchscript", "model.path=" + path.string()};
  };
  const std::vector<std::string> fp32 = script("");
  ExpectParity(Reference(fp32), Fsdp("buffers_model", 2, "FULL_SHARD", fp32), 1e-5);
  for (const auto& [nproc, dtype] : {std::pair{2, "bf16"}, std::pair{3, "fp16"}}) {
    std::vector<std::string> sets = fp32;
    sets.push_back(std::string("plugin.fsdp.buffer_dtype=") + dtype);
    const TrainRun run = Fsdp(std::string("buffers_") + dtype, nproc, "FULL_SHARD", sets);
    ExpectParity(Reference(script(dtype)), run, 1e-5);
    EXPECT_NE(run.output.find(std::string("reduce, ") + dtype + " buffers,"), std::string::npos)
        << run.output;
    ASSERT_FALSE(run.losses.empty());
    EXPECT_GT(std::abs(run.losses.front() - Reference(fp32).losses.front()),
              1e-3 * run.losses.front())
        << dtype << " buffers should make another model than fp32 ones";
  }
}

// 4 micro-batches per step. no_sync (the host asks for it on all but the last): the unit
// gradients accumulate unsharded and are reduce-scattered once per step, while the
// all-gathers still run every micro-batch, as in PyTorch.
TEST(FsdpParity, TwoRanks_GradientAccumulationReducesOncePerStepUnderNoSync) {
  const std::vector<std::string> sets = {"train.global_batch=16", "train.grad_accum=4"};
  const TrainRun& ref = Reference(sets);
  const TrainRun run = Fsdp("accum", 2, "FULL_SHARD", sets);
  ExpectParity(ref, run, 1e-5);
  ExpectZero3Bytes(ref, run, {.g = 2, .micro_batches = 4, .reductions = 1});
}

// model.init_device = "lazy": fsdp reads each parameter into its flat shards at boost, which
// draws it; training is bit-identical to the eagerly built model's.
TEST(FsdpParity, TwoRanks_LazyInitTrainsAsEager) {
  const TrainRun& ref = Reference({});
  const TrainRun eager = Fsdp("eager", 2, "FULL_SHARD", {});
  const TrainRun lazy = Fsdp("lazy", 2, "FULL_SHARD", {"model.init_device=lazy"});
  ExpectParity(ref, lazy, 1e-5);
  EXPECT_EQ(lazy.losses, eager.losses);
  EXPECT_EQ(lazy.grad_norms, eager.grad_norms);
}

// bf16 parameters and gradients over fp32 shards: gathers and reductions move 2 bytes per
// element (reduce_dtype = param), or the reduction 4 (reduce_dtype = fp32). Against the bf16
// reference within the 16-bit bounds of train_run.h (AdamW; then plain SGD, tight per tensor).
TEST(FsdpParity, ThreeRanks_Bf16MatchesBf16ReferenceInBothReduceDtypes) {
  const std::vector<std::string> sets = {"train.precision=bf16"};
  const TrainRun& ref = Reference(sets);
  const TrainRun run = Fsdp("bf16", 3, "FULL_SHARD", sets);
  ExpectLowPrecisionParity(ref, run, cai::testing::kBf16AdamW);
  ExpectZero3Bytes(ref, run, {.g = 3, .e = 2, .e_reduce = 2});
  EXPECT_NE(run.output.find("bf16 compute, bf16 reduce"), std::string::npos);
  // fp32 masters: 4·S, beside the 2·S bf16 compute shard.
  const Layout l = LayoutOf(ref, run, 3);
  for (double b : PerRank(run, "strategy_bytes", "master")) EXPECT_EQ(b, 4.0 * l.shards);
  for (double b : PerRank(run, "strategy_bytes", "params")) EXPECT_EQ(b, 2.0 * l.shards);

  std::vector<std::string> fp32_reduce = sets;
  fp32_reduce.push_back("plugin.fsdp.reduce_dtype=fp32");
  const TrainRun run32 = Fsdp("bf16_fp32_reduce", 3, "FULL_SHARD", fp32_reduce);
  ExpectLowPrecisionParity(ref, run32, cai::testing::kBf16AdamW);
  ExpectZero3Bytes(ref, run32, {.g = 3, .e = 2, .e_reduce = 4});

  std::vector<std::string> sgd = cai::testing::kPlainSgdSets;
  sgd.push_back("train.precision=bf16");
  sgd.push_back("optimizer.lr=0.05");  // a rate at which the loss falls steadily
  ExpectLowPrecisionParity(Reference(sgd), Fsdp("bf16_sgd", 3, "FULL_SHARD", sgd),
                           cai::testing::kBf16Sgd);
}

// fp16 with dynamic loss scaling from a scale too large for the tiny model's gradients: the
// first steps overflow, are skipped on every rank and back the scale off at the same steps as
// the reference; then training proceeds: losses within 1e-4 (fp16's bound in the DDP tests;
// measured 4e-6), each tensor within fp16's bound (train_run.h).
TEST(FsdpParity, ThreeRanks_Fp16LossScalingSkipsTheStepsTheReferenceSkips) {
  const std::vector<std::string> sets = {"train.precision=fp16", "train.steps=8"};
  std::vector<std::string> ref_sets = sets, fsdp_sets = sets;
  for (const char* key : {"initial_scale=1048576", "hysteresis=1"}) {
    ref_sets.push_back(std::string("plugin.none.") + key);
    fsdp_sets.push_back(std::string("plugin.fsdp.") + key);
  }
  const TrainRun& ref = Reference(ref_sets);
  const TrainRun run = Fsdp("fp16", 3, "FULL_SHARD", fsdp_sets);
  ASSERT_EQ(ref.exit_code, 0) << ref.output;
  ASSERT_EQ(run.exit_code, 0) << run.output;
  ASSERT_EQ(run.losses.size(), ref.losses.size());
  EXPECT_EQ(run.skipped, ref.skipped);
  EXPECT_TRUE(run.skipped.front()) << "the first step should overflow at scale 2^20";
  EXPECT_FALSE(run.skipped.back()) << "the scale should have backed off by the last step";
  ExpectLowPrecisionParity(ref, run, cai::testing::kFp16AdamW);
  ExpectZero3Bytes(ref, run, {.g = 3, .e = 2, .e_reduce = 2});
}

// cpu_offload: the fp32 shards, gradient sums and Adam state (16·S) live in the host tier;
// the device keeps the compute copy of the shard and the gathered units.
TEST(FsdpParity, ThreeRanks_CpuOffloadMatchesReferenceWithStateInHostMemory) {
  const TrainRun& ref = Reference({});
  const TrainRun run = Fsdp("offload", 3, "FULL_SHARD", {"plugin.fsdp.cpu_offload=true"});
  ExpectParity(ref, run, 1e-5);
  ExpectZero3Bytes(ref, run, {.g = 3});
  const Layout l = LayoutOf(ref, run, 3);
  const std::vector<double> host = PerRank(run, "peak_bytes", "host");
  const std::vector<double> device = PerRank(run, "peak_bytes", "device");
  ASSERT_EQ(host.size(), 3u);
  for (size_t r = 0; r < host.size(); ++r) {
    EXPECT_GE(host[r], 16.0 * l.shards);
    EXPECT_LE(host[r], 16.0 * l.shards + 4.0 * std::max(l.max_unit, l.root));
    // Device: the compute shard (4·S), the root and one block gathered with their gradients,
    // the previous unit's gradient and its reduce-scatter output still in flight, one more
    // reduce-scatter output and the step's sums; no gradient sums or optimizer state.
    EXPECT_LE(device[r], 4.0 * l.shards + 8.0 * 3 * (l.root + l.max_unit) +
                             4.0 * (3 + 2) * std::max(l.max_unit, l.root) +
                             8.0 * (2 + TrainableParams(ref)));
  }
  // bf16 compute over the offloaded fp32 state: the compute copy is cast in host memory before
  // its one copy over, a transient the host's estimate counts (Fsdp holds it to the host peak).
  const std::vector<std::string> bf16 = {"train.precision=bf16"};
  ExpectLowPrecisionParity(Reference(bf16),
                           Fsdp("offload_bf16", 3, "FULL_SHARD",
                                {"train.precision=bf16", "plugin.fsdp.cpu_offload=true"}),
                           cai::testing::kBf16AdamW);
}

// Sharded checkpoints: every rank writes only its own shards, named by unit and shard, rank 0
// the index; no "model/" tensor of a trainable parameter anywhere. Resumed on another world
// size, each rank reads only the saved slices overlapping its new shard, and training goes on
// exactly as the reference's uninterrupted run.
void ExpectShardedResume(int saved_on, int resumed_on) {
  const std::vector<std::string> sets = {"optimizer.decay_steps=6"};
  const TrainRun& ref = Reference(sets);
  ASSERT_EQ(ref.exit_code, 0) << ref.output;
  std::vector<std::string> first_sets = sets;
  first_sets.push_back("train.steps=3");
  first_sets.push_back("plugin.fsdp.state_dict_type=sharded");
  const TrainRun first = Fsdp("resume", saved_on, "FULL_SHARD", first_sets);
  ASSERT_EQ(first.exit_code, 0) << first.output;
  ASSERT_FALSE(first.checkpoint.empty()) << first.output;

  const Layout l = LayoutOf(ref, first, saved_on);
  for (int r = 0; r < saved_on; ++r) {
    cai::ckpt::RankFileReader file(first.checkpoint / cai::ckpt::RankFileName(r));
    double bytes = 0;
    for (const cai::ckpt::Entry& e : file.entries()) {
      if (e.kind != cai::ckpt::EntryKind::kTensor) continue;
      EXPECT_EQ(e.name.rfind("fsdp/", 0), 0u) << e.name;
      EXPECT_NE(e.name.find("." + std::to_string(r)), std::string::npos) << e.name;
      bytes += static_cast<double>(e.bytes);
    }
    // Parameters and two Adam slots of this rank's shards: 12·S, a 1/N of the model state.
    EXPECT_EQ(bytes, 12.0 * l.shards) << "rank " << r;
  }

  std::vector<std::string> resume_sets = sets;
  resume_sets.push_back("plugin.name=fsdp");
  resume_sets.push_back("plugin.fsdp.state_dict_type=full");
  resume_sets.push_back("checkpoint.resume=true");
  const TrainRun resumed = cai::testing::RunTrain(
      RunsDir() / ("resume_" + std::to_string(saved_on)), kTinyGptJob, resumed_on, resume_sets,
      CAI_FSDP_MANIFEST, /*resume=*/true, "resumed.txt");
  ASSERT_EQ(resumed.exit_code, 0) << resumed.output;
  ASSERT_EQ(resumed.losses.size(), 6u) << resumed.output;  // steps 1-3, then 4-6 appended
  ExpectParity(ref, resumed, 1e-5);
}

TEST(FsdpParity, SaveShardedOnTwoRanksResumeOnThree_MatchesReference) { ExpectShardedResume(2, 3); }

TEST(FsdpParity, SaveShardedOnThreeRanksResumeOnTwo_MatchesReference) { ExpectShardedResume(3, 2); }

// The consolidated checkpoint (the reference's layout) saved on 2 ranks loads on 3, and a
// checkpoint any strategy wrote in that layout loads into fsdp.
TEST(FsdpParity, SaveFullOnTwoRanksResumeOnThree_MatchesReference) {
  const std::vector<std::string> sets = {"optimizer.decay_steps=6"};
  const TrainRun& ref = Reference(sets);
  ASSERT_EQ(ref.exit_code, 0) << ref.output;
  const TrainRun first =
      Fsdp("resume", 2, "FULL_SHARD", {"optimizer.decay_steps=6", "train.steps=3"});
  ASSERT_EQ(first.exit_code, 0) << first.output;
  EXPECT_FALSE(cai::testing::ModelTensorNames(first.checkpoint).empty());
  const TrainRun resumed =
      cai::testing::RunTrain(RunsDir() / "resume_2", kTinyGptJob, 3,
                             {"optimizer.decay_steps=6", "plugin.name=fsdp",
                              "plugin.fsdp.state_dict_type=full", "checkpoint.resume=true"},
                             CAI_FSDP_MANIFEST, /*resume=*/true, "resumed.txt");
  ASSERT_EQ(resumed.exit_code, 0) << resumed.output;
  ASSERT_EQ(resumed.losses.size(), 6u) << resumed.output;
  ExpectParity(ref, resumed, 1e-5);
}

// Bad configurations fail before training, naming the key and what to do.
TEST(FsdpParity, BadConfigurationsFailClearly) {
  const std::vector<std::tuple<int, std::vector<std::string>, std::string>> cases = {
      {2,
       {"plugin.fsdp.sharding_strategy=HYBRID_SHARD", "plugin.fsdp.shard_group_size=3"},
       "shard_group_size = 3 does not divide the world size 2"},
      {1, {"plugin.fsdp.prefetch_limit=0"}, "prefetch_limit"},
      {1, {"plugin.fsdp.backward_prefetch=later"}, "backward_prefetch"},
      {1, {"plugin.fsdp.reduce_dtype=int8"}, "reduce_dtype"},
  };
  int k = 0;
  for (const auto& [nproc, sets, what] : cases) {
    std::vector<std::string> with = sets;
    with.push_back("plugin.name=fsdp");
    with.push_back("train.steps=1");
    const TrainRun r = Train("refused" + std::to_string(k++), nproc, with);
    EXPECT_NE(r.exit_code, 0) << what;
    EXPECT_NE(r.output.find(what), std::string::npos) << r.output;
  }
}

}  // namespace
