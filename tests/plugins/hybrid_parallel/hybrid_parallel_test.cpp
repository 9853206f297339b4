// libcai_hybrid_parallel end to end: `cai train` on 2, 3 and 4 real ranks, each run compared
// with the single-process reference (`plugin.name=none`) on the same job — same global batch,
// same initial weights — on every step's loss and grad norm and every final "model/*" tensor
// (tests/plugins/common/train_run.h), fp32 within 1e-5.
//
// The job: kTinyGptJob with 4 transformer blocks (so that 2 and 3 stages, and 2 stages of 2
// chunks, each get blocks), a global batch of 8 in 4 micro-batches (train.grad_accum), which is
// what the pipeline schedules. GPT-2 ties its head to the token embedding: the first and the
// last stage both hold it and sum its gradient.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <string>
#include <utility>
#include <vector>

#include "script_gpt.h"
#include "train_run.h"

namespace {

namespace fs = std::filesystem;
using cai::testing::ExpectMatches;
using cai::testing::TrainRun;

constexpr double kFp32Tolerance = 1e-5;
const std::string kPlugins = std::string(CAI_HYBRID_MANIFEST) + ":" + CAI_FSDP_MANIFEST;

fs::path RunsDir() {
  return fs::path(CAI_HYBRID_TEST_RUNS) /
         ::testing::UnitTest::GetInstance()->current_test_info()->name();
}

std::vector<std::string> Job(std::vector<std::string> sets) {
  sets.insert(sets.begin(), {"model.n_layer=4", "train.global_batch=8", "train.grad_accum=4"});
  return sets;
}

TrainRun Run(const std::string& name, int nproc, std::vector<std::string> sets, bool resume = false,
             const std::string& output = "output.txt") {
  return cai::testing::RunTrain(RunsDir() / name, cai::testing::kTinyGptJob, nproc, Job(sets),
                                kPlugins, resume, output);
}

TrainRun Reference(const std::string& name, std::vector<std::string> sets) {
  sets.push_back("plugin.name=none");
  return Run(name + "_ref", 1, sets);
}

// The --set list that picks hybrid_parallel with `options`, keys of [plugin.hybrid_parallel]
// ("pp_size=2").
std::vector<std::string> HybridSets(const std::vector<std::string>& options) {
  std::vector<std::string> sets = {"plugin.name=hybrid_parallel"};
  for (const std::string& o : options) sets.push_back("plugin.hybrid_parallel." + o);
  return sets;
}

// The value of `key` ("pp_size=") among the --set arguments (the last one given, as `cai
// train` takes it), or `fallback`.
int SetValue(const std::vector<std::string>& sets, const std::string& key, int fallback) {
  int value = fallback;
  for (const std::string& s : sets) {
    const size_t at = s.find(key);
    if (at != std::string::npos && (at == 0 || s[at - 1] == '.')) {
      value = std::stoi(s.substr(at + key.size()));
    }
  }
  return value;
}

// Without tensor parallelism the estimate (`cai plan`'s) is the model state of the pipeline
// rank that holds most, as its optimizer lays it out: the largest rank's device peak is that
// plus at most the activations and their gradients passed between stages, which the estimate
// leaves out (they depend on the batch): bounded here by two buffers each way per micro-batch
// and model chunk, of rows x seq_len x n_embd fp32 values. Left out: tensor
// parallelism and TorchScript models (the formula over Ψ), model.freeze, and zero_stage 2 under
// the job's 4 micro-batches (an fp32 shard the estimate, for one micro-batch, does not count).
void ExpectEstimateBoundsThePeak(const TrainRun& run, int nproc,
                                 const std::vector<std::string>& sets) {
  if (run.exit_code != 0 || SetValue(sets, "tp_size=", 1) > 1 ||
      cai::testing::Mentions(sets, "model.kind=torchscript") ||
      cai::testing::Mentions(sets, "model.freeze") || SetValue(sets, "zero_stage=", 0) == 2) {
    return;
  }
  const std::vector<double> estimate =
      cai::testing::PerRank(run, "memory_estimate_per_rank", "device_bytes");
  ASSERT_EQ(estimate.size(), 1u) << run.summary;
  ASSERT_NE(run.summary.find("the pipeline rank holding most"), std::string::npos) << run.summary;
  const std::vector<double> peaks = cai::testing::PerRank(run, "peak_bytes", "device");
  ASSERT_FALSE(peaks.empty()) << run.summary;
  const int pp = SetValue(sets, "pp_size=", 1);
  const int chunks = SetValue(sets, "num_model_chunks=", 1);
  const int micro_batches = SetValue(sets, "train.grad_accum=", 4);
  const int dp = nproc / (pp * SetValue(sets, "sp_size=", 1));
  const double rows = SetValue(sets, "train.global_batch=", 8) / double(dp * micro_batches);
  const double activations = pp > 1 ? 2.0 * 2 * micro_batches * chunks * std::ceil(rows) *
                                          SetValue(sets, "train.seq_len=", 16) *
                                          SetValue(sets, "model.n_embd=", 32) * 4
                                    : 0;
  const double largest = *std::max_element(peaks.begin(), peaks.end());
  EXPECT_GE(largest, estimate[0]) << run.summary;
  EXPECT_LE(largest, estimate[0] + activations) << run.summary;
}

TrainRun Hybrid(const std::string& name, int nproc, const std::vector<std::string>& options,
                std::vector<std::string> sets = {}) {
  const std::vector<std::string> plugin = HybridSets(options);
  sets.insert(sets.end(), plugin.begin(), plugin.end());
  TrainRun run = Run(name, nproc, sets);
  ExpectEstimateBoundsThePeak(run, nproc, Job(sets));
  return run;
}

// A checkpoint saved by one layout after 3 of 6 steps and resumed by another: the
// continuation must equal the uninterrupted reference `ref` of the job `sets`. `save` and
// `resume` are whole --set lists (the plugin and its keys). Returns the saved run.
struct ResumeLeg {
  std::string name;
  int save_nproc;
  std::vector<std::string> save;
  int resume_nproc;
  std::vector<std::string> resume;
};
TrainRun SaveAndResume(const TrainRun& ref, const std::vector<std::string>& sets,
                       const ResumeLeg& leg) {
  const fs::path dir = RunsDir() / leg.name;
  std::vector<std::string> first = sets;
  first.insert(first.end(), leg.save.begin(), leg.save.end());
  first.push_back("train.steps=3");
  const TrainRun saved =
      cai::testing::RunTrain(dir, cai::testing::kTinyGptJob, leg.save_nproc, Job(first), kPlugins);
  EXPECT_EQ(saved.exit_code, 0) << saved.output;
  EXPECT_FALSE(saved.checkpoint.empty()) << saved.output;
  if (saved.exit_code != 0 || saved.checkpoint.empty()) return saved;
  std::vector<std::string> resume = sets;
  resume.insert(resume.end(), leg.resume.begin(), leg.resume.end());
  resume.push_back("checkpoint.resume=true");
  const TrainRun resumed = cai::testing::RunTrain(dir, cai::testing::kTinyGptJob, leg.resume_nproc,
                                                  Job(resume), kPlugins, true, "resumed.txt");
  EXPECT_EQ(resumed.exit_code, 0) << resumed.output;
  EXPECT_EQ(resumed.losses.size(), 6u) << resumed.output;
  if (resumed.exit_code == 0) ExpectMatches(ref, resumed, kFp32Tolerance);
  return saved;
}

TEST(HybridParallel, Pp2_GptTiedEmbeddingMatchesReference) {
  const TrainRun ref = Reference("gpt", {});
  const TrainRun run = Hybrid("pp2", 2, {"pp_size=2"});
  ExpectMatches(ref, run, kFp32Tolerance);
  // Clipping is active (the norm exceeds optimizer.max_grad_norm every step).
  for (double norm : run.grad_norms) EXPECT_GT(norm, 0.05);
  // The first and the last stage both hold wte, the tied head reads it.
  EXPECT_NE(run.output.find("shared with other stages"), std::string::npos) << run.output;
}

TEST(HybridParallel, Pp3_GptAndLlamaMatchReference) {
  ExpectMatches(Reference("gpt", {}), Hybrid("pp3", 3, {"pp_size=3"}), kFp32Tolerance);
  const std::vector<std::string> llama = {"model.kind=llama", "model.n_kv_head=1"};
  ExpectMatches(Reference("llama", llama), Hybrid("pp3_llama", 3, {"pp_size=3"}, llama),
                kFp32Tolerance);
}

// Scale-sensitive: plain SGD, no momentum, clipping or warmup (train_run.h).
TEST(HybridParallel, PlainSgd_Pp2AndPp3MatchReference) {
  const TrainRun ref = Reference("sgd", cai::testing::kPlainSgdSets);
  for (int pp : {2, 3}) {
    SCOPED_TRACE("pp " + std::to_string(pp));
    ExpectMatches(ref,
                  Hybrid("sgd_pp" + std::to_string(pp), pp, {"pp_size=" + std::to_string(pp)},
                         cai::testing::kPlainSgdSets),
                  kFp32Tolerance);
  }
}

// Two pipelines of two stages: each replica trains on its half of the global batch, the
// gradients are summed over the replicas (zero_stage 0: DDP buckets; 1: ZeRO-1 shards).
TEST(HybridParallel, Pp2Dp2_BothZeroStagesMatchReference) {
  const TrainRun ref = Reference("gpt", {});
  for (int zero : {0, 1}) {
    SCOPED_TRACE("zero_stage " + std::to_string(zero));
    ExpectMatches(ref,
                  Hybrid("pp2dp2_zero" + std::to_string(zero), 4,
                         {"pp_size=2", "zero_stage=" + std::to_string(zero)}),
                  kFp32Tolerance);
  }
}

// Two ranks, two model chunks each: virtual stages 0 and 2 on rank 0, 1 and 3 on rank 1.
TEST(HybridParallel, Interleaved_Pp2TwoChunksMatchesReference) {
  ExpectMatches(
      Reference("gpt", {}),
      Hybrid("interleaved", 2, {"pp_size=2", "pp_style=\"interleaved\"", "num_model_chunks=2"}),
      kFp32Tolerance);
}

// The zero-bubble V: rank r holds virtual stages r and 2p − 1 − r, every backward split into
// its input-gradient pass and a weight-gradient pass run later (ABI 1.3's split backward).
// pp 2 (4 virtual stages of one block each) with GPT-2's tied embedding (stage 0 and the last
// on rank 0), pp 3 over 6 blocks in plain SGD (a gradient off by a factor shows), Llama with
// every block recomputing (the recomputation defers as the forward would), and pp 2 × dp 2
// under ZeRO-1, whose reduce-scatters start from the weight passes' GRAD_READY.
std::vector<std::string> Zbv(int pp, std::vector<std::string> extra = {}) {
  std::vector<std::string> options = {"pp_size=" + std::to_string(pp), "pp_style=\"zbv\"",
                                      "num_model_chunks=2"};
  options.insert(options.end(), extra.begin(), extra.end());
  return options;
}

TEST(HybridParallel, Zbv_Pp2AndPp3MatchReference) {
  const TrainRun ref = Reference("gpt", {});
  const TrainRun run = Hybrid("zbv_pp2", 2, Zbv(2));
  ExpectMatches(ref, run, kFp32Tolerance);
  EXPECT_NE(run.output.find("zbv over 4 micro-batches"), std::string::npos) << run.output;
  // No other pipeline rank holds the tied embedding: the V puts both its uses on rank 0.
  EXPECT_EQ(run.output.find("shared with other stages"), std::string::npos) << run.output;

  std::vector<std::string> sgd = cai::testing::kPlainSgdSets;
  sgd.push_back("model.n_layer=6");
  ExpectMatches(Reference("sgd6", sgd), Hybrid("zbv_pp3_sgd", 3, Zbv(3), sgd), kFp32Tolerance);

  const std::vector<std::string> llama = {"model.kind=llama", "model.n_kv_head=1"};
  ExpectMatches(
      Reference("llama", llama),
      Hybrid("zbv_llama_recompute", 2, Zbv(2, {"gradient_checkpointing_ratio=1.0"}), llama),
      kFp32Tolerance);
  ExpectMatches(ref, Hybrid("zbv_pp2dp2_zero1", 4, Zbv(2, {"zero_stage=1"})), kFp32Tolerance);
}

TEST(HybridParallel, Bf16AndFp16_Pp2MatchReferencePerTensor) {
  const std::vector<std::string> bf16 = {"train.precision=bf16"};
  ExpectMatches(Reference("bf16", bf16), Hybrid("bf16", 2, {"pp_size=2"}, bf16),
                cai::testing::kBf16AdamW);
  std::vector<std::string> fp16 = {"train.precision=fp16", "train.steps=8"};
  std::vector<std::string> ref16 = fp16, hp16 = fp16;
  for (const char* key : {"initial_scale=1048576", "hysteresis=1"}) {
    ref16.push_back(std::string("plugin.none.") + key);
    hp16.push_back(std::string("plugin.hybrid_parallel.") + key);
  }
  const TrainRun ref = Reference("fp16", ref16);
  ASSERT_EQ(ref.exit_code, 0) << ref.output;
  EXPECT_TRUE(ref.skipped.front()) << "the first step should overflow at scale 2^20";
  ExpectMatches(ref, Hybrid("fp16", 2, {"pp_size=2"}, hp16), cai::testing::kFp16AdamW);
}

// Saved by two pipeline stages, resumed by three data-parallel replicas (pp_size 1) and by
// fsdp on three ranks: the canonical layout loads anywhere, and every continuation equals the
// uninterrupted reference.
TEST(HybridParallel, Checkpoint_SavedByPp2ResumesUnderDp3AndFsdp) {
  // 2 micro-batches, so that 3 replicas of 8 rows (3 + 3 + 2) each have one per micro-batch.
  const std::vector<std::string> sets = {"optimizer.decay_steps=6", "train.grad_accum=2"};
  const TrainRun ref = Reference("resume", sets);
  std::vector<std::string> first = sets;
  first.push_back("train.steps=3");
  const TrainRun saved = Hybrid("saved", 2, {"pp_size=2"}, first);
  ASSERT_EQ(saved.exit_code, 0) << saved.output;
  ASSERT_FALSE(saved.checkpoint.empty()) << saved.output;
  for (const std::string& plugin : {std::string("hybrid_parallel"), std::string("fsdp")}) {
    SCOPED_TRACE(plugin);
    const fs::path dir = RunsDir() / ("resumed_" + plugin);
    fs::remove_all(dir);
    fs::create_directories(dir);
    fs::copy(RunsDir() / "saved", dir, fs::copy_options::recursive);
    std::vector<std::string> resume = sets;
    resume.push_back("plugin.name=" + plugin);
    resume.push_back("checkpoint.resume=true");
    if (plugin == "fsdp") resume.push_back("plugin.fsdp.state_dict_type=full");
    const TrainRun resumed = cai::testing::RunTrain(dir, cai::testing::kTinyGptJob, 3, Job(resume),
                                                    kPlugins, true, "resumed.txt");
    ASSERT_EQ(resumed.exit_code, 0) << resumed.output;
    ASSERT_EQ(resumed.losses.size(), 6u) << resumed.output;  // steps 1-3, then 4-6 appended
    ExpectMatches(ref, resumed, kFp32Tolerance);
  }
}

// Activation memory under 1F1B: stage r holds at most p - r micro-batches' activations at once
// (the first stage p), whatever the number of micro-batches m; all forwards first (GPipe) would
// hold m. Measured from LibTorch's own allocations (summary.json framework_peak_bytes) on a
// model large enough for activations to dominate, evaluation off (it runs a whole batch at
// once): the first stage's peak is the same at m = 4 and m = 16, while one more row per
// micro-batch adds A per micro-batch in flight (here about 1.2 MB; at m = 16 GPipe would hold
// 16·A). Asserted: peak(m=16) - peak(m=4) < A/2.
TEST(HybridParallel, OneFOneB_ActivationMemoryBoundedByStagesNotMicroBatches) {
  auto first_stage_peak = [&](const std::string& name, int m, int rows) {
    const TrainRun run =
        Hybrid(name, 2, {"pp_size=2"},
               {"model.n_embd=128", "model.n_ctx=64", "train.seq_len=64", "data.eval_fraction=0",
                "train.steps=2", "train.global_batch=" + std::to_string(m * rows),
                "train.grad_accum=" + std::to_string(m)});
    EXPECT_EQ(run.exit_code, 0) << run.output;
    const std::vector<double> peaks = cai::testing::PerRank(run, "rank", "framework_peak_bytes");
    EXPECT_EQ(peaks.size(), 2u) << run.summary;
    return peaks.empty() ? 0.0 : peaks[0];
  };
  const double m4 = first_stage_peak("m4", 4, 1), m16 = first_stage_peak("m16", 16, 1);
  const double per_micro_batch = (first_stage_peak("m16_rows2", 16, 2) - m16) / 2;
  std::printf(
      "first stage framework peak: m=4 %.0f B, m=16 %.0f B; one row more per "
      "micro-batch adds %.0f B per micro-batch in flight\n",
      m4, m16, per_micro_batch);
  ASSERT_GT(per_micro_batch, 0);
  EXPECT_LT(m16 - m4, per_micro_batch / 2);
}

// pp_size 1 is data parallelism: micro-batches under no_sync but the last, DDP buckets or
// ZeRO-2 over the world; and evaluation through the pipeline equals the reference's.
TEST(HybridParallel, DataParallelPathAndPipelinedEvaluation_MatchReference) {
  const std::vector<std::string> eval = {"train.eval_every=3", "train.eval_batches=2"};
  const TrainRun ref = Reference("eval", eval);
  ASSERT_EQ(ref.exit_code, 0) << ref.output;
  ASSERT_FALSE(std::isnan(ref.eval_loss));
  for (const std::vector<std::string>& options :
       {std::vector<std::string>{}, std::vector<std::string>{"zero_stage=2"},
        std::vector<std::string>{"pp_size=2"},
        std::vector<std::string>{"pp_size=2", "pp_style=\"interleaved\"", "num_model_chunks=2"}}) {
    std::string name = "eval";
    for (const std::string& o : options) name += "_" + o.substr(0, o.find('='));
    const TrainRun run = Hybrid(name, 2, options, eval);
    ExpectMatches(ref, run, kFp32Tolerance);
    EXPECT_NEAR(run.eval_loss, ref.eval_loss, kFp32Tolerance * ref.eval_loss) << name;
  }
}

// Each bad configuration fails before training, saying which key and what to do.
TEST(HybridParallel, BadConfigurations_FailClearly) {
  struct Case {
    int nproc;
    std::vector<std::string> options;
    std::vector<std::string> expected;
  };
  const std::vector<Case> cases = {
      {2,
       {"sp_size=2"},
       {"sp_size = 2 sizes the group of sequence_parallelism_mode = \"all_to_all\"",
        "or sp_size = 1"}},
      {2, {"enable_sequence_parallelism=true"}, {"set tp_size > 1"}},
      {3,
       {"pp_size=2"},
       {"pp_size x sp_size x tp_size = 2 x 1 x 1 does not divide the world of 3"}},
      {4,
       {"pp_size=2", "tp_size=3"},
       {"pp_size x sp_size x tp_size = 2 x 1 x 3 does not divide the world of 4"}},
      {3, {"tp_size=3"}, {"tp_size = 3", "must divide the attention heads (n_head) (2)"}},
      {2, {"tp_size=2", "make_vocab_size_divisible_by=-1"}, {"make_vocab_size_divisible_by"}},
      {2, {"pp_size=2", "zero_stage=2"}, {"zero_stage = 2 with pp_size > 1", "zero_stage = 1"}},
      {2, {"pp_size=2", "num_model_chunks=2"}, {"needs pp_style = \"interleaved\" or \"zbv\""}},
      {2,
       {"pp_size=2", "pp_style=\"zbv\""},
       {"pp_style = \"zbv\" needs num_model_chunks = 2 (got 1) and pp_size > 1"}},
      {2,
       {"pp_size=2", "pp_style=\"interleaved\"", "num_model_chunks=3"},
       {"4 transformer blocks cannot fill 6 virtual stages"}},
      {2, {"pp_size=2", "num_microbatches=8"}, {"num_microbatches = 8", "train.grad_accum = 4"}},
      {2, {"pp_size=2", "num_layers_per_stage=\"3,3\""}, {"must list 2 block counts", "\"2,2\""}},
      {2, {"pp_size=2", "pp_stlye=\"1f1b\""}, {"pp_style"}},
  };
  for (size_t i = 0; i < cases.size(); ++i) {
    SCOPED_TRACE("case " + std::to_string(i));
    const TrainRun run = Hybrid("bad" + std::to_string(i), cases[i].nproc, cases[i].options);
    EXPECT_NE(run.exit_code, 0) << run.output;
    for (const std::string& text : cases[i].expected) {
      EXPECT_NE(run.output.find(text), std::string::npos) << "no '" << text << "' in:\n"
                                                          << run.output;
    }
  }
}

}  // namespace

// ---- Tensor parallelism ----------------------------------------------------------------------

// Six heads of width 8 and an MLP of 192 split over 2 and 3 ranks.
const std::vector<std::string> kTpGpt = {"model.n_embd=48", "model.n_head=6"};

TEST(HybridParallel, Tp2AndTp3_GptMatchesReference) {
  const TrainRun ref = Reference("gpt_tp", kTpGpt);
  for (int tp : {2, 3}) {
    SCOPED_TRACE("tp " + std::to_string(tp));
    const TrainRun run =
        Hybrid("tp" + std::to_string(tp), tp, {"tp_size=" + std::to_string(tp)}, kTpGpt);
    ExpectMatches(ref, run, kFp32Tolerance);
  }
}

// Llama with grouped-query attention (4 heads sharing 2 key/value heads, 2 per rank), with the
// logits kept split (a distributed cross-entropy) and gathered (parallel_output = false), and
// with activation checkpointing (each block's forward, all-reduces included, recomputed).
TEST(HybridParallel, Tp2_LlamaGqaMatchesReference) {
  const std::vector<std::string> llama = {"model.kind=llama", "model.n_head=4",
                                          "model.n_kv_head=2"};
  const TrainRun ref = Reference("llama", llama);
  ExpectMatches(ref, Hybrid("llama_tp2", 2, {"tp_size=2"}, llama), kFp32Tolerance);
  ExpectMatches(ref, Hybrid("llama_tp2_gathered", 2, {"tp_size=2", "parallel_output=false"}, llama),
                kFp32Tolerance);
  std::vector<std::string> recompute = llama;
  recompute.push_back("model.activation_checkpointing=true");
  ExpectMatches(ref, Hybrid("llama_tp2_recompute", 2, {"tp_size=2"}, recompute), kFp32Tolerance);
}

// A vocabulary of 257 padded to 258 (make_vocab_size_divisible_by = 1) and to 384 (64 x 3):
// the padding rows never train and the checkpoint holds the 257 real ones.
TEST(HybridParallel, Tp_PaddedVocabularyMatchesReference) {
  std::vector<std::string> sets = kTpGpt;
  sets.push_back("model.vocab_size=257");
  const TrainRun ref = Reference("vocab257", sets);
  ExpectMatches(ref,
                Hybrid("vocab257_tp2", 2, {"tp_size=2", "make_vocab_size_divisible_by=1"}, sets),
                kFp32Tolerance);
  ExpectMatches(ref, Hybrid("vocab257_tp3", 3, {"tp_size=3"}, sets), kFp32Tolerance);
}

// Scale-sensitive: plain SGD, no momentum, clipping or warmup (train_run.h).
TEST(HybridParallel, PlainSgd_Tp2AndTp3MatchReference) {
  std::vector<std::string> sets = kTpGpt;
  sets.insert(sets.end(), cai::testing::kPlainSgdSets.begin(), cai::testing::kPlainSgdSets.end());
  const TrainRun ref = Reference("sgd_tp", sets);
  for (int tp : {2, 3}) {
    SCOPED_TRACE("tp " + std::to_string(tp));
    ExpectMatches(
        ref, Hybrid("sgd_tp" + std::to_string(tp), tp, {"tp_size=" + std::to_string(tp)}, sets),
        kFp32Tolerance);
  }
}

// Grids of four ranks: two tensor-parallel pipelines of two stages (the tied embedding held by
// both stages, split over each stage's pair), and two replicas of a tensor-parallel pair with
// DDP buckets and with ZeRO-1 over the replicas.
TEST(HybridParallel, Tp2Pp2AndTp2Dp2_MatchReference) {
  const TrainRun ref = Reference("grid", kTpGpt);
  ExpectMatches(ref, Hybrid("tp2pp2", 4, {"tp_size=2", "pp_size=2"}, kTpGpt), kFp32Tolerance);
  for (int zero : {0, 1}) {
    SCOPED_TRACE("zero_stage " + std::to_string(zero));
    ExpectMatches(ref,
                  Hybrid("tp2dp2_zero" + std::to_string(zero), 4,
                         {"tp_size=2", "zero_stage=" + std::to_string(zero)}, kTpGpt),
                  kFp32Tolerance);
  }
}

// model.init_device = "lazy": tensor parallelism draws the unsplit values and keeps its
// slices; a pipeline stage releases the other stages' parameters undrawn. Both train
// bit-identically to the eagerly built model.
TEST(HybridParallel, LazyInit_Tp2AndPp2TrainAsEager) {
  const TrainRun ref = Reference("lazy", kTpGpt);
  for (const char* layout : {"tp_size=2", "pp_size=2"}) {
    SCOPED_TRACE(layout);
    const std::string name = std::string(layout).substr(0, 2);
    const TrainRun eager = Hybrid(name + "_eager", 2, {layout}, kTpGpt);
    std::vector<std::string> lazy_sets = kTpGpt;
    lazy_sets.push_back("model.init_device=lazy");
    const TrainRun lazy = Hybrid(name + "_lazy", 2, {layout}, lazy_sets);
    ExpectMatches(ref, lazy, kFp32Tolerance);
    EXPECT_EQ(lazy.losses, eager.losses);
    EXPECT_EQ(lazy.grad_norms, eager.grad_norms);
  }
}

TEST(HybridParallel, Bf16_Tp2MatchesReferencePerTensor) {
  std::vector<std::string> bf16 = kTpGpt;
  bf16.push_back("train.precision=bf16");
  const TrainRun ref = Reference("bf16_tp", bf16);
  ExpectMatches(ref, Hybrid("bf16_tp2", 2, {"tp_size=2"}, bf16), cai::testing::kBf16AdamW);
  // Sequence parallelism: the gathers and reduce-scatters in bf16.
  ExpectMatches(ref, Hybrid("bf16_sp2", 2, {"tp_size=2", "enable_sequence_parallelism=true"}, bf16),
                cai::testing::kBf16AdamW);
  // Ulysses: q, k, v and the attention output all-to-all in bf16.
  ExpectMatches(ref,
                Hybrid("bf16_ulysses", 2,
                       {"sp_size=2", "enable_sequence_parallelism=true",
                        "sequence_parallelism_mode=\"all_to_all\""},
                       bf16),
                cai::testing::kBf16AdamW);
  // Ring attention: keys and values around the ring in bf16, their gradients in fp32.
  ExpectMatches(ref,
                Hybrid("bf16_ring_attn", 2,
                       {"sp_size=2", "enable_sequence_parallelism=true",
                        "sequence_parallelism_mode=\"ring_attn\""},
                       bf16),
                cai::testing::kBf16AdamW);
}

// Bytes and memory per step against their formulas. GPT-2 with L blocks, micro-batches of
// B x T tokens and width e: Megatron-LM all-reduces B·T·e elements once per block half in
// forward (g after attention and after the MLP) and once in backward (f before each), plus the
// embedding's g and the head's f: (4L + 2)·B·T·e per micro-batch; the distributed
// cross-entropy adds 3·B·T (maxima, denominators, target logits). ZeRO-1 moves the gradients
// by reduce-scatter, so the all-reduce bytes of tp 2 less those of dp 2 (which has only the
// step's agreement, the same on both) are exactly the tensor-parallel ones. Parameters and
// optimizer state per rank: the split ones 1/tp, the rest (norms, the biases added after a
// row-parallel projection, the positions) whole.
TEST(HybridParallel, Tp2_CommunicationAndMemoryMatchFormulas) {
  const TrainRun tp = Hybrid("tp2_zero1", 2, {"tp_size=2", "zero_stage=1"}, kTpGpt);
  const TrainRun dp = Hybrid("dp2_zero1", 2, {"zero_stage=1"}, kTpGpt);
  ASSERT_EQ(tp.exit_code, 0) << tp.output;
  ASSERT_EQ(dp.exit_code, 0) << dp.output;
  const double L = 4, micro_batches = 4, B = 8 / micro_batches, T = 16, e = 48, V = 256, F = 4 * e;
  const double per_micro_batch = (4 * L + 2) * B * T * e + 3 * B * T;
  const std::vector<double> tp_bytes =
      cai::testing::PerRank(tp, "comm_bytes_per_step_mean", "all_reduce");
  const std::vector<double> dp_bytes =
      cai::testing::PerRank(dp, "comm_bytes_per_step_mean", "all_reduce");
  ASSERT_EQ(tp_bytes.size(), 2u) << tp.summary;
  ASSERT_EQ(dp_bytes.size(), 2u) << dp.summary;
  for (int r = 0; r < 2; ++r) {
    EXPECT_EQ(tp_bytes[r] - dp_bytes[r], 4 * micro_batches * per_micro_batch) << "rank " << r;
  }
  const double split = V * e + L * (3 * e * e + 3 * e + e * e + F * e + F + e * F);
  const double whole = 32 * e + L * (2 * e + e + 2 * e + e) + 2 * e;  // wpe: n_ctx 32
  const std::vector<double> params = cai::testing::PerRank(tp, "strategy_bytes", "params");
  const std::vector<double> state = cai::testing::PerRank(tp, "strategy_bytes", "optimizer_state");
  ASSERT_EQ(params.size(), 2u) << tp.summary;
  for (int r = 0; r < 2; ++r) {
    EXPECT_EQ(params[r], 4 * (split / 2 + whole)) << "rank " << r;
    // ZeRO-1 over a data-parallel group of one: Adam's two fp32 slots of every local element.
    EXPECT_EQ(state[r], 2 * 4 * (split / 2 + whole)) << "rank " << r;
  }
}

// Bad tensor-parallel shapes fail before training with the numbers.
TEST(HybridParallel, Tp_UnsplittableModelsFailClearly) {
  const TrainRun kv = Hybrid("bad_kv", 2, {"tp_size=2"}, {"model.kind=llama", "model.n_kv_head=1"});
  EXPECT_NE(kv.exit_code, 0);
  EXPECT_NE(kv.output.find("tp_size = 2: apply_tensor_parallel: a tensor-parallel group of 2 ranks "
                           "must divide the key/value heads (n_kv_head) (1)"),
            std::string::npos)
      << kv.output;
  const TrainRun ffn =
      Hybrid("bad_ffn", 2, {"tp_size=2"}, {"model.n_head=2", "model.ffn_hidden=33"});
  EXPECT_NE(ffn.exit_code, 0);
  EXPECT_NE(ffn.output.find("must divide the MLP width (ffn_hidden) (33)"), std::string::npos)
      << ffn.output;
}

// Sequence parallelism, split_gather (Megatron-LM's): between the tensor-parallel regions each
// rank holds 1/tp of the sequence; norms, residuals and GPT-2's positions run on the shards,
// whose parameters' gradients the host sums over the group. A sequence of 18 splits over 2 and
// 3 ranks.
const std::vector<std::string> kSpGpt = {"model.n_embd=48", "model.n_head=6", "train.seq_len=18"};

TEST(HybridParallel, SequenceParallel_Tp2AndTp3_GptMatchesReference) {
  const TrainRun ref = Reference("gpt_sp", kSpGpt);
  for (int tp : {2, 3}) {
    SCOPED_TRACE("tp " + std::to_string(tp));
    const TrainRun run =
        Hybrid("sp_tp" + std::to_string(tp), tp,
               {"tp_size=" + std::to_string(tp), "enable_sequence_parallelism=true"}, kSpGpt);
    ExpectMatches(ref, run, kFp32Tolerance);
    EXPECT_NE(run.output.find("(sequence parallelism split_gather)"), std::string::npos)
        << run.output;
  }
}

// Llama with grouped-query attention (RoPE applied to the gathered sequence), plain SGD on
// GPT-2, tp 2 x pp 2, where the stages hand each other sequence shards, and GPT-2 with every
// block recomputed and the optional kernels.
TEST(HybridParallel, SequenceParallel_LlamaPlainSgdAndPipelineMatchReference) {
  const std::vector<std::string> llama = {"model.kind=llama", "model.n_kv_head=2",
                                          "train.seq_len=18"};
  const std::vector<std::string> sp = {"tp_size=2", "enable_sequence_parallelism=true"};
  ExpectMatches(Reference("llama_sp", llama), Hybrid("sp_llama", 2, sp, llama), kFp32Tolerance);
  std::vector<std::string> sgd = kSpGpt;
  sgd.insert(sgd.end(), cai::testing::kPlainSgdSets.begin(), cai::testing::kPlainSgdSets.end());
  ExpectMatches(Reference("sgd_sp", sgd), Hybrid("sp_sgd", 2, sp, sgd), kFp32Tolerance);
  const TrainRun ref = Reference("gpt_sp", kSpGpt);
  ExpectMatches(ref,
                Hybrid("sp_tp2_pp2", 4,
                       {"tp_size=2", "pp_size=2", "enable_sequence_parallelism=true"}, kSpGpt),
                kFp32Tolerance);
  // Every block recomputed in backward (its gathers and reduce-scatters with it), with the
  // memory-efficient attention and the fused activation.
  std::vector<std::string> recompute = kSpGpt;
  recompute.push_back("model.activation_checkpointing=true");
  ExpectMatches(ref,
                Hybrid("sp_recompute", 2,
                       {"tp_size=2", "enable_sequence_parallelism=true",
                        "enable_flash_attention=true", "enable_jit_fused=true"},
                       recompute),
                kFp32Tolerance);
}

// Bytes per step against the formula. Megatron-LM's sequence parallelism replaces each of the
// (4L + 2)·B·T·e all-reduces of tensor parallelism by an all-gather of the B·(T/t)·e shards and
// a reduce-scatter of the B·T·e partial sums (in bytes handed to the collectives; on a ring,
// (t-1)/t·N for each, so the same wire bytes as the all-reduce's 2(t-1)/t·N), and backward
// gathers the input of each of the 2L + 1 column-parallel regions again instead of keeping it
// (one more all-gather each: 1.5 × the all-gathers). The all-reduces left are the
// cross-entropy's 3·B·T and the gradients of the parameters used on sequence shards: per block
// two norms' weights and biases and the two row-parallel biases (6e), the final norm (2e) and
// the positions of the micro-batch (T·e). Both runs are otherwise the same (ZeRO-1 over one
// data-parallel rank), so their differences are exactly these.
TEST(HybridParallel, SequenceParallel_CommunicationMatchesFormula) {
  const TrainRun sp = Hybrid(
      "sp_tp2_zero1", 2, {"tp_size=2", "zero_stage=1", "enable_sequence_parallelism=true"}, kTpGpt);
  const TrainRun tp = Hybrid("tp2_zero1", 2, {"tp_size=2", "zero_stage=1"}, kTpGpt);
  ASSERT_EQ(sp.exit_code, 0) << sp.output;
  ASSERT_EQ(tp.exit_code, 0) << tp.output;
  const double L = 4, micro_batches = 4, B = 8 / micro_batches, T = 16, e = 48, t = 2;
  const double regions = (4 * L + 2) * B * T * e;  // elements per micro-batch
  const double partial = L * 6 * e + 2 * e + T * e;
  auto bytes = [](const TrainRun& run, const char* op) {
    return cai::testing::PerRank(run, "comm_bytes_per_step_mean", op);
  };
  const std::vector<double> sp_gather = bytes(sp, "all_gather"),
                            tp_gather = bytes(tp, "all_gather");
  const std::vector<double> sp_scatter = bytes(sp, "reduce_scatter"),
                            tp_scatter = bytes(tp, "reduce_scatter");
  const std::vector<double> sp_reduce = bytes(sp, "all_reduce"),
                            tp_reduce = bytes(tp, "all_reduce");
  for (const auto* v : {&sp_gather, &tp_gather, &sp_scatter, &tp_scatter, &sp_reduce, &tp_reduce}) {
    ASSERT_EQ(v->size(), 2u) << sp.summary << tp.summary;
  }
  for (int r = 0; r < 2; ++r) {
    SCOPED_TRACE("rank " + std::to_string(r));
    EXPECT_EQ(sp_gather[r] - tp_gather[r], 4 * micro_batches * 1.5 * regions / t);
    EXPECT_EQ(sp_scatter[r] - tp_scatter[r], 4 * micro_batches * regions);
    EXPECT_EQ(tp_reduce[r] - sp_reduce[r], 4 * micro_batches * (regions - partial));
  }
}

// ---- DeepSpeed-Ulysses (sequence_parallelism_mode = "all_to_all") ------------------------------

// The plugin options of sequence_parallelism_mode = `mode` over a group of `size_key` = n
// ranks, then `more`.
std::vector<std::string> SequenceParallel(const std::string& mode, const std::string& size_key,
                                          int n, std::vector<std::string> more) {
  more.insert(more.begin(),
              {"enable_sequence_parallelism=true", "sequence_parallelism_mode=\"" + mode + "\""});
  more.push_back(size_key + "=" + std::to_string(n));
  return more;
}
std::vector<std::string> Ulysses(int sp, std::vector<std::string> more = {}) {
  return SequenceParallel("all_to_all", "sp_size", sp, std::move(more));
}
std::vector<std::string> RingAttn(int sp, std::vector<std::string> more = {}) {
  return SequenceParallel("ring_attn", "sp_size", sp, std::move(more));
}
std::vector<std::string> Ring(int tp, std::vector<std::string> more = {}) {
  return SequenceParallel("ring", "tp_size", tp, std::move(more));
}

// `mode` over sp 2 and 3 against the reference on `sets`, with clipping active and evaluation:
// every rank of the sequence-parallel group evaluates its shard, and the loss is the whole
// batch's.
void ExpectSp2AndSp3MatchReference(const std::string& mode, std::vector<std::string> sets) {
  sets.insert(sets.end(), {"train.eval_every=3", "train.eval_batches=2"});
  const TrainRun ref = Reference("gpt_" + mode + "_eval", sets);
  ASSERT_FALSE(std::isnan(ref.eval_loss)) << ref.output;
  for (int sp : {2, 3}) {
    SCOPED_TRACE("sp " + std::to_string(sp));
    const TrainRun run = Hybrid(mode + "_sp" + std::to_string(sp), sp,
                                SequenceParallel(mode, "sp_size", sp, {}), sets);
    ExpectMatches(ref, run, kFp32Tolerance);
    EXPECT_NEAR(run.eval_loss, ref.eval_loss, kFp32Tolerance * ref.eval_loss);
    for (double norm : run.grad_norms) EXPECT_GT(norm, 0.05);  // clipping active
    EXPECT_NE(run.output.find("x sp " + std::to_string(sp) + " x tp 1 (sequence parallelism " +
                              mode + ")"),
              std::string::npos)
        << run.output;
  }
}

// Six heads and 18 positions over 2 and 3 ranks: each rank embeds and runs its 9 or 6
// positions and attends over all 18 for 3 or 2 heads.
TEST(HybridParallel, Ulysses_Sp2AndSp3_GptMatchesReference) {
  ExpectSp2AndSp3MatchReference("all_to_all", kSpGpt);
}

// Llama with grouped-query attention (RoPE at the shard's positions, key/value heads going
// with their queries), plain SGD, and every block recomputed with the memory-efficient
// attention and the fused activation.
TEST(HybridParallel, Ulysses_LlamaGqaPlainSgdAndRecomputeMatchReference) {
  const std::vector<std::string> llama = {"model.kind=llama", "model.n_embd=48", "model.n_head=6",
                                          "model.n_kv_head=2", "train.seq_len=18"};
  ExpectMatches(Reference("llama_sp", llama), Hybrid("ulysses_llama", 2, Ulysses(2), llama),
                kFp32Tolerance);
  std::vector<std::string> sgd = kSpGpt;
  sgd.insert(sgd.end(), cai::testing::kPlainSgdSets.begin(), cai::testing::kPlainSgdSets.end());
  ExpectMatches(Reference("sgd_sp", sgd), Hybrid("ulysses_sgd", 2, Ulysses(2), sgd),
                kFp32Tolerance);
  std::vector<std::string> recompute = kSpGpt;
  recompute.push_back("model.activation_checkpointing=true");
  ExpectMatches(
      Reference("gpt_sp", kSpGpt),
      Hybrid("ulysses_recompute", 2,
             Ulysses(2, {"enable_flash_attention=true", "enable_jit_fused=true"}), recompute),
      kFp32Tolerance);
}

// sp 2 on four ranks with each other axis: x dp 2 under ZeRO-1 (sharded over the four ranks of
// dp x sp), x pp 2 (the stages hand each other sequence shards), x tp 2 (Ulysses on the heads
// each tensor-parallel rank holds: 12 heads, 6 per tensor-parallel rank, 3 in each attention),
// with AdamW and clipping and with plain SGD.
TEST(HybridParallel, Ulysses_Sp2WithDpPpAndTp_MatchReference) {
  const TrainRun ref = Reference("gpt_sp", kSpGpt);
  ExpectMatches(ref, Hybrid("ulysses_dp2_zero1", 4, Ulysses(2, {"zero_stage=1"}), kSpGpt),
                kFp32Tolerance);
  ExpectMatches(ref, Hybrid("ulysses_pp2", 4, Ulysses(2, {"pp_size=2"}), kSpGpt), kFp32Tolerance);
  std::vector<std::string> heads = {"model.n_embd=48", "model.n_head=12", "train.seq_len=18"};
  ExpectMatches(Reference("gpt_12heads", heads),
                Hybrid("ulysses_tp2", 4, Ulysses(2, {"tp_size=2"}), heads), kFp32Tolerance);
  heads.insert(heads.end(), cai::testing::kPlainSgdSets.begin(), cai::testing::kPlainSgdSets.end());
  ExpectMatches(Reference("sgd_12heads", heads),
                Hybrid("ulysses_tp2_sgd", 4, Ulysses(2, {"tp_size=2"}), heads), kFp32Tolerance);
}

// Checkpoints under Ulysses: saved by sp 2 x dp 2 with ZeRO-1 (optimizer state sharded over the
// four ranks), resumed by sp 2 x pp 2; saved by fsdp on three ranks, resumed by sp 3. Every
// continuation equals the uninterrupted reference.
TEST(HybridParallel, Ulysses_CheckpointsResumeAcrossLayoutsAndStrategies) {
  std::vector<std::string> sets = kSpGpt;
  sets.insert(sets.end(), {"optimizer.decay_steps=6", "train.grad_accum=2"});
  const TrainRun ref = Reference("resume_sp", sets);
  const std::vector<ResumeLeg> legs = {
      {"sp2dp2_zero1_to_sp2pp2", 4, HybridSets(Ulysses(2, {"zero_stage=1"})), 4,
       HybridSets(Ulysses(2, {"pp_size=2"}))},
      {"fsdp_to_sp3",
       3,
       {"plugin.name=fsdp", "plugin.fsdp.state_dict_type=full"},
       3,
       HybridSets(Ulysses(3))}};
  for (const ResumeLeg& leg : legs) {
    SCOPED_TRACE(leg.name);
    SaveAndResume(ref, sets, leg);
  }
}

// Bytes per step against the formula. Per block and micro-batch each rank hands 4·B·(T/sp)·
// (q + kv) elements to all-to-alls (q, k, v packed into one forward and one backward, the
// output one each way; GPT-2: q = kv = n_embd); the rest is a data-parallel run's traffic over
// the same two ranks plus the loss's 2 floats per micro-batch.
TEST(HybridParallel, Ulysses_CommunicationMatchesFormula) {
  const TrainRun sp = Hybrid("ulysses_bytes", 2, Ulysses(2), kSpGpt);
  const TrainRun dp = Hybrid("dp_bytes", 2, {}, kSpGpt);
  ASSERT_EQ(sp.exit_code, 0) << sp.output;
  ASSERT_EQ(dp.exit_code, 0) << dp.output;
  const double L = 4, micro_batches = 4, B = 8 / micro_batches, T = 18, e = 48, s = 2;
  auto bytes = [](const TrainRun& run, const char* op) {
    return cai::testing::PerRank(run, "comm_bytes_per_step_mean", op);
  };
  const std::vector<double> a2a = bytes(sp, "all_to_all"), sp_reduce = bytes(sp, "all_reduce"),
                            dp_reduce = bytes(dp, "all_reduce");
  for (const auto* v : {&a2a, &sp_reduce, &dp_reduce}) {
    ASSERT_EQ(v->size(), 2u) << sp.summary << dp.summary;
  }
  for (int r = 0; r < 2; ++r) {
    SCOPED_TRACE("rank " + std::to_string(r));
    EXPECT_EQ(a2a[r], 4 * micro_batches * L * 4 * B * (T / s) * (e + e));
    EXPECT_EQ(sp_reduce[r] - dp_reduce[r], 4 * micro_batches * 2);
  }
}

TEST(HybridParallel, Ulysses_BadConfigurationsFailClearly) {
  struct Case {
    int nproc;
    std::vector<std::string> options, sets, expected;
  };
  const std::vector<Case> cases = {
      {2, Ulysses(2), {"train.seq_len=15"}, {"its length (15) must divide by sp_size"}},
      {4, Ulysses(4), kSpGpt, {"sp_size = 4", "attention heads (n_head: 6)", "divides it"}},
      {2,
       Ulysses(2, {"tp_size=2"}),
       {},
       {"sp_size x tp_size = 1 x 2 x 2 does not divide the world of 2"}},
      {2, Ulysses(1), {}, {"splits the sequence over a group of sp_size ranks: set sp_size > 1"}},
      {2,
       {"enable_sequence_parallelism=true", "sequence_parallelism_mode=\"ring\""},
       {},
       {"sequence_parallelism_mode = \"ring\" splits the sequence over the tensor-parallel "
        "group: set tp_size > 1"}},
      {2,
       Ulysses(2),
       {"model.kind=torchscript",
        "model.path=" + cai::testing::SaveScriptGpt((RunsDir() / "gpt.pt").string())},
       {"sequence parallelism needs a zoo model"}},
  };
  for (size_t i = 0; i < cases.size(); ++i) {
    SCOPED_TRACE("case " + std::to_string(i));
    const TrainRun run =
        Hybrid("bad" + std::to_string(i), cases[i].nproc, cases[i].options, cases[i].sets);
    EXPECT_NE(run.exit_code, 0) << run.output;
    for (const std::string& text : cases[i].expected) {
      EXPECT_NE(run.output.find(text), std::string::npos) << "no '" << text << "' in:\n"
                                                          << run.output;
    }
  }
}

// ---- Ring attention (sequence_parallelism_mode = "ring_attn") ---------------------------------

// 24 positions: 4 chunks of 6 at sp 2, 6 chunks of 4 at sp 3, each rank holding two.
const std::vector<std::string> kRingGpt = {"model.n_embd=48", "model.n_head=6", "train.seq_len=24"};

// GPT-2 at sp 2 and 3: every rank embeds its zigzag chunks (learned positions at their
// offsets) and attends over all 24 positions through the ring.
TEST(HybridParallel, RingAttn_Sp2AndSp3_GptMatchesReference) {
  ExpectSp2AndSp3MatchReference("ring_attn", kRingGpt);
}

// Llama with grouped-query attention (RoPE at the zigzag positions; 2 key/value heads, which
// Ulysses could not split 4 ways, at sp 4), plain SGD with no clipping, and every block
// recomputed (the ring runs again in backward).
TEST(HybridParallel, RingAttn_LlamaGqaPlainSgdAndRecomputeMatchReference) {
  const std::vector<std::string> llama = {"model.kind=llama", "model.n_embd=48", "model.n_head=6",
                                          "model.n_kv_head=2", "train.seq_len=24"};
  const TrainRun llama_ref = Reference("llama_ring", llama);
  ExpectMatches(llama_ref, Hybrid("ring_llama", 2, RingAttn(2), llama), kFp32Tolerance);
  ExpectMatches(llama_ref, Hybrid("ring_llama_sp4", 4, RingAttn(4), llama), kFp32Tolerance);
  std::vector<std::string> sgd = kRingGpt;
  sgd.insert(sgd.end(), cai::testing::kPlainSgdSets.begin(), cai::testing::kPlainSgdSets.end());
  ExpectMatches(Reference("sgd_ring", sgd), Hybrid("ring_sgd", 2, RingAttn(2), sgd),
                kFp32Tolerance);
  std::vector<std::string> recompute = kRingGpt;
  recompute.push_back("model.activation_checkpointing=true");
  ExpectMatches(Reference("gpt_ring", kRingGpt),
                Hybrid("ring_recompute", 2, RingAttn(2), recompute), kFp32Tolerance);
}

// sp 2 on four ranks with each other axis: x dp 2 under ZeRO-1 (sharded over dp x sp), x pp 2
// (the stages hand each other the zigzag shards), x tp 2 (the ring over each tensor-parallel
// rank's 3 heads).
TEST(HybridParallel, RingAttn_Sp2WithDpPpAndTp_MatchReference) {
  const TrainRun ref = Reference("gpt_ring", kRingGpt);
  ExpectMatches(ref, Hybrid("ring_dp2_zero1", 4, RingAttn(2, {"zero_stage=1"}), kRingGpt),
                kFp32Tolerance);
  ExpectMatches(ref, Hybrid("ring_pp2", 4, RingAttn(2, {"pp_size=2"}), kRingGpt), kFp32Tolerance);
  ExpectMatches(ref, Hybrid("ring_tp2", 4, RingAttn(2, {"tp_size=2"}), kRingGpt), kFp32Tolerance);
}

// A checkpoint written under ring attention (sp 2 x dp 2, ZeRO-1) resumed under Ulysses
// (sp 2 x pp 2): the layout does not depend on the mode. Without gradient accumulation: with
// it, AdamW's steps carry the online softmax's rounding to 1.1e-5 in one bias (grad_norm within
// 1e-7) without any checkpoint (the memory-efficient attention alone: 3.8e-6).
TEST(HybridParallel, RingAttn_CheckpointResumesUnderUlysses) {
  std::vector<std::string> sets = kRingGpt;
  sets.insert(sets.end(), {"optimizer.decay_steps=6"});
  SaveAndResume(Reference("resume_ring", sets), sets,
                {"ring_sp2dp2_to_ulysses_sp2pp2", 4, HybridSets(RingAttn(2, {"zero_stage=1"})), 4,
                 HybridSets(Ulysses(2, {"pp_size=2"}))});
}

// Bytes per step against the formula. Per block and micro-batch a rank sends its keys and
// values (2·B·t·kv elements, t = T/sp its positions; GPT-2: kv = n_embd) sp − 1 times forward
// and sp − 1 times again in backward, and their fp32 gradients sp times; it receives as much.
// Everything else is a data-parallel run's traffic plus the loss's 2 floats per micro-batch.
TEST(HybridParallel, RingAttn_CommunicationMatchesFormula) {
  const TrainRun dp = Hybrid("dp_ring_bytes", 2, {}, kRingGpt);
  ASSERT_EQ(dp.exit_code, 0) << dp.output;
  const std::vector<double> dp_reduce =
      cai::testing::PerRank(dp, "comm_bytes_per_step_mean", "all_reduce");
  const double L = 4, micro_batches = 4, B = 8 / micro_batches, T = 24, e = 48;
  for (int sp : {2, 3}) {
    SCOPED_TRACE("sp " + std::to_string(sp));
    const TrainRun run = Hybrid("ring_bytes" + std::to_string(sp), sp, RingAttn(sp), kRingGpt);
    ASSERT_EQ(run.exit_code, 0) << run.output;
    auto bytes = [&](const char* op) {
      return cai::testing::PerRank(run, "comm_bytes_per_step_mean", op);
    };
    const std::vector<double> sent = bytes("send"), received = bytes("recv"),
                              reduce = bytes("all_reduce");
    ASSERT_EQ(sent.size(), size_t(sp)) << run.summary;
    ASSERT_EQ(reduce.size(), size_t(sp)) << run.summary;
    const double kv = 2 * B * (T / sp) * e * 4;
    const double per_block = (sp - 1) * kv + (sp - 1) * kv + sp * kv;
    for (int r = 0; r < sp; ++r) {
      SCOPED_TRACE("rank " + std::to_string(r));
      EXPECT_EQ(sent[r], micro_batches * L * per_block);
      EXPECT_EQ(received[r], sent[r]);
      // dp's two ranks' all-reduce of the gradients; sp's ranks reduce the same bytes.
      EXPECT_EQ(reduce[r] - dp_reduce[0], 4 * micro_batches * 2);
    }
  }
}

TEST(HybridParallel, RingAttn_BadConfigurationsFailClearly) {
  // 18 positions divide by sp (2) but not into 2 x sp chunks.
  const TrainRun odd = Hybrid("ring_odd", 2, RingAttn(2), {"train.seq_len=18"});
  EXPECT_NE(odd.exit_code, 0);
  EXPECT_NE(odd.output.find("2 x sp_size = 4 equal chunks"), std::string::npos) << odd.output;
  EXPECT_NE(odd.output.find("its length (18) must divide by 4"), std::string::npos) << odd.output;
  const TrainRun one = Hybrid("ring_sp1", 2, RingAttn(1), {});
  EXPECT_NE(one.exit_code, 0);
  EXPECT_NE(one.output.find("sequence_parallelism_mode = \"ring_attn\" splits the sequence over "
                            "a group of sp_size ranks: set sp_size > 1"),
            std::string::npos)
      << one.output;
}

// ---- split_gather as rings (sequence_parallelism_mode = "ring") --------------------------------

// The all-gathers before the column-parallel projections and the reduce-scatters after the
// row-parallel ones as rings of tp − 1 steps: tp 2 and 3 (three chunks per ring).
TEST(HybridParallel, SequenceParallelRing_Tp2AndTp3MatchReference) {
  const TrainRun ref = Reference("gpt_sp", kSpGpt);
  for (int tp : {2, 3}) {
    SCOPED_TRACE("tp " + std::to_string(tp));
    const TrainRun run = Hybrid("ring_tp" + std::to_string(tp), tp, Ring(tp), kSpGpt);
    ExpectMatches(ref, run, kFp32Tolerance);
    for (double norm : run.grad_norms) EXPECT_GT(norm, 0.05);  // clipping active
    EXPECT_NE(run.output.find("(sequence parallelism ring)"), std::string::npos) << run.output;
  }
}

// Llama with GQA and plain SGD (no clipping), a pipeline, every block recomputed.
TEST(HybridParallel, SequenceParallelRing_LlamaPlainSgdPipelineAndRecomputeMatchReference) {
  const TrainRun ref = Reference("gpt_sp", kSpGpt);
  std::vector<std::string> llama = {"model.kind=llama", "model.n_kv_head=2", "train.seq_len=18"};
  llama.insert(llama.end(), cai::testing::kPlainSgdSets.begin(), cai::testing::kPlainSgdSets.end());
  ExpectMatches(Reference("llama_sgd_ring", llama), Hybrid("ring_llama_sgd", 2, Ring(2), llama),
                kFp32Tolerance);
  ExpectMatches(ref, Hybrid("ring_tp2_pp2", 4, Ring(2, {"pp_size=2"}), kSpGpt), kFp32Tolerance);
  std::vector<std::string> recompute = kSpGpt;
  recompute.push_back("model.activation_checkpointing=true");
  ExpectMatches(ref, Hybrid("ring_recompute", 2, Ring(2), recompute), kFp32Tolerance);
}

// Bytes per step against split_gather's. Every gather and reduce-scatter around a projection
// becomes tp − 1 sends: a ring all-gather sends (tp − 1) × the shard a collective one is handed,
// a ring reduce-scatter (tp − 1)/tp × the partial sums; the embedding's reduce-scatter (forward)
// and all-gather (backward), with no matmul to hide behind, stay collectives: B·T·e and
// B·(T/tp)·e elements per micro-batch. The all-reduces are the same.
TEST(HybridParallel, SequenceParallelRing_CommunicationMatchesFormula) {
  const TrainRun ring = Hybrid("ring_tp2_zero1", 2, Ring(2, {"zero_stage=1"}), kTpGpt);
  const TrainRun sg = Hybrid(
      "sg_tp2_zero1", 2, {"tp_size=2", "zero_stage=1", "enable_sequence_parallelism=true"}, kTpGpt);
  const TrainRun tp = Hybrid("tp2_zero1", 2, {"tp_size=2", "zero_stage=1"}, kTpGpt);
  for (const TrainRun* run : {&ring, &sg, &tp}) ASSERT_EQ(run->exit_code, 0) << run->output;
  const double micro_batches = 4, B = 8 / micro_batches, T = 16, e = 48, t = 2;
  auto bytes = [](const TrainRun& run, const char* op) {
    const std::vector<double> v = cai::testing::PerRank(run, "comm_bytes_per_step_mean", op);
    EXPECT_EQ(v.size(), 2u) << op << ": " << run.summary;
    return v.size() == 2u ? v : std::vector<double>(2, 0.0);
  };
  const std::vector<double> sent = bytes(ring, "send"), received = bytes(ring, "recv");
  for (int r = 0; r < 2; ++r) {
    SCOPED_TRACE("rank " + std::to_string(r));
    const double ring_gather = bytes(ring, "all_gather")[r] - bytes(tp, "all_gather")[r];
    const double ring_scatter = bytes(ring, "reduce_scatter")[r] - bytes(tp, "reduce_scatter")[r];
    const double sg_gather = bytes(sg, "all_gather")[r] - bytes(tp, "all_gather")[r];
    const double sg_scatter = bytes(sg, "reduce_scatter")[r] - bytes(tp, "reduce_scatter")[r];
    EXPECT_EQ(ring_gather, 4 * micro_batches * B * (T / t) * e);
    EXPECT_EQ(ring_scatter, 4 * micro_batches * B * T * e);
    EXPECT_EQ(sent[r],
              (t - 1) * (sg_gather - ring_gather) + (t - 1) / t * (sg_scatter - ring_scatter));
    EXPECT_GT(sent[r], 0);
    EXPECT_EQ(received[r], sent[r]);
    EXPECT_EQ(bytes(ring, "all_reduce")[r], bytes(sg, "all_reduce")[r]);
  }
}

TEST(HybridParallel, SequenceParallel_OddSequenceFailsClearly) {
  for (const char* mode : {"split_gather", "ring"}) {
    SCOPED_TRACE(mode);
    const TrainRun odd = Hybrid(std::string("sp_odd_") + mode, 2,
                                {"tp_size=2", "enable_sequence_parallelism=true",
                                 "sequence_parallelism_mode=\"" + std::string(mode) + "\""},
                                {"train.seq_len=15"});
    EXPECT_NE(odd.exit_code, 0);
    EXPECT_NE(odd.output.find("the sequence length (15) must divide by tp (2)"), std::string::npos)
        << odd.output;
  }
}

// A TorchScript GPT (tests/host/model/script_gpt.h) split by a policy file, Shardformer's
// custom policy: q/k/v fused in three blocks, the MLP up projection and the head
// column-parallel (the logits gathered), the output projections row-parallel, n_head divided.
// AdamW with clipping and plain SGD, each against the reference.
TEST(HybridParallel, TorchScriptPolicy_Tp2MatchesReference) {
  const std::vector<std::string> sets = {
      "model.kind=torchscript",
      "model.path=" + cai::testing::SaveScriptGpt((RunsDir() / "gpt.pt").string()),
      "model.tp_policy=" + cai::testing::WriteText((RunsDir() / "policy.toml").string(),
                                                   cai::testing::kScriptGptPolicy)};
  const TrainRun run = Hybrid("script_tp2", 2, {"tp_size=2"}, sets);
  ExpectMatches(Reference("script", sets), run, kFp32Tolerance);
  for (double norm : run.grad_norms) EXPECT_GT(norm, 0.05);  // clipping active
  std::vector<std::string> sgd = sets;
  sgd.insert(sgd.end(), cai::testing::kPlainSgdSets.begin(), cai::testing::kPlainSgdSets.end());
  ExpectMatches(Reference("script_sgd", sgd), Hybrid("script_sgd_tp2", 2, {"tp_size=2"}, sgd),
                kFp32Tolerance);
}

TEST(HybridParallel, TorchScriptPolicy_MissingOrMisplacedFailsClearly) {
  const std::string model = cai::testing::SaveScriptGpt((RunsDir() / "gpt.pt").string());
  const TrainRun none =
      Hybrid("no_policy", 2, {"tp_size=2"}, {"model.kind=torchscript", "model.path=" + model});
  EXPECT_NE(none.exit_code, 0);
  EXPECT_NE(none.output.find("has no tensor-parallel policy"), std::string::npos) << none.output;
  EXPECT_NE(none.output.find("model.tp_policy"), std::string::npos) << none.output;
  const TrainRun missing = Hybrid("missing_policy", 2, {"tp_size=2"},
                                  {"model.kind=torchscript", "model.path=" + model,
                                   "model.tp_policy=/nonexistent/policy.toml"});
  EXPECT_NE(missing.exit_code, 0);
  EXPECT_NE(missing.output.find("model.tp_policy: policy file '/nonexistent/policy.toml' not "
                                "found"),
            std::string::npos)
      << missing.output;
  const TrainRun zoo = Hybrid("zoo_policy", 2, {"tp_size=2"}, {"model.tp_policy=policy.toml"});
  EXPECT_NE(zoo.exit_code, 0);
  EXPECT_NE(zoo.output.find("model.tp_policy is for TorchScript models"), std::string::npos)
      << zoo.output;
}

// The checkpoint matrix: saved by tp 2 x pp 2, resumed by pp 2 x dp 2 and by fsdp on three
// ranks; saved by fsdp on three ranks, resumed by tp 2 x pp 2. The canonical layout holds the
// whole tensors (the vocabulary's padding dropped), and every continuation equals the
// uninterrupted reference.
TEST(HybridParallel, Checkpoint_Tp2Pp2AndOtherGridsAndFsdpResumeEachOther) {
  std::vector<std::string> sets = kTpGpt;
  sets.insert(sets.end(), {"optimizer.decay_steps=6", "train.grad_accum=2"});
  const TrainRun ref = Reference("resume_tp", sets);
  const std::vector<std::string> tp2pp2 = HybridSets({"tp_size=2", "pp_size=2"});
  const std::vector<std::string> pp2dp2 = HybridSets({"pp_size=2"});
  const std::vector<std::string> fsdp = {"plugin.name=fsdp", "plugin.fsdp.state_dict_type=full"};
  const std::vector<ResumeLeg> legs = {{"tp2pp2_to_pp2dp2", 4, tp2pp2, 4, pp2dp2},
                                       {"tp2pp2_to_fsdp", 4, tp2pp2, 3, fsdp},
                                       {"fsdp_to_tp2pp2", 3, fsdp, 4, tp2pp2}};
  for (const ResumeLeg& leg : legs) {
    SCOPED_TRACE(leg.name);
    const TrainRun saved = SaveAndResume(ref, sets, leg);
    if (saved.checkpoint.empty()) continue;
    // The whole shapes: the fused q/k/v of 3·48 rows, the 256-row vocabulary.
    EXPECT_EQ(cai::testing::ReadCheckpointTensor(saved.checkpoint, "model/blocks.0.attn.qkv.weight")
                  .size(),
              3u * 48 * 48);
    EXPECT_EQ(cai::testing::ReadCheckpointTensor(saved.checkpoint, "model/wte.weight").size(),
              256u * 48);
  }
}

// Shardformer's optimisations with tensor parallelism: Llama (RMSNorm, SwiGLU and attention all
// replaced) at tp 2 with half of each stage's blocks recomputed; GPT-2 over two stages with the
// first block of stage 0 and both of stage 1 recomputed and the fused bias + GELU; and the same
// kernels from the job's model.* keys under plain data parallelism.
TEST(HybridParallel, AllOptimizationsAndPerStageRecompute_MatchReference) {
  const std::vector<std::string> llama = {"model.kind=llama", "model.n_head=4",
                                          "model.n_kv_head=2"};
  ExpectMatches(
      Reference("llama_opt", llama),
      Hybrid("llama_tp2_all", 2,
             {"tp_size=2", "enable_all_optimization=true", "gradient_checkpointing_ratio=0.5"},
             llama),
      kFp32Tolerance);
  const TrainRun ref = Reference("gpt_opt", {});
  const TrainRun staged =
      Hybrid("pp2_ckpt", 2,
             {"pp_size=2", "enable_jit_fused=true", "enable_flash_attention=true",
              "num_ckpt_layers_per_stage=\"1,2\""});
  ExpectMatches(ref, staged, kFp32Tolerance);
  // 4 blocks (units 1-4) over 2 stages: the first of stage 0, both of stage 1.
  EXPECT_NE(staged.output.find("virtual stage 0 recomputes units [1] in backward"),
            std::string::npos)
      << staged.output;
  EXPECT_NE(staged.output.find("virtual stage 1 recomputes units [3, 4] in backward"),
            std::string::npos)
      << staged.output;
  ExpectMatches(ref,
                Hybrid("dp2_model_keys", 2, {},
                       {"model.memory_efficient_attention=true", "model.fused_activation=true",
                        "model.fused_normalization=true"}),
                kFp32Tolerance);
  const TrainRun bad = Hybrid("bad_ckpt", 2, {"pp_size=2", "num_ckpt_layers_per_stage=\"1,2,1\""});
  EXPECT_NE(bad.exit_code, 0);
  EXPECT_NE(bad.output.find("lists 3 counts for 2 virtual stages"), std::string::npos)
      << bad.output;
  const TrainRun many = Hybrid("many_ckpt", 2, {"pp_size=2", "num_ckpt_layers_per_stage=\"3\""});
  EXPECT_NE(many.exit_code, 0);
  EXPECT_NE(many.output.find("to recompute 3 blocks but it holds 2"), std::string::npos)
      << many.output;
}

// Activation memory per block against Korthikanti et al. (2022, "Reducing Activation
// Recomputation in Large Transformer Models", section 4), restated for this model: fp32 (4
// bytes), no dropout (no masks, no dropout outputs), so a GPT-2 block keeps its input and its
// two norms' outputs and the attention's residual (4·s·b·h elements, whole on every rank),
// q/k/v, the attention output and the MLP's two 4h-wide tensors (12·s·b·h, split over tp),
// and the softmax output (a·s²·b, split over tp): 4·s·b·h·(4 + 12/t) + 4·a·s²·b/t bytes.
// With selective recomputation (their section 4.2: the attention core recomputed in backward,
// which the memory-efficient attention does block by block) the a·s²·b term goes; the kernel
// keeps the rows' log-sum-exp instead (a·s·b/t floats). With full recomputation (activation
// checkpointing of every block) a block keeps its input alone, 4·s·b·h bytes. Sequence
// parallelism (their section 4.2.2) splits the whole 4·s·b·h over the group too. Measured as
// LibTorch's peak over the steps (summary.json framework_step_peak_bytes, the same on every
// rank) at 8 blocks less at 4, over 4,
// with the gradients in the data-parallel buckets (gradient_as_bucket_view), so that
// LibTorch's own gradient tensors do not count.
TEST(HybridParallel, ActivationMemoryPerBlock_MatchesKorthikanti) {
  const double s = 64, b = 4, h = 128, a = 4;
  enum Recompute { kNone, kSelective, kFull };
  const char* const kNames[] = {"no recomputation", "selective recomputation",
                                "full recomputation"};
  auto per_block = [&](int tp, Recompute recompute, bool sequence) {
    std::vector<double> peaks;
    for (int layers : {4, 8}) {
      const TrainRun run = Hybrid(
          "act_tp" + std::to_string(tp) + "_l" + std::to_string(layers) + "_" +
              std::to_string(recompute) + (sequence ? "_sp" : ""),
          tp,
          // Gradients straight into the buckets (the pool's): LibTorch holds activations alone.
          {"tp_size=" + std::to_string(tp), "gradient_as_bucket_view=true",
           std::string("enable_sequence_parallelism=") + (sequence ? "true" : "false")},
          {"model.n_layer=" + std::to_string(layers), "model.n_embd=128", "model.n_head=4",
           "model.n_ctx=64", "train.seq_len=64", "train.global_batch=4", "train.grad_accum=1",
           "train.steps=2", "data.eval_fraction=0",
           std::string("model.memory_efficient_attention=") +
               (recompute == kSelective ? "true" : "false"),
           std::string("model.activation_checkpointing=") +
               (recompute == kFull ? "true" : "false")});
      EXPECT_EQ(run.exit_code, 0) << run.output;
      const std::vector<double> p = cai::testing::PerRank(run, "rank", "framework_step_peak_bytes");
      EXPECT_EQ(p.size(), size_t(tp)) << run.summary;
      peaks.push_back(p.empty() ? 0 : p[0]);
    }
    return (peaks[1] - peaks[0]) / 4;
  };
  struct Case {
    int tp;
    Recompute recompute;
    bool sequence;
  };
  for (const Case& c : std::vector<Case>{{1, kNone, false},
                                         {1, kSelective, false},
                                         {1, kFull, false},
                                         {2, kNone, false},
                                         {2, kSelective, false},
                                         {2, kFull, false},
                                         {2, kNone, true},
                                         {2, kSelective, true},
                                         {2, kFull, true}}) {
    const double t = c.tp;
    const double measured = per_block(c.tp, c.recompute, c.sequence);
    // Sequence parallelism splits the 4·s·b·h kept whole over the group too.
    const double shared = c.sequence ? 4 / t : 4;
    const double formula = c.recompute == kFull ? 4 * s * b * h * shared / 4
                           : c.recompute == kSelective
                               ? 4 * s * b * h * (shared + 12 / t) + 4 * a * s * b / t
                               : 4 * s * b * h * (shared + 12 / t) + 4 * a * s * s * b / t;
    std::printf(
        "tp %d%s, %s: activation memory per block %.0f B measured, %.0f B by the "
        "formula (%+.2f%%)\n",
        c.tp, c.sequence ? " with sequence parallelism" : "", kNames[c.recompute], measured,
        formula, 100 * (measured / formula - 1));
    EXPECT_NEAR(measured, formula, 0.1 * formula)
        << "tp " << c.tp << ", " << kNames[c.recompute] << ", sequence " << c.sequence;
  }
}
