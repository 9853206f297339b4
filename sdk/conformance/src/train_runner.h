// Runs `cai train` as a subprocess (1 or more real ranks over Gloo) and reads what the run left:
// metrics.jsonl, summary.json and its checkpoints; compares one run with another (the
// single-process reference's, or an uninterrupted run's) step by step and tensor by tensor.
// Torch-free, so the conformance suite (libcai_conformance, `cai plugins check`) and the
// plugins' end-to-end tests (tests/plugins/common) share it.
#pragma once

#include <chrono>
#include <cstdint>
#include <filesystem>
#include <limits>
#include <string>
#include <string_view>
#include <vector>

namespace cai::conformance {

struct TrainRequest {
  std::filesystem::path cai;  // the `cai` program
  std::filesystem::path dir;  // holds job.toml, the run directory `run` and the output file
  std::string job;            // TOML text of the job
  int nproc = 1;
  std::vector<std::string> sets;  // each passed as --set
  // CAI_PLUGIN_FILES of the run: only these plugins (manifests or directories, ':'-separated)
  // are discoverable.
  std::string plugin_files;
  // Continue in `dir`: keep it, its job.toml and its run directory (a run that sets
  // checkpoint.resume=true continues from the latest checkpoint there). Otherwise `dir` is
  // emptied and `job` written to dir/job.toml.
  bool resume = false;
  std::string output_name = "output.txt";  // stdout + stderr go to dir/<output_name>
  // A run still going after this long is killed (its ranks die with it) and reported.
  std::chrono::seconds timeout{600};
};

struct TrainRun {
  int exit_code = -1;   // -1 when killed by a signal or the timeout
  std::string output;   // stdout + stderr of `cai train`
  std::string command;  // the command line, for messages
  // metrics.jsonl, one entry per line.
  std::vector<int64_t> steps;
  std::vector<double> losses;
  std::vector<double> grad_norms;  // NaN where the strategy reported none (null)
  std::vector<bool> skipped;       // fp16 steps skipped for inf/nan gradients
  double eval_loss = std::numeric_limits<double>::quiet_NaN();  // the last eval_loss, if any
  std::filesystem::path checkpoint;  // the latest checkpoint directory, if any
  std::string summary;               // summary.json
};

// Runs `cai train` as `request` says, with the launcher variables of the calling process
// (RANK, SLURM_*, OMPI_*, ...) removed so that --nproc alone decides the ranks. Throws
// cai::Error only when the program cannot be started.
TrainRun RunTrain(const TrainRequest& request);

// What a run directory holds (metrics.jsonl, summary.json, the latest checkpoint), for a run
// started some other way (ranks started one by one, as a cluster's launcher would); exit_code,
// output and command are left empty.
TrainRun ReadRun(const std::filesystem::path& run_dir);

// Whether `entry` ("NAME=value") of an environment is one through which a launcher hands a
// process its rank (launch/rank_env.cpp), or the host its plugins or network interface: a run
// started from a test must not inherit the caller's.
bool IsInheritedLauncherVariable(std::string_view entry);

std::string ReadFile(const std::filesystem::path& path);

// The number at "key" in a JSON text, searching from `from` (NaN when absent or null).
double JsonNumber(const std::string& json, const std::string& key, size_t from = 0);

// The "model/*" tensor names of a checkpoint, rank file by rank file (all of the reference's
// are in rank 0's file). Empty when the strategy saves in a layout of its own.
std::vector<std::string> ModelTensorNames(const std::filesystem::path& checkpoint);
// The floating-point tensors of a checkpoint whose names start with `prefix`, rank file by
// rank file.
std::vector<std::string> FloatTensorNames(const std::filesystem::path& checkpoint,
                                          const std::string& prefix);

// A tensor of a checkpoint converted to fp32, whichever rank wrote it. Throws cai::Error
// (NOT_FOUND naming the tensor and the checkpoint) when there is none.
std::vector<float> ReadCheckpointTensor(const std::filesystem::path& checkpoint,
                                        const std::string& name);

// How far a run may be from the expected one, relative: per step (loss, grad_norm, eval loss)
// and per tensor (relative L2 error). 16-bit training needs a looser bound for the tensors than
// for the steps: small tensors (biases, norms) carry the rounding most.
struct Tolerance {
  Tolerance(double both) : steps(both), weights(both) {}  // NOLINT: a number is a tolerance
  Tolerance(double steps, double weights) : steps(steps), weights(weights) {}
  double steps;
  double weights;
  std::string str() const;  // "1e-05", or "3e-03 per step, 1.5e-01 per tensor"
};

// One compared value beyond the tolerance.
struct Mismatch {
  enum class Kind { kLoss, kGradNorm, kSkipped, kWeights, kEvalLoss };
  Kind kind;
  int64_t step = 0;      // kLoss, kGradNorm, kSkipped
  std::string tensor;    // kWeights
  double expected = 0;   // the value (kWeights: ||w_expected||)
  double got = 0;        // (kWeights: ||w||)
  double error = 0;      // relative error (kWeights: ||w - w_expected|| / ||w_expected||)
  double tolerance = 0;  // the bound it exceeds

  // "step 2 loss: expected 5.124604, got 4.987654 (relative error 2.7e-02 > 1e-05)"
  std::string Describe() const;
};

// `got` against `expected`, from step `from_step` on: each step's loss and grad_norm relative to
// the expected value, the skipped flags, and each floating-point tensor of the expected final
// checkpoint named `tensors`* ("model/": the weights in the canonical layout; "": everything a
// strategy saved, in its own layout) by relative L2 error ||w - w_expected|| / ||w_expected|| (not
// element by element: Adam divides each element by its own running RMS, so an element whose
// gradient is mostly cancellation turns a last-bit difference of summation order into a visibly
// different update, while every tensor's L2 error stays small). A step whose grad_norm `got`
// reports as NaN (no global gradient, e.g. local SGD) is not compared but counted. When `got`'s
// checkpoint has no "model/*" tensors (a layout of its own) and `tensors` is "model/", the final
// eval loss is compared instead.
struct Comparison {
  Tolerance tolerance = 0;
  std::string error;  // a run failed, or steps or tensors are missing: nothing numeric
  std::vector<Mismatch> mismatches;  // beyond the tolerance, in the order found
  // Largest relative errors seen, whether within the tolerance or not.
  double loss = 0, grad_norm = 0, weights = 0, eval_loss = 0;
  std::string worst_tensor;            // of the largest weights error
  size_t steps = 0;                    // steps compared
  size_t grad_norms_not_reported = 0;  // steps where `got` reported NaN
  std::string tensor_prefix;           // the tensors compared: `tensors` of Compare()
  size_t tensors = 0;                  // how many
  bool weights_by_eval_loss = false;   // `got`'s checkpoint has its own layout

  bool ok() const { return error.empty() && mismatches.empty(); }
  double largest() const;
  // "largest relative error 3.1e-07 (loss 1.0e-08, grad_norm 3.1e-07, weights 2.0e-07 over 16
  // tensors); tolerance 1e-05"
  std::string Summary() const;
};
Comparison Compare(const TrainRun& expected, const TrainRun& got, Tolerance tolerance,
                   int64_t from_step = 1, const std::string& tensors = "model/");

}  // namespace cai::conformance
