#include "train_runner.h"

#include <fcntl.h>
#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <sstream>
#include <thread>

#include "checkpoint/checkpoint.h"
#include "checkpoint/rank_file.h"
#include "core/status.h"

extern char** environ;

namespace cai::conformance {

namespace fs = std::filesystem;

namespace {

std::string Quoted(const std::vector<std::string>& argv) {
  std::string text;
  for (const std::string& a : argv) {
    const bool plain = a.find_first_of(" '\"\\$") == std::string::npos && !a.empty();
    text += (text.empty() ? "" : " ") + (plain ? a : "'" + a + "'");
  }
  return text;
}

// Runs argv with `env` and stdout + stderr into `output`; returns the exit status, or -1 when
// killed by a signal or after `timeout` (then killed; the launcher's ranks die with it).
int Spawn(const std::vector<std::string>& argv, const std::vector<std::string>& env,
          const fs::path& output, std::chrono::seconds timeout, std::string& note) {
  std::vector<char*> args, envp;
  for (const std::string& a : argv) args.push_back(const_cast<char*>(a.c_str()));
  args.push_back(nullptr);
  for (const std::string& e : env) envp.push_back(const_cast<char*>(e.c_str()));
  envp.push_back(nullptr);
  posix_spawn_file_actions_t actions;
  posix_spawn_file_actions_init(&actions);
  posix_spawn_file_actions_addopen(&actions, STDIN_FILENO, "/dev/null", O_RDONLY, 0);
  posix_spawn_file_actions_addopen(&actions, STDOUT_FILENO, output.c_str(),
                                   O_WRONLY | O_CREAT | O_TRUNC, 0644);
  posix_spawn_file_actions_adddup2(&actions, STDOUT_FILENO, STDERR_FILENO);
  pid_t pid = 0;
  const int failed = posix_spawn(&pid, args[0], &actions, nullptr, args.data(), envp.data());
  posix_spawn_file_actions_destroy(&actions);
  if (failed) {
    throw Error(CAI_FAILED_PRECONDITION, "cannot run " + argv[0] + ": " + std::strerror(failed));
  }
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  int status = 0;
  for (;;) {
    const pid_t done = waitpid(pid, &status, WNOHANG);
    if (done == pid) break;
    if (done < 0 && errno != EINTR) return -1;
    if (std::chrono::steady_clock::now() > deadline) {
      kill(pid, SIGKILL);
      waitpid(pid, &status, 0);
      note = "killed after " + std::to_string(timeout.count()) + " s";
      return -1;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
}

// Where the value of "key" starts in a JSON text, or npos.
size_t JsonValue(const std::string& json, const std::string& key, size_t from = 0) {
  size_t at = json.find("\"" + key + "\":", from);
  if (at == std::string::npos) return at;
  at += key.size() + 3;
  while (at < json.size() && json[at] == ' ') ++at;
  return at;
}

double RelativeError(double got, double expected) {
  if (got == expected) return 0;  // also equal infinities
  return std::abs(got - expected) / std::abs(expected);
}

// The larger error; NaN (a NaN loss, say) once either is.
double Larger(double a, double b) { return std::isnan(a) || std::isnan(b) ? NAN : std::max(a, b); }

std::string Sci(double v, int digits = 1) {
  char text[32];
  std::snprintf(text, sizeof text, "%.*e", digits, v);
  return text;
}

// A bound as written: 1e-05, 1.5e-01 (Sci(v, 0) would print 1.5e-1 as 1e-01).
std::string Bound(double v) {
  for (int digits = 0; digits < 6; ++digits) {
    const std::string text = Sci(v, digits);
    if (std::strtod(text.c_str(), nullptr) == v) return text;
  }
  return Sci(v, 6);
}

std::string Fixed(double v) {
  char text[32];
  std::snprintf(text, sizeof text, "%.7g", v);
  return text;
}

}  // namespace

bool IsInheritedLauncherVariable(std::string_view entry) {
  static constexpr const char* kNames[] = {"RANK",
                                           "WORLD_SIZE",
                                           "LOCAL_RANK",
                                           "MASTER_ADDR",
                                           "MASTER_PORT",
                                           "TORCHELASTIC_RUN_ID",
                                           "SLURM_PROCID",
                                           "SLURM_NTASKS",
                                           "SLURM_LOCALID",
                                           "SLURM_LAUNCH_NODE_IPADDR",
                                           "SLURM_JOB_ID",
                                           "SLURM_STEP_ID",
                                           "OMPI_COMM_WORLD_RANK",
                                           "OMPI_COMM_WORLD_SIZE",
                                           "OMPI_COMM_WORLD_LOCAL_RANK",
                                           "PMI_RANK",
                                           "PMI_SIZE",
                                           "MPI_LOCALRANKID",
                                           "PMI_KVSNAME",
                                           "CAI_RUN_ID",
                                           "CAI_LAUNCHER",
                                           "CAI_PLUGIN_PATH",
                                           "CAI_PLUGIN_FILES",
                                           "CAI_SOCKET_IFNAME",
                                           "GLOO_SOCKET_IFNAME"};
  const std::string_view name = entry.substr(0, entry.find('='));
  for (const char* n : kNames) {
    if (name == n) return true;
  }
  return false;
}

TrainRun RunTrain(const TrainRequest& request) {
  const fs::path& dir = request.dir;
  if (!request.resume) {
    fs::remove_all(dir);
    fs::create_directories(dir);
    std::ofstream(dir / "job.toml") << request.job;
  }
  std::vector<std::string> argv = {
      request.cai.string(),          "train",     (dir / "job.toml").string(), "--nproc",
      std::to_string(request.nproc), "--run-dir", (dir / "run").string()};
  for (const std::string& s : request.sets) {
    argv.push_back("--set");
    argv.push_back(s);
  }
  std::vector<std::string> env;
  for (char** e = environ; *e; ++e) {
    if (!IsInheritedLauncherVariable(*e)) env.emplace_back(*e);
  }
  env.push_back("CAI_PLUGIN_FILES=" + request.plugin_files);

  TrainRun r;
  r.command = "CAI_PLUGIN_FILES=" + request.plugin_files + " " + Quoted(argv);
  std::string note;
  r.exit_code = Spawn(argv, env, dir / request.output_name, request.timeout, note);
  const std::string output = ReadFile(dir / request.output_name);
  TrainRun read = ReadRun(dir / "run");
  read.exit_code = r.exit_code;
  read.command = r.command;
  read.output = output;
  if (!note.empty()) read.output += "\n(" + note + ")\n";
  return read;
}

TrainRun ReadRun(const fs::path& run_dir) {
  TrainRun r;
  std::ifstream metrics(run_dir / "metrics.jsonl");
  for (std::string line; std::getline(metrics, line);) {
    r.steps.push_back(static_cast<int64_t>(JsonNumber(line, "step")));
    r.losses.push_back(JsonNumber(line, "loss"));
    r.grad_norms.push_back(JsonNumber(line, "grad_norm"));
    const size_t skipped = JsonValue(line, "skipped");
    r.skipped.push_back(skipped != std::string::npos && line.compare(skipped, 4, "true") == 0);
    r.eval_loss = JsonNumber(line, "eval_loss");
  }
  r.summary = ReadFile(run_dir / "summary.json");
  if (auto latest = ckpt::FindLatestCheckpoint(run_dir / "checkpoints")) {
    r.checkpoint = *latest;
  }
  return r;
}

std::string ReadFile(const fs::path& path) {
  std::ifstream in(path);
  std::stringstream text;
  text << in.rdbuf();
  return text.str();
}

double JsonNumber(const std::string& json, const std::string& key, size_t from) {
  const size_t at = JsonValue(json, key, from);
  if (at == std::string::npos) return NAN;
  char* end = nullptr;
  const double value = std::strtod(json.c_str() + at, &end);
  return end == json.c_str() + at ? NAN : value;  // null, or not a number
}

std::vector<std::string> ModelTensorNames(const fs::path& checkpoint) {
  return FloatTensorNames(checkpoint, "model/");
}

std::vector<std::string> FloatTensorNames(const fs::path& checkpoint, const std::string& prefix) {
  std::vector<std::string> names;
  for (int rank = 0; fs::exists(checkpoint / ckpt::RankFileName(rank)); ++rank) {
    ckpt::RankFileReader file(checkpoint / ckpt::RankFileName(rank));
    for (const ckpt::Entry& e : file.entries()) {
      const bool floating = e.dtype.code == CAI_DTYPE_FLOAT || e.dtype.code == CAI_DTYPE_BFLOAT;
      if (e.kind == ckpt::EntryKind::kTensor && floating && e.name.rfind(prefix, 0) == 0) {
        names.push_back(e.name);
      }
    }
  }
  return names;
}

std::vector<float> ReadCheckpointTensor(const fs::path& checkpoint, const std::string& name) {
  ckpt::CheckpointReader reader(checkpoint);
  const cai_checkpoint_api& api = *CheckpointApi();
  cai_ckpt_tensor_info info{};
  info.struct_size = CAI_CKPT_TENSOR_INFO_STRUCT_SIZE;
  if (cai_status* status = api.tensor_info(reader.handle(), name.c_str(), &info)) {
    DestroyStatus(status);
    throw Error(CAI_NOT_FOUND, checkpoint.string() + " has no tensor " + name);
  }
  int64_t numel = 1;
  for (int32_t d = 0; d < info.ndim; ++d) numel *= info.shape[d];
  std::vector<float> values(static_cast<size_t>(numel));
  int64_t stride = 1;
  cai_tensor dst{
      values.data(), {CAI_DEVICE_CPU, 0}, 1, {CAI_DTYPE_FLOAT, 32, 1}, &numel, &stride, 0};
  ThrowIfError(api.read_tensor(reader.handle(), name.c_str(), 0, 0, &dst));
  return values;
}

std::string Tolerance::str() const {
  if (steps == weights) return Bound(steps);
  return Bound(steps) + " per step, " + Bound(weights) + " per tensor";
}

std::string Mismatch::Describe() const {
  const std::string beyond = " (relative error " + Sci(error) + " > " + Bound(tolerance) + ")";
  switch (kind) {
    case Kind::kLoss:
      return "step " + std::to_string(step) + " loss: expected " + Fixed(expected) + ", got " +
             Fixed(got) + beyond;
    case Kind::kGradNorm:
      return "step " + std::to_string(step) + " grad_norm: expected " + Fixed(expected) + ", got " +
             Fixed(got) + beyond;
    case Kind::kSkipped:
      return "step " + std::to_string(step) + ": expected " +
             (expected != 0 ? "a skipped step" : "an applied step") + ", got " +
             (got != 0 ? "a skipped one" : "an applied one");
    case Kind::kWeights:
      return tensor + ": relative L2 error " + Sci(error) + " > " + Bound(tolerance) +
             " (expected norm " + Fixed(expected) + ", got " + Fixed(got) + ")";
    case Kind::kEvalLoss:
      return "final eval loss: expected " + Fixed(expected) + ", got " + Fixed(got) + beyond;
  }
  return "";
}

double Comparison::largest() const {
  return Larger(Larger(loss, grad_norm), Larger(weights, eval_loss));
}

std::string Comparison::Summary() const {
  std::string text = "largest relative error " + Sci(largest()) + " (loss " + Sci(loss);
  if (grad_norms_not_reported == steps && steps > 0) {
    text += ", grad_norm n/a: reported as NaN, no global gradient";
  } else {
    text += ", grad_norm " + Sci(grad_norm);
    if (grad_norms_not_reported > 0) {
      text += " (NaN at " + std::to_string(grad_norms_not_reported) + " of " +
              std::to_string(steps) + " steps, not compared)";
    }
  }
  if (weights_by_eval_loss) {
    text += ", final eval loss " + Sci(eval_loss) +
            " in place of the weights: the checkpoint has no model/* tensors";
  } else {
    text += (tensor_prefix == "model/" ? ", weights " : ", checkpoint ") + Sci(weights) + " over " +
            std::to_string(tensors) + " tensors";
    if (weights > 0) text += ", most in " + worst_tensor;
  }
  return text + "); tolerance " + tolerance.str();
}

Comparison Compare(const TrainRun& expected, const TrainRun& got, Tolerance tolerance,
                   int64_t from_step, const std::string& tensors) {
  Comparison c;
  c.tolerance = tolerance;
  const double rtol = tolerance.steps;
  auto fail = [&c](std::string message) {
    c.error = std::move(message);
    return c;
  };
  auto failed = [](const TrainRun& run) {
    std::string tail = run.output;
    // The last lines say why; the whole output is in the run's directory.
    size_t cut = tail.size();
    for (int lines = 0; lines < 12 && cut != std::string::npos && cut > 0; ++lines) {
      cut = tail.rfind('\n', cut - 1);
    }
    if (cut != std::string::npos && cut > 0) tail = "..." + tail.substr(cut);
    return "`" + run.command + "` exited with status " + std::to_string(run.exit_code) +
           "; its output ends:\n" + tail;
  };
  if (expected.exit_code != 0) return fail(failed(expected));
  if (got.exit_code != 0) return fail(failed(got));

  std::vector<size_t> compared;  // indices into `expected` from from_step on
  for (size_t i = 0; i < expected.steps.size(); ++i) {
    if (expected.steps[i] >= from_step) compared.push_back(i);
  }
  if (compared.empty()) return fail("the expected run reported no steps");
  if (got.steps.size() != compared.size()) {
    return fail("expected steps " + std::to_string(expected.steps[compared.front()]) + " to " +
                std::to_string(expected.steps.back()) + " in metrics.jsonl, got " +
                std::to_string(got.steps.size()) + " lines");
  }
  for (size_t k = 0; k < compared.size(); ++k) {
    const size_t i = compared[k];
    const int64_t step = expected.steps[i];
    if (got.steps[k] != step) {
      return fail("metrics.jsonl line " + std::to_string(k + 1) + " is step " +
                  std::to_string(got.steps[k]) + ", expected step " + std::to_string(step));
    }
    ++c.steps;
    const double loss_error = RelativeError(got.losses[k], expected.losses[i]);
    c.loss = Larger(c.loss, loss_error);
    if (!(loss_error <= rtol)) {
      c.mismatches.push_back(
          {Mismatch::Kind::kLoss, step, "", expected.losses[i], got.losses[k], loss_error, rtol});
    }
    if (got.skipped[k] != expected.skipped[i]) {
      c.mismatches.push_back({Mismatch::Kind::kSkipped, step, "",
                              static_cast<double>(expected.skipped[i]),
                              static_cast<double>(got.skipped[k]), 0, 0});
    }
    // A step skipped on both sides (fp16 overflow) has no norm on either.
    if (std::isnan(got.grad_norms[k]) && expected.skipped[i] && got.skipped[k]) continue;
    if (std::isnan(got.grad_norms[k])) {
      ++c.grad_norms_not_reported;
      continue;
    }
    const double norm_error = RelativeError(got.grad_norms[k], expected.grad_norms[i]);
    c.grad_norm = Larger(c.grad_norm, norm_error);
    if (!(norm_error <= rtol)) {
      c.mismatches.push_back({Mismatch::Kind::kGradNorm, step, "", expected.grad_norms[i],
                              got.grad_norms[k], norm_error, rtol});
    }
  }

  if (expected.checkpoint.empty()) return fail("the expected run saved no checkpoint");
  if (got.checkpoint.empty()) return fail("the run saved no checkpoint");
  try {
    c.tensor_prefix = tensors;
    const std::vector<std::string> names = FloatTensorNames(expected.checkpoint, tensors);
    if (names.empty()) {
      return fail(expected.checkpoint.string() + " has no " + tensors + "* tensors");
    }
    if (tensors == "model/" && ModelTensorNames(got.checkpoint).empty()) {
      c.weights_by_eval_loss = true;
      c.eval_loss = RelativeError(got.eval_loss, expected.eval_loss);
      if (!(c.eval_loss <= rtol)) {
        c.mismatches.push_back({Mismatch::Kind::kEvalLoss, 0, "", expected.eval_loss, got.eval_loss,
                                c.eval_loss, rtol});
      }
      return c;
    }
    for (const std::string& name : names) {
      const std::vector<float> a = ReadCheckpointTensor(got.checkpoint, name);
      const std::vector<float> b = ReadCheckpointTensor(expected.checkpoint, name);
      if (a.size() != b.size()) {
        return fail(name + " has " + std::to_string(a.size()) + " elements in " +
                    got.checkpoint.string() + ", expected " + std::to_string(b.size()));
      }
      double diff = 0, norm = 0, got_norm = 0;
      for (size_t i = 0; i < b.size(); ++i) {
        const double d = static_cast<double>(a[i]) - b[i];
        diff += d * d;
        norm += static_cast<double>(b[i]) * b[i];
        got_norm += static_cast<double>(a[i]) * a[i];
      }
      const double error = diff == 0 ? 0 : std::sqrt(diff) / std::sqrt(norm);
      ++c.tensors;
      if (error > c.weights) {
        c.weights = error;
        c.worst_tensor = name;
      }
      if (!(error <= tolerance.weights)) {
        c.mismatches.push_back({Mismatch::Kind::kWeights, 0, name, std::sqrt(norm),
                                std::sqrt(got_norm), error, tolerance.weights});
      }
    }
  } catch (const std::exception& e) {
    c.error = e.what();
  }
  return c;
}

}  // namespace cai::conformance
