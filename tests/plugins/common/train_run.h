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

// A tensor of a checkpoint as fp32; a test failure (and nothing) when there is none.
std::vector<float> ReadCheckpointTensor(const std::filesystem::path& checkpoint,
                                        const std::string& name);
// Elements of the "model/*" tensors of rank 0's file: Ψ for the reference (tied counted once).
double ModelElements(const std::filesystem::path& checkpoint);

// Asserts that both runs succeeded and that `run` agrees with `ref` within `rtol`: every step's
// loss relative to the reference's, every "model/*" tensor by relative L2 error
// ||w - w_ref|| / ||w_ref|| (conformance::Compare; train_runner.h says why not element-wise).
void ExpectMatches(const TrainRun& ref, const TrainRun& run, double rtol);

}  // namespace cai::testing
