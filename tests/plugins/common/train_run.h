// Runs `cai train` as a subprocess (1 or more real ranks over Gloo) and reads what it left:
// metrics.jsonl, summary.json and the latest checkpoint; compares a run with the
// single-process reference (`plugin.name = "none"`).
#pragma once

#include <filesystem>
#include <string>
#include <vector>

#include "train_runner.h"

namespace cai::testing {

// A tiny GPT-2 job (tied lm_head and wte): two parameter groups with different LR and weight
// decay, clipping at a norm every step exceeds, warmup into cosine decay, 6 steps of a global
// batch of 6, a checkpoint at the end.
extern const char* const kTinyGptJob;

// metrics.jsonl, summary.json and the latest checkpoint of a run (sdk/conformance's runner,
// which the conformance suite's behaviour checks use too).
using TrainRun = conformance::TrainRun;
using conformance::JsonNumber;
using conformance::ModelTensorNames;
using conformance::ReadFile;

// Writes `job` to `dir`/job.toml (unless `resume`, which keeps `dir` and its run) and runs
// `cai train` on it with `nproc` ranks, run directory `dir`/run, the `sets` as --set, and only
// the plugin of `manifest` discoverable. Output goes to `dir`/<output_name>.
TrainRun RunTrain(const std::filesystem::path& dir, const std::string& job, int nproc,
                  const std::vector<std::string>& sets, const std::string& manifest,
                  bool resume = false, const std::string& output_name = "output.txt");

// summary.json's per-rank `object`.`field` (e.g. "comm_bytes_per_step_mean", "reduce_scatter"),
// in rank order.
std::vector<double> PerRank(const TrainRun& run, const std::string& object,
                            const std::string& field);

// Expects every rank's measured wire bytes of collective `op` per step (summary.json's
// "wire_bytes_per_step_mean") to be what the op's algorithm sends for the bytes handed to it:
// `factor` x handed (ring all-reduce 2(N-1)/N; reduce-scatter (N-1)/N; all-gather N-1, of its
// input), less at most Gloo's rounding of ring segments (0.1%), plus Gloo's framing: 48-byte
// preambles, three per message, at most 2% on the tiny models' tensors, so 5% is allowed. A
// reduce-scatter done as an all-reduce sends twice (N-1)/N of its input and fails.
void ExpectWireBytes(const TrainRun& run, const std::string& op, double factor);

// Whether any of the --set arguments `sets` contains `part` ("model.freeze").
bool Mentions(const std::vector<std::string>& sets, const std::string& part);

// Expects the strategy's estimate_memory (summary.json's memory_estimate_per_rank, what `cai
// plan` shows) to be every rank's measured device pool peak, up to the few bytes the pool
// counts for empty buffers (64 B allowed): for strategies that size their own layout from the
// model's and replay their schedule's buffers. Nothing to check for a run that failed.
void ExpectEstimateIsTheDevicePeak(const TrainRun& run);
// The same for the host tiers' estimate and the peaks of host and pinned host memory, summed.
void ExpectEstimateIsTheHostPeak(const TrainRun& run);

// A tensor of a checkpoint as fp32; a test failure (and nothing) when there is none.
std::vector<float> ReadCheckpointTensor(const std::filesystem::path& checkpoint,
                                        const std::string& name);
// Elements of the "model/*" tensors of rank 0's file: Ψ for the reference (tied counted once).
double ModelElements(const std::filesystem::path& checkpoint);

// Asserts that both runs succeeded and that `run` agrees with `ref` within `rtol`: every step's
// loss and grad_norm and skipped flag, every "model/*" tensor by relative L2 error
// ||w - w_ref|| / ||w_ref|| (conformance::Compare; train_runner.h says why not element-wise).
// A strategy that reports no grad_norm fails it. Prints the largest errors it measured.
void ExpectMatches(const TrainRun& ref, const TrainRun& run, double rtol);
// The same with a bound per step and one per tensor, for 16-bit training: each tensor is held
// to its own relative error, so a small tensor's error is not hidden in a whole-model norm
// dominated by the LayerNorm gains.
void ExpectMatches(const TrainRun& ref, const TrainRun& run, conformance::Tolerance tolerance);

// 16-bit bounds (per step: loss and grad norm; per tensor: relative L2), about 3x the largest
// error measured on the tiny jobs across ddp, low_level_zero and fsdp at 2 and 3 ranks (the
// tests print what they measure): bf16 AdamW 8.7e-4 per step, 5.7e-2 per tensor; bf16 plain
// SGD (lr 0.05) 1.6e-3 and 8.1e-3; fp16 AdamW 1.5e-4 and 1.0e-2. AdamW carries a
// rounding-flipped near-zero gradient into a full learning-rate step, which moves a small
// tensor (a LayerNorm bias of norm 0.013) most, so its per-tensor bound is loose; SGD's is tight.
// The reference is that far from itself: split into other numbers of micro-batches it moves
// 5.7e-2 per tensor under AdamW and 8.2e-3 under SGD (ddp_parity_test.cpp's noise-floor test,
// which also holds these bounds within 5x of that floor).
inline const conformance::Tolerance kBf16AdamW{3e-3, 1.5e-1};
inline const conformance::Tolerance kBf16Sgd{5e-3, 3e-2};
inline const conformance::Tolerance kFp16AdamW{5e-4, 3e-2};

// A scale-sensitive job: plain SGD, no momentum, no weight decay, no clipping, no warmup,
// constant learning rate. AdamW normalises a gradient off by a constant factor away and clipping
// caps it; this job shows it (a gradient averaged instead of summed over N ranks trains at 1/N
// of the learning rate).
extern const std::vector<std::string> kPlainSgdSets;

}  // namespace cai::testing
