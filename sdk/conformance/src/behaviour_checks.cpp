#include "behaviour_checks.h"

#include <stdlib.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <string>

#include "checkpoint/checkpoint.h"
#include "core/status.h"
#include "train_runner.h"

namespace cai::conformance {
namespace {

namespace fs = std::filesystem;

// A 2-layer GPT-2 over the byte vocabulary (tied lm_head and wte) on the embedded corpus,
// one compute thread per rank: each run takes about two seconds.
constexpr const char* kModelAndData = R"(
[launch]
timeout_s = 60

[model]
kind = "gpt2"
vocab_size = 256
n_ctx = 32
n_layer = 2
n_head = 2
n_embd = 32

[train]
global_batch = 8
seq_len = 32
seed = 7
eval_every = 0
eval_batches = 1
threads = 1
)";

// Plain SGD at a constant rate, no momentum, weight decay or clipping: the update is the
// gradient times the rate, so a gradient averaged over ranks instead of summed (the host's
// loss weights already make the sum the global mean), or summed twice, moves every weight by
// the wrong amount from step 1 on.
constexpr const char* kSgd = R"(
[optimizer]
kind = "sgd"
lr = 0.5
momentum = 0.0
weight_decay = 0.0
max_grad_norm = 0.0
warmup_steps = 0
min_lr_ratio = 1.0

[checkpoint]
at_end = true
)";
constexpr int kSgdSteps = 4;

// AdamW with two parameter groups (their own rate and weight decay), warmup into cosine decay
// and clipping at a norm every step of this job exceeds; a checkpoint at step 3 and at the end.
constexpr const char* kAdamW = R"(
[optimizer]
kind = "adamw"
lr = 0.003
weight_decay = 0.1
no_decay_lr = 0.001
no_decay_weight_decay = 0.01
max_grad_norm = 0.05
warmup_steps = 2

[checkpoint]
every = 3
at_end = true
)";
constexpr double kAdamWMaxGradNorm = 0.05;
constexpr int kAdamWSteps = 6;
constexpr int kResumeFrom = 3;

// The job: kModelAndData, whose [train] table comes last, then `steps` in it, then the
// optimizer's and checkpoint's tables.
std::string Job(const char* optimizer, int steps) {
  std::string job = kModelAndData;
  job.append("steps = ").append(std::to_string(steps)).append("\n").append(optimizer);
  return job;
}

// The precision the runs use and how far a run may stray from the reference in it. fp32: only
// summation order differs (ranks add partial gradients in another order than one process), a
// last-bit effect; measured on these jobs at most 3e-7 per step and 1.6e-6 per tensor for the
// in-tree strategies. 16-bit: the strategy reduces 16-bit gradients, which the reference never
// does, and Adam carries that rounding (8 significant bits for bf16, 11 for fp16) into the
// small tensors most (biases, norms). Measured with ddp on these jobs: bf16 1.4e-3 per step
// and 3e-2 per tensor, fp16 1.8e-4 and 1.3e-3; the bounds leave a 3-7x margin, and a gradient
// off by a factor of 2 is still off by 50% in grad_norm at step 1.
struct Precision {
  std::string name;
  Tolerance tolerance;
};

Precision ChoosePrecision(const Manifest& manifest) {
  const std::vector<std::string>& listed = manifest.capabilities.precisions;
  if (listed.empty() || std::find(listed.begin(), listed.end(), "fp32") != listed.end()) {
    return {"fp32", Tolerance(1e-5)};
  }
  if (listed.front() == "bf16") return {"bf16", Tolerance(1e-2, 1e-1)};
  return {listed.front(), Tolerance(1e-3, 1e-2)};
}

// A directory under $TMPDIR (or /tmp) for the runs, removed with its contents at the end
// unless kept.
class RunsDir {
 public:
  explicit RunsDir(bool keep) : keep_(keep) {
    const char* tmp = getenv("TMPDIR");
    std::string pattern =
        (fs::path(tmp && *tmp ? tmp : "/tmp") / "cai-conformance-XXXXXX").string();
    if (!mkdtemp(pattern.data())) {
      throw Error(CAI_PERMISSION_DENIED, "cannot create a directory " + pattern +
                                             " for the runs; set TMPDIR to a writable one");
    }
    path_ = pattern;
  }
  ~RunsDir() {
    std::error_code ec;
    if (!keep_) fs::remove_all(path_, ec);
  }
  RunsDir(const RunsDir&) = delete;
  RunsDir& operator=(const RunsDir&) = delete;

  const fs::path& path() const { return path_; }
  // For failure messages: where the runs are and whether they stay.
  std::string Where() const {
    return "runs in " + path_.string() +
           (keep_ ? " (kept)"
                  : " (removed; set CAI_CONFORMANCE_KEEP=1 or pass --keep-runs to keep them)");
  }

 private:
  bool keep_;
  fs::path path_;
};

// The detail line of a failed comparison: the first difference of each kind, losses first,
// then the largest errors.
std::string Differences(const Comparison& c) {
  if (!c.error.empty()) return c.error;
  std::string text;
  for (Mismatch::Kind kind :
       {Mismatch::Kind::kLoss, Mismatch::Kind::kGradNorm, Mismatch::Kind::kSkipped,
        Mismatch::Kind::kWeights, Mismatch::Kind::kEvalLoss}) {
    auto first = std::find_if(c.mismatches.begin(), c.mismatches.end(),
                              [kind](const Mismatch& m) { return m.kind == kind; });
    if (first != c.mismatches.end()) text += first->Describe() + "; ";
  }
  return text + std::to_string(c.mismatches.size()) + " value(s) beyond the tolerance; " +
         c.Summary();
}

}  // namespace

void RunBehaviourChecks(const Manifest& manifest, const fs::path& cai, bool keep_runs,
                        std::vector<CheckResult>& results) {
  if (cai.empty() || !fs::exists(cai)) {
    results.push_back(
        {"trains with `cai train` (behaviour checks)", false,
         (cai.empty() ? std::string("no `cai` program found beside this one or on PATH")
                      : cai.string() + " does not exist") +
             "; install the cai package (the host) or pass --cai PATH to the cai program"});
    return;
  }
  const Precision precision = ChoosePrecision(manifest);
  std::string precision_note;
  if (precision.name != "fp32") {
    precision_note = "; trained in " + precision.name + ", the plugin's first precision (no fp32)";
  }
  RunsDir dir(keep_runs);
  auto train = [&](const std::string& name, const std::string& job, int nproc,
                   std::vector<std::string> sets, bool resume = false) {
    sets.push_back("train.precision=" + precision.name);
    return RunTrain({.cai = cai,
                     .dir = dir.path() / name,
                     .job = job,
                     .nproc = nproc,
                     .sets = std::move(sets),
                     .plugin_files = manifest.path.string(),
                     .resume = resume,
                     .timeout = std::chrono::seconds(300)});
  };
  auto record = [&](const std::string& name, const Comparison& c, const std::string& note) {
    if (c.ok()) {
      results.push_back({name, true, c.Summary() + note + precision_note});
    } else {
      results.push_back({name, false, Differences(c) + "; " + dir.Where()});
    }
  };
  const std::string plugin = "plugin.name=" + manifest.name;
  auto ranks = [](int n) { return std::to_string(n) + (n == 1 ? " rank" : " ranks"); };

  const std::string sgd = Job(kSgd, kSgdSteps);
  const TrainRun sgd_reference = train("sgd-reference", sgd, 1, {"plugin.name=none"});
  for (int nproc : {1, 2}) {
    const TrainRun run = train("sgd-" + std::to_string(nproc), sgd, nproc, {plugin});
    record("trains like the reference on " + ranks(nproc) + " (SGD, no clipping)",
           Compare(sgd_reference, run, precision.tolerance), "");
  }

  const std::string adamw = Job(kAdamW, kAdamWSteps);
  const TrainRun adamw_reference = train("adamw-reference", adamw, 1, {"plugin.name=none"});
  const auto clipped =
      std::count_if(adamw_reference.grad_norms.begin(), adamw_reference.grad_norms.end(),
                    [](double norm) { return norm > kAdamWMaxGradNorm; });
  const std::string clipping = "; the reference clipped " + std::to_string(clipped) + " of " +
                               std::to_string(adamw_reference.grad_norms.size()) + " steps";
  TrainRun uninterrupted;
  for (int nproc : {1, 2}) {
    TrainRun run = train("adamw-" + std::to_string(nproc), adamw, nproc, {plugin});
    record("trains like the reference on " + ranks(nproc) +
               " (AdamW + clipping, two parameter groups)",
           Compare(adamw_reference, run, precision.tolerance), clipping);
    uninterrupted = std::move(run);
  }

  // The 2-rank run saved at step 3 and at the end: a fresh run directory holding only the
  // step-3 checkpoint resumes from it and must end where the uninterrupted run did.
  const std::string resume_name =
      "resumes from its own checkpoint on 2 ranks (AdamW, saved at step " +
      std::to_string(kResumeFrom) + " of " + std::to_string(kAdamWSteps) + ")";
  const fs::path saved =
      dir.path() / "adamw-2" / "run" / "checkpoints" / ckpt::StepDirName(kResumeFrom);
  if (uninterrupted.exit_code != 0 || !fs::exists(saved / "COMPLETE")) {
    results.push_back({resume_name, false,
                       uninterrupted.exit_code != 0
                           ? "not run: the uninterrupted run failed (above)"
                           : "no complete checkpoint " + saved.string() + "; " + dir.Where()});
    return;
  }
  const fs::path resume_dir = dir.path() / "adamw-2-resumed";
  fs::create_directories(resume_dir / "run" / "checkpoints");
  fs::copy(saved, resume_dir / "run" / "checkpoints" / saved.filename(),
           fs::copy_options::recursive);
  fs::copy_file(dir.path() / "adamw-2" / "job.toml", resume_dir / "job.toml");
  const TrainRun resumed =
      train(resume_dir.filename(), adamw, 2, {plugin, "checkpoint.resume=true"}, true);
  // Every tensor of the final checkpoints, in the strategy's own layout: weights and
  // optimizer state.
  record(resume_name, Compare(uninterrupted, resumed, precision.tolerance, kResumeFrom + 1, ""),
         "; against the uninterrupted run, steps " + std::to_string(kResumeFrom + 1) + "-" +
             std::to_string(kAdamWSteps) + " and every tensor of the final checkpoint");
}

}  // namespace cai::conformance
