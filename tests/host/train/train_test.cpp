// `cai train` as users run it: the reference learns, resume is exact, ranks join through every
// launcher's variables, a dead rank ends the job, and bad input is refused clearly.
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/stat.h>
#include <unistd.h>

#include <chrono>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <regex>
#include <sstream>
#include <thread>
#include <vector>

#include "checkpoint/rank_file.h"
#include "launch/port_reservation.h"
#include "util/subprocess.h"
#include "util/temp_dir.h"

namespace {

namespace fs = std::filesystem;
using cai::testing::ReadFile;
using cai::testing::Result;
using cai::testing::RunCommand;

// Every TempDir of this file under /tmp/cai-train-XXXXXX.
class TempDir : public cai::testing::TempDir {
 public:
  TempDir() : cai::testing::TempDir("cai-train") {}
};

// `cai train ARGS`, with the plugin search restricted to the build tree, in `cwd` if given.
Result Train(const std::string& args, const std::string& env = "", const std::string& cwd = "") {
  return RunCommand((cwd.empty() ? "" : "cd " + cwd + " && ") +
                    "env -u CAI_PLUGIN_PATH -u CAI_PLUGIN_FILES -u RANK -u WORLD_SIZE "
                    "-u SLURM_PROCID -u OMPI_COMM_WORLD_RANK HOME=/nonexistent " +
                    env + " " + CAI_EXE + " train " + args);
}

// The loss of each step in a run directory's metrics.jsonl, as written (full precision).
std::vector<std::string> LossTexts(const fs::path& run_dir) {
  std::vector<std::string> losses;
  std::ifstream in(run_dir / "metrics.jsonl");
  std::regex loss("\"loss\": ([-0-9.e+]+)");
  for (std::string line; std::getline(in, line);) {
    std::smatch m;
    if (std::regex_search(line, m, loss)) losses.push_back(m[1]);
  }
  return losses;
}

std::vector<double> Losses(const fs::path& run_dir) {
  std::vector<double> out;
  for (const auto& s : LossTexts(run_dir)) out.push_back(std::stod(s));
  return out;
}

void ExpectClose(const std::vector<double>& a, const std::vector<double>& b, double rel) {
  ASSERT_EQ(a.size(), b.size());
  ASSERT_FALSE(a.empty());
  for (size_t i = 0; i < a.size(); ++i) {
    EXPECT_LE(std::fabs(a[i] - b[i]), rel * std::fabs(b[i])) << "step " << i + 1;
  }
}

TEST(Train, Reference_LossFallsAndRunDirIsComplete) {
  TempDir dir;
  Result r = Train(std::string(TINY_JOB) + " --run-dir " + dir.str() +
                   " --set train.steps=30 "
                   "--set optimizer.decay_steps=30 --set checkpoint.at_end=true");
  ASSERT_EQ(r.code, 0) << r.output;
  std::vector<double> losses = Losses(dir / "");
  ASSERT_EQ(losses.size(), 30u);
  EXPECT_NEAR(losses.front(), std::log(256.0), 0.3);  // uniform over bytes at init
  // Far below the uniform ln(256) = 5.55: the byte statistics of the corpus are learned.
  EXPECT_LT(losses.back(), 4.0);
  for (const char* f : {"config.resolved.toml", "summary.json", "logs/rank-0.log",
                        "checkpoints/latest", "checkpoints/step-000030/COMPLETE"}) {
    EXPECT_TRUE(fs::exists(dir / f)) << f;
  }
  std::string summary = ReadFile((dir / "summary.json").string());
  CAI_EXPECT_CONTAINS(summary, "\"final_eval_loss\": ");
  CAI_EXPECT_CONTAINS(summary, "\"blas\": ");
  CAI_EXPECT_CONTAINS(summary, "\"peak_bytes\": {\"device\": ");
  CAI_EXPECT_CONTAINS(summary, "\"comm_bytes_basis\": \"mean over 30 optimizer steps\"");
  // One rank: nothing handed to a collective, nothing on the wire.
  CAI_EXPECT_CONTAINS(summary, "\"wire_bytes_per_step_mean\": {\"all_reduce\": 0, ");
  CAI_EXPECT_CONTAINS(ReadFile((dir / "config.resolved.toml").string()), "steps = 30");
  CAI_EXPECT_CONTAINS(r.output, "cai: metrics in " + (dir / "metrics.jsonl").string());
}

// summary.json's framework_peak_bytes counts what LibTorch allocates for itself. The rows a
// doubled batch adds bring at least their logits [rows, T, V] and one hidden state [rows, T, C]
// per block in fp32 (the forward keeps both for backward), so the peak grows by at least that
// (measured: about 6 times more); it never exceeds the process's peak RSS, and what is live at
// the end (the model's parameters and gradients) is within the peak.
TEST(Train, FrameworkPeakBytes_GrowWithTheBatchBelowPeakRss) {
  struct Figures {
    double peak = 0, at_end = 0, rss = 0;
  };
  const auto run = [](int global_batch) {
    TempDir dir;
    Result r =
        Train(std::string(TINY_JOB) + " --run-dir " + dir.str() +
              " --set train.steps=2 --set train.global_batch=" + std::to_string(global_batch));
    EXPECT_EQ(r.code, 0) << r.output;
    const std::string summary = ReadFile((dir / "summary.json").string());
    const auto number = [&](const std::string& key) {
      std::smatch m;
      EXPECT_TRUE(std::regex_search(summary, m, std::regex("\"" + key + "\": ([0-9]+)")))
          << key << " missing from " << summary;
      return m.empty() ? 0.0 : std::stod(m[1]);
    };
    return Figures{number("framework_peak_bytes"), number("framework_bytes_at_end"),
                   number("peak_rss_bytes")};
  };
  const Figures eight = run(8), sixteen = run(16);
  constexpr double kT = 32, kC = 32, kV = 256, kLayers = 2;  // tiny.toml
  const double added_rows = 8 * kT * (kV + kLayers * kC) * sizeof(float);
  EXPECT_GE(sixteen.peak - eight.peak, added_rows) << eight.peak << " -> " << sixteen.peak;
  for (const Figures& f : {eight, sixteen}) {
    EXPECT_GT(f.at_end, 0);
    EXPECT_LE(f.at_end, f.peak);
    EXPECT_LT(f.peak, f.rss);
  }
}

// memory.device_budget bounds the strategy's DEVICE buffers and LibTorch's tensors together:
// a run whose combined peak fits trains exactly as without a budget and reports its peak under
// it; half that peak fails as a full device would, naming what was being allocated.
TEST(Train, DeviceBudget_BoundsBuffersAndLibTorchTogetherAndBeyondItFailsLikeAFullDevice) {
  const auto number = [](const std::string& summary, const std::string& key) {
    std::smatch m;
    EXPECT_TRUE(std::regex_search(summary, m, std::regex("\"" + key + "\": ([0-9]+)")))
        << key << " missing from " << summary;
    return m.empty() ? uint64_t{0} : std::stoull(m[1]);
  };
  const std::string job = std::string(TINY_JOB) + " --set train.steps=3";
  TempDir free_run;
  Result r = Train(job + " --run-dir " + free_run.str());
  ASSERT_EQ(r.code, 0) << r.output;
  const std::string unbounded = ReadFile((free_run / "summary.json").string());
  const uint64_t peak = number(unbounded, "device_total_peak_bytes");
  // The combined peak holds at least LibTorch's own, and is what the budget must cover.
  ASSERT_GE(peak, number(unbounded, "framework_peak_bytes"));
  ASSERT_GT(peak, 0u);

  TempDir fits;
  const uint64_t budget = peak + (uint64_t{1} << 20);
  r = Train(job + " --run-dir " + fits.str() +
            " --set memory.device_budget=" + std::to_string(budget));
  ASSERT_EQ(r.code, 0) << r.output;
  const std::string bounded = ReadFile((fits / "summary.json").string());
  EXPECT_LE(number(bounded, "device_total_peak_bytes"), budget);
  CAI_EXPECT_CONTAINS(bounded, "\"budget_bytes\": {\"device\": " + std::to_string(budget) + ",");
  EXPECT_EQ(LossTexts(fits / ""), LossTexts(free_run / ""));

  TempDir full;
  r = Train(job + " --run-dir " + full.str() +
            " --set memory.device_budget=" + std::to_string(peak / 2));
  EXPECT_NE(r.code, 0) << r.output;
  for (const char* fragment :
       {"device out of memory: cannot allocate ", "for LibTorch's tensors in ",
        "on memory tier DEVICE: its budget is ", "raise memory.device_budget"}) {
    CAI_EXPECT_CONTAINS(r.output, fragment);
  }
}

// model.init_device = "host": the model is built uncharged and, after boost, what the
// strategy left in the model (here all of it: the reference trains on the model's own
// storage) is charged to the device, so the run's device peak is the same as when built
// there, losses are identical, and a budget below what moves fails at that move, naming it.
TEST(Train, InitDeviceHost_ChargesWhatTheStrategyLeavesInTheModel) {
  const auto number = [](const std::string& text, const std::string& pattern) {
    std::smatch m;
    EXPECT_TRUE(std::regex_search(text, m, std::regex(pattern))) << pattern << " not in " << text;
    return m.empty() ? uint64_t{0} : std::stoull(m[1]);
  };
  const std::string job = std::string(TINY_JOB) + " --set train.steps=2";
  TempDir on_device;
  Result r = Train(job + " --run-dir " + on_device.str());
  ASSERT_EQ(r.code, 0) << r.output;
  const uint64_t device_peak = number(ReadFile((on_device / "summary.json").string()),
                                      "\"device_total_peak_bytes\": ([0-9]+)");
  TempDir on_host;
  r = Train(job + " --run-dir " + on_host.str() + " --set model.init_device=host");
  ASSERT_EQ(r.code, 0) << r.output;
  const uint64_t moved = number(r.output, "built in host memory; ([0-9]+) bytes");
  EXPECT_GT(moved, 0u);
  EXPECT_EQ(number(ReadFile((on_host / "summary.json").string()),
                   "\"device_total_peak_bytes\": ([0-9]+)"),
            device_peak);
  EXPECT_EQ(LossTexts(on_host / ""), LossTexts(on_device / ""));
  // Room for the reference's own buffers (its optimizer state, allocated in boost) and half
  // of the model.
  const uint64_t buffers = number(ReadFile((on_host / "summary.json").string()),
                                  "\"peak_bytes\": \\{\"device\": ([0-9]+)");
  TempDir too_small;
  r = Train(job + " --run-dir " + too_small.str() +
            " --set model.init_device=host --set memory.device_budget=" +
            std::to_string(buffers + moved / 2));
  EXPECT_NE(r.code, 0) << r.output;
  CAI_EXPECT_CONTAINS(r.output, "device out of memory");
  CAI_EXPECT_CONTAINS(r.output, "moving to the device what the strategy left in the model");
}

// model.init_device = "lazy": no parameter exists before boost; the reference reads them all
// in its boost (or the host draws what it left unread), and training is bit-identical to the
// eagerly built model's. It draws from the seed, so it refuses model.init_from.
TEST(Train, InitDeviceLazy_TrainsIdenticallyAndRefusesInitFrom) {
  const std::string job = std::string(TINY_JOB) + " --set train.steps=2";
  TempDir eager, lazy;
  Result r = Train(job + " --run-dir " + eager.str());
  ASSERT_EQ(r.code, 0) << r.output;
  r = Train(job + " --run-dir " + lazy.str() + " --set model.init_device=lazy");
  ASSERT_EQ(r.code, 0) << r.output;
  EXPECT_EQ(LossTexts(lazy / ""), LossTexts(eager / ""));
  EXPECT_EQ(LossTexts(lazy / "").size(), 2u);
  TempDir weights;
  r = Train(job + " --run-dir " + weights.str() + " --set model.init_device=lazy" +
            " --set model.init_from=" + weights.str());
  EXPECT_NE(r.code, 0) << r.output;
  CAI_EXPECT_CONTAINS(r.output, "model.init_from loads them from");
  r = Train(job + " --run-dir " + weights.str() + " --set model.init_device=meta");
  EXPECT_NE(r.code, 0) << r.output;
  CAI_EXPECT_CONTAINS(r.output, "init_device");
}

TEST(Train, NoJobFile_TrainsTheBuiltInDefaultsWithTheOverrides) {
  // Every key at its default (`cai train --help-keys`) but a model and batch small enough for
  // one quick step; the run directory is named for the defaults.
  TempDir cwd;
  Result r = Train(
      "--set train.steps=1 --set model.n_layer=1 --set model.n_embd=32 --set model.n_head=2 "
      "--set model.n_ctx=32 --set train.seq_len=32 --set train.global_batch=2 "
      "--set train.eval_batches=1 --set train.threads=1 --set checkpoint.at_end=false",
      "", cwd.str());
  ASSERT_EQ(r.code, 0) << r.output;
  std::vector<fs::path> runs;
  for (const auto& entry : fs::directory_iterator(cwd / "runs")) runs.push_back(entry.path());
  ASSERT_EQ(runs.size(), 1u) << r.output;
  EXPECT_EQ(runs[0].filename().string().rfind("defaults-", 0), 0u) << runs[0];
  EXPECT_EQ(Losses(runs[0]).size(), 1u);
  const std::string resolved = ReadFile((runs[0] / "config.resolved.toml").string());
  CAI_EXPECT_CONTAINS(resolved, "n_layer = 1");
  CAI_EXPECT_CONTAINS(resolved, "kind = 'gpt2'");     // a default
  CAI_EXPECT_CONTAINS(resolved, "warmup_steps = 0");  // a default
}

TEST(Train, DefaultJob_LearnsBelowStatedLoss) {
  // The README's main job, as shipped (examples/default.toml), on the reference strategy.
  TempDir dir;
  Result r = Train(std::string(DEFAULT_JOB) + " --run-dir " + dir.str());
  ASSERT_EQ(r.code, 0) << r.output;
  std::vector<double> losses = Losses(dir / "");
  ASSERT_FALSE(losses.empty());
  // Byte unigram entropy of the corpus is about 2.9 nats: well below it the model has learned
  // words, not just letter frequencies (examples/default.toml states this bound).
  EXPECT_LT(losses.back(), 1.8);
  std::smatch m;
  const std::string summary = ReadFile((dir / "summary.json").string());
  ASSERT_TRUE(std::regex_search(summary, m, std::regex("\"final_eval_loss\": ([0-9.]+)")));
  EXPECT_LT(std::stod(m[1]), 1.8);
}

TEST(Train, Resume_ContinuesBitForBit) {
  TempDir straight, resumed;
  ASSERT_EQ(Train(std::string(TINY_JOB) + " --run-dir " + straight.str()).code, 0);
  Result first = Train(std::string(TINY_JOB) + " --run-dir " + resumed.str() +
                       " --set train.steps=4 --set checkpoint.at_end=true");
  ASSERT_EQ(first.code, 0) << first.output;
  Result second = Train(std::string(TINY_JOB) + " --run-dir " + resumed.str() +
                        " --set checkpoint.resume=true");
  ASSERT_EQ(second.code, 0) << second.output;
  CAI_EXPECT_CONTAINS(second.output, "resumed from");
  EXPECT_EQ(LossTexts(straight / ""), LossTexts(resumed / ""));
}

size_t LineCount(const fs::path& file) {
  std::ifstream in(file);
  size_t n = 0;
  for (std::string line; std::getline(in, line);) ++n;
  return n;
}

TEST(Train, ResumeFindingOnlyAnIncompleteCheckpoint_SaysSoAndKeepsEarlierMetrics) {
  TempDir dir;
  const std::string job = std::string(TINY_JOB) + " --run-dir " + dir.str();
  ASSERT_EQ(Train(job + " --set train.steps=4 --set checkpoint.at_end=true").code, 0);
  ASSERT_EQ(LineCount(dir / "metrics.jsonl"), 4u);
  const fs::path step4 = dir / "checkpoints" / "step-000004";
  fs::remove(step4 / "COMPLETE");  // as if the save had been cut short
  fs::create_directories(dir / "checkpoints" / "step-000006.tmp-local-1");

  Result r = Train(job + " --set train.steps=3 --set checkpoint.resume=true");
  ASSERT_EQ(r.code, 0) << r.output;
  CAI_EXPECT_CONTAINS(r.output, "checkpoint.resume: skipped " + step4.string() +
                                    " (no COMPLETE marker: its save did not finish)");
  CAI_EXPECT_CONTAINS(r.output, "step-000006.tmp-local-1 (temporary directory of a save");
  CAI_EXPECT_CONTAINS(r.output, "holds no complete checkpoint: training starts at step 1");
  CAI_EXPECT_CONTAINS(r.output, "is kept as metrics.jsonl.1");
  EXPECT_EQ(LineCount(dir / "metrics.jsonl.1"), 4u) << "the first run's metrics";
  EXPECT_EQ(LineCount(dir / "metrics.jsonl"), 3u);

  // A third start from step 1 keeps the second run's file too.
  ASSERT_EQ(Train(job + " --set train.steps=2").code, 0);
  EXPECT_EQ(LineCount(dir / "metrics.jsonl.1"), 4u);
  EXPECT_EQ(LineCount(dir / "metrics.jsonl.2"), 3u);
  EXPECT_EQ(LineCount(dir / "metrics.jsonl"), 2u);
}

TEST(Train, ResumePassingOverANewerIncompleteCheckpoint_NamesIt) {
  TempDir dir;
  const std::string job = std::string(TINY_JOB) + " --run-dir " + dir.str();
  ASSERT_EQ(Train(job + " --set train.steps=4 --set checkpoint.every=2").code, 0);
  const fs::path step4 = dir / "checkpoints" / "step-000004";
  fs::remove(step4 / "COMPLETE");
  Result r = Train(job + " --set checkpoint.resume=true");
  ASSERT_EQ(r.code, 0) << r.output;
  CAI_EXPECT_CONTAINS(r.output, "checkpoint.resume: skipped " + step4.string() +
                                    " (no COMPLETE marker: its save did not finish); resuming "
                                    "from the older step-000002");
  CAI_EXPECT_CONTAINS(r.output, "resumed from " + (dir / "checkpoints" / "step-000002").string());
  EXPECT_FALSE(fs::exists(dir / "metrics.jsonl.1")) << "a resumed run appends";
}

TEST(Train, ResumeFromCheckpointWithZeroedTensorBytes_FailsNamingFileTensorAndEarlierOne) {
  TempDir dir;
  const std::string job = std::string(TINY_JOB) + " --run-dir " + dir.str();
  ASSERT_EQ(Train(job + " --set train.steps=4 --set checkpoint.every=2").code, 0);
  const fs::path file = dir / "checkpoints" / "step-000004" / cai::ckpt::RankFileName(0);
  cai::ckpt::Entry largest;
  const cai::ckpt::RankFileReader reader(file);
  for (const cai::ckpt::Entry& e : reader.entries()) {
    if (e.kind == cai::ckpt::EntryKind::kTensor && e.bytes > largest.bytes) largest = e;
  }
  ASSERT_GE(largest.bytes, 8192u) << largest.name;
  {
    std::fstream f(file, std::ios::in | std::ios::out | std::ios::binary);
    f.seekp(static_cast<std::streamoff>(largest.offset + 2048));
    const std::string zeros(4096, '\0');
    f.write(zeros.data(), static_cast<std::streamsize>(zeros.size()));
  }
  Result r = Train(job + " --set checkpoint.resume=true");
  EXPECT_NE(r.code, 0) << r.output;
  CAI_EXPECT_CONTAINS(
      r.output, "checkpoint file " + file.string() + ": tensor '" + largest.name + "' is damaged");
  CAI_EXPECT_CONTAINS(r.output,
                      "Earlier checkpoints in " + (dir / "checkpoints").string() + ": step-000002");
  EXPECT_EQ(r.output.find("resumed from"), std::string::npos) << r.output;
}

TEST(Train, GradientAccumulation_MatchesOneBatch) {
  TempDir one, four;
  ASSERT_EQ(Train(std::string(TINY_JOB) + " --run-dir " + one.str()).code, 0);
  Result r =
      Train(std::string(TINY_JOB) + " --run-dir " + four.str() + " --set train.grad_accum=4");
  ASSERT_EQ(r.code, 0) << r.output;
  ExpectClose(Losses(four / ""), Losses(one / ""), 1e-5);
}

TEST(Train, ExamplePluginOnTwoAndThreeRanks_MatchesReference) {
  TempDir reference;
  ASSERT_EQ(Train(std::string(TINY_JOB) + " --run-dir " + reference.str()).code, 0);
  for (int ranks : {2, 3}) {
    TempDir dir;
    Result r = Train(std::string(TINY_JOB) + " --nproc " + std::to_string(ranks) + " --run-dir " +
                     dir.str() + " --set plugin.name=hello_strategy");
    ASSERT_EQ(r.code, 0) << r.output;
    ExpectClose(Losses(dir / ""), Losses(reference / ""), 1e-5);
    // Every log line of a launched run names its rank.
    std::istringstream lines(r.output);
    for (std::string line; std::getline(lines, line);) {
      if (line.rfind("cai: ", 0) == 0 || line.empty()) continue;  // the launcher's own lines
      EXPECT_TRUE(std::regex_search(line, std::regex("^\\[rank [0-9]\\] "))) << line;
    }
  }
}

// Starts `ranks` copies of `cai train` with the environment `env_of(rank)` describes and
// waits for all of them.
std::vector<Result> JoinAs(int ranks, const std::function<std::string(int)>& env_of,
                           const std::string& args) {
  std::vector<std::thread> threads;
  std::vector<Result> results(ranks);
  for (int r = 0; r < ranks; ++r) {
    threads.emplace_back([&, r] { results[r] = Train(args, env_of(r)); });
  }
  for (auto& t : threads) t.join();
  return results;
}

TEST(Train, JoinsThroughTorchrunSlurmAndOpenMpiVariables) {
  TempDir reference;
  ASSERT_EQ(
      Train(std::string(TINY_JOB) + " --run-dir " + reference.str() + " --set train.steps=3").code,
      0);
  const std::vector<std::pair<std::string, std::function<std::string(int, int)>>> styles = {
      {"torchrun",
       [](int r, int port) {
         return "RANK=" + std::to_string(r) + " WORLD_SIZE=2 LOCAL_RANK=" + std::to_string(r) +
                " MASTER_ADDR=127.0.0.1 MASTER_PORT=" + std::to_string(port);
       }},
      {"slurm",
       [](int r, int port) {
         return "SLURM_PROCID=" + std::to_string(r) +
                " SLURM_NTASKS=2 SLURM_LOCALID=" + std::to_string(r) +
                " MASTER_ADDR=127.0.0.1 MASTER_PORT=" + std::to_string(port);
       }},
      {"openmpi",
       [](int r, int port) {
         return "OMPI_COMM_WORLD_RANK=" + std::to_string(r) +
                " OMPI_COMM_WORLD_SIZE=2 "
                "OMPI_COMM_WORLD_LOCAL_RANK=" +
                std::to_string(r) + " MASTER_ADDR=127.0.0.1 MASTER_PORT=" + std::to_string(port);
       }},
  };
  for (const auto& [name, env] : styles) {
    TempDir dir;
    const cai::launch::PortReservation port("127.0.0.1");
    auto results = JoinAs(
        2, [&](int r) { return env(r, port.port()); },
        std::string(TINY_JOB) + " --run-dir " + dir.str() +
            " --set plugin.name=hello_strategy --set train.steps=3 --set launch.timeout_s=60");
    for (int r = 0; r < 2; ++r) {
      ASSERT_EQ(results[r].code, 0) << name << " rank " << r << ":\n" << results[r].output;
    }
    CAI_EXPECT_CONTAINS(ReadFile((dir / "logs/rank-1.log").string()), "rank 1 of 2 (pid");
    CAI_EXPECT_CONTAINS(ReadFile((dir / "logs/rank-1.log").string()), "joined through " + name);
    // Both ranks on this host: the ring collectives take shared memory.
    CAI_EXPECT_CONTAINS(ReadFile((dir / "logs/rank-1.log").string()),
                        "all_reduce, reduce_scatter and all_gather go through shared memory");
    ExpectClose(Losses(dir / ""), Losses(reference / ""), 1e-5);
  }
}

bool Alive(pid_t pid) { return kill(pid, 0) == 0; }

TEST(Train, KilledRank_LauncherStopsOthersAndExitsNonZero) {
  TempDir dir;
  const fs::path out = dir / "launcher.out";
  // A long run, started in the background; its launcher's pid and exit status go to files.
  const std::string command = "(env -u RANK -u WORLD_SIZE HOME=/nonexistent " +
                              std::string(CAI_EXE) + " train " + TINY_JOB +
                              " --nproc 2 --run-dir " + dir.str() +
                              " --set plugin.name=hello_strategy "
                              "--set train.steps=100000 > " +
                              out.string() + " 2>&1; echo $? > " + (dir / "exit").string() +
                              ") & echo $! > " + (dir / "launcher.pid").string();
  ASSERT_EQ(std::system(command.c_str()), 0);
  // Wait until both ranks have logged their pids and training runs.
  std::regex pid_line("rank ([01]) of 2 \\(pid ([0-9]+)");
  std::vector<pid_t> pids(2, 0);
  for (int i = 0; i < 600 && (pids[0] == 0 || pids[1] == 0 || !fs::exists(dir / "metrics.jsonl"));
       ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
    for (int r = 0; r < 2; ++r) {
      std::smatch m;
      std::string log = ReadFile((dir / ("logs/rank-" + std::to_string(r) + ".log")).string());
      if (std::regex_search(log, m, pid_line)) pids[r] = std::stoi(m[2]);
    }
  }
  ASSERT_TRUE(pids[0] && pids[1]) << ReadFile(out.string());
  const auto killed_at = std::chrono::steady_clock::now();
  ASSERT_EQ(kill(pids[1], SIGKILL), 0);
  while (!fs::exists(dir / "exit") &&
         std::chrono::steady_clock::now() - killed_at < std::chrono::seconds(90)) {
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - killed_at).count();
  ASSERT_TRUE(fs::exists(dir / "exit")) << "launcher still running after 90 s";
  EXPECT_LT(seconds, 60.0);
  EXPECT_NE(std::stoi(ReadFile((dir / "exit").string())), 0);
  const std::string output = ReadFile(out.string());
  CAI_EXPECT_CONTAINS(output, "rank 1");
  CAI_EXPECT_CONTAINS(output, "SIGKILL");
  EXPECT_FALSE(Alive(pids[0])) << "rank 0 left behind";
  EXPECT_FALSE(Alive(pids[1]));
}

// ---- Bad input ------------------------------------------------------------------------------

struct BadCase {
  std::string name;
  std::string job_text;               // written to job.toml ("" = use the tiny job)
  std::string args;                   // extra arguments
  std::vector<std::string> expected;  // fragments of the message
};

void ExpectRefused(const BadCase& c) {
  TempDir dir;
  std::string job = TINY_JOB;
  if (!c.job_text.empty()) {
    job = (dir / "job.toml").string();
    std::ofstream(job) << c.job_text;
  }
  Result r = Train(job + " --run-dir " + (dir / "run").string() + " " + c.args);
  EXPECT_NE(r.code, 0) << c.name << "\n" << r.output;
  for (const std::string& fragment : c.expected) {
    std::string expanded = std::regex_replace(fragment, std::regex("\\$DIR"), dir.str());
    CAI_EXPECT_CONTAINS(r.output, expanded);
  }
}

TEST(TrainBadInput, MalformedJobFile) {
  ExpectRefused(
      {"malformed", "[train\nsteps = 3\n", "", {"$DIR/job.toml: malformed TOML at line 1"}});
}

TEST(TrainBadInput, UnknownKey_NamesNearestValidKey) {
  ExpectRefused(
      {"unknown key",
       "[train]\nstepz = 3\n",
       "",
       {"[train] in $DIR/job.toml: unknown key 'stepz' (line 2).", "did you mean 'steps'?"}});
  ExpectRefused({"unknown section",
                 "[trian]\nsteps = 3\n",
                 "",
                 {"unknown section 'trian' (line 1). did you mean 'train'?"}});
  ExpectRefused({"unknown --set",
                 "",
                 "--set train.global_bacth=4",
                 {"unknown key 'global_bacth'", "did you mean 'global_batch'?"}});
}

TEST(TrainBadInput, MemoryKeys_SizeWithDecimalUnitOrNoNumberAndMissingNvmeDirectory) {
  ExpectRefused({"decimal unit",
                 "[memory]\ndevice_budget = \"4GB\"\n",
                 "",
                 {"[memory] device_budget = \"4GB\" in $DIR/job.toml is not a size", "\"512MiB\"",
                  "1 GB is not 1 GiB"}});
  ExpectRefused({"no number",
                 "",
                 "--set memory.host_budget=lots",
                 {"[memory] host_budget = \"lots\"", "is not a size"}});
  ExpectRefused({"nvme dir",
                 "",
                 "--set memory.nvme_dir=/nonexistent/cai",
                 {"memory.nvme_dir: NVMe directory \"/nonexistent/cai\" is not a writable "
                  "directory"}});
}

TEST(TrainBadInput, WrongType_NamesKey) {
  ExpectRefused({"wrong type",
                 "[train]\nsteps = \"many\"\n",
                 "",
                 {"key 'steps' (line 2): expected an integer, got string \"many\""}});
}

TEST(TrainBadInput, MissingDataFile) {
  ExpectRefused({"missing data",
                 "",
                 "--set data.source=tokens --set data.path=/nonexistent.bin",
                 {"/nonexistent.bin"}});
}

TEST(TrainBadInput, TokenFileWithOddLengthOrIdsBeyondVocab) {
  TempDir dir;
  const std::string odd = (dir / "odd.bin").string();
  std::ofstream(odd, std::ios::binary) << std::string(2001, 'a');
  Result r = Train(std::string(TINY_JOB) + " --run-dir " + (dir / "r1").string() +
                   " --set data.source=tokens --set data.path=" + odd);
  EXPECT_NE(r.code, 0);
  CAI_EXPECT_CONTAINS(r.output, odd);
  CAI_EXPECT_CONTAINS(r.output, "2001");
  const std::string big = (dir / "big.bin").string();
  {
    std::ofstream f(big, std::ios::binary);
    for (int i = 0; i < 2000; ++i) {
      uint16_t id = i == 1500 ? 300 : 65;  // one id beyond the 256-token vocabulary
      f.write(reinterpret_cast<const char*>(&id), 2);
    }
  }
  r = Train(std::string(TINY_JOB) + " --run-dir " + (dir / "r2").string() +
            " --set data.source=tokens --set data.path=" + big);
  EXPECT_NE(r.code, 0);
  CAI_EXPECT_CONTAINS(r.output, big);
  CAI_EXPECT_CONTAINS(r.output, "300");
}

TEST(TrainBadInput, MisspeltPluginTable_NamesTableAndNearestPlugin) {
  ExpectRefused(
      {"misspelt table in the file",
       "[plugin]\nname = \"none\"\n\n[plugin.fdsp]\nsharding_strategy = \"FULL_SHARD\"\n",
       "",
       {"[plugin.fdsp] (line 4) in $DIR/job.toml names no plugin", "Did you mean [plugin.fsdp]?"}});
  ExpectRefused({"misspelt table from --set",
                 "",
                 "--set plugin.fdsp.sharding_strategy=FULL_SHARD",
                 {"[plugin.fdsp] (from --set plugin.fdsp.sharding_strategy=FULL_SHARD)",
                  "names no plugin", "Did you mean [plugin.fsdp]?"}});
  // plugin.name = "auto" may choose any real plugin, but a misspelt one never.
  ExpectRefused({"misspelt table under auto",
                 "",
                 "--set plugin.name=auto --set plugin.lowlevel_zero.stage=2",
                 {"[plugin.lowlevel_zero]", "Did you mean [plugin.low_level_zero]?"}});
}

TEST(TrainBadInput, AnotherPluginsTable_IsAWarningThatItIsUnused) {
  TempDir dir;
  Result r = Train(std::string(TINY_JOB) + " --run-dir " + dir.str() +
                   " --set train.steps=1 --set plugin.ddp.bucket_cap_mb=4");
  ASSERT_EQ(r.code, 0) << r.output;
  CAI_EXPECT_CONTAINS(r.output, "[plugin.ddp] (from --set plugin.ddp.bucket_cap_mb=4) in " +
                                    std::string(TINY_JOB) + " is not used: plugin.name = \"none\"");
}

TEST(TrainBadInput, EnumValue_ListsTheChoicesAndNamesSetOption) {
  ExpectRefused({"enum from --set",
                 "",
                 "--set train.precision=fp8",
                 {"key 'precision' (from --set train.precision=fp8): \"fp8\" is not one of "
                  "\"fp32\", \"bf16\", \"fp16\""}});
  ExpectRefused({"enum in the file",
                 "[train]\nprecision = \"bf61\"\n",
                 "",
                 {"key 'precision' (line 2): \"bf61\" is not one of \"fp32\", \"bf16\", "
                  "\"fp16\" (did you mean \"bf16\"?)"}});
  ExpectRefused({"wrong type from --set",
                 "",
                 "--set train.steps=many",
                 {"key 'steps' (from --set train.steps=many): expected an integer, got string"}});
  ExpectRefused({"[plugin] key from --set",
                 "",
                 "--set plugin.initial_scale=x",
                 {"'plugin.initial_scale' (from --set plugin.initial_scale=x)"}});
  ExpectRefused({"strategy's key from --set",
                 "",
                 "--set plugin.none.initial_scale=x",
                 {"[plugin.none] in " + std::string(TINY_JOB) +
                  ": key 'initial_scale' (from --set plugin.none.initial_scale=x): expected a "
                  "number, got string \"x\""}});
}

TEST(TrainBadInput, EverythingFrozen_SaysNoTrainableParametersWithoutBacktrace) {
  TempDir dir;
  Result r = Train(std::string(TINY_JOB) + " --run-dir " + dir.str() + " --set model.freeze=*");
  EXPECT_NE(r.code, 0);
  CAI_EXPECT_CONTAINS(r.output,
                      "none: the model has no trainable parameters; unfreeze some (model.freeze)");
  EXPECT_EQ(r.output.find("Exception raised from"), std::string::npos) << r.output;
  EXPECT_EQ(r.output.find("frame #"), std::string::npos) << r.output;
}

// Every rank hits the same missing file: the launcher prints the message once, naming both
// ranks, before its summary.
TEST(TrainBadInput, SameErrorOnEveryRank_PrintedOnceWithTheRanks) {
  TempDir dir;
  Result r = Train(std::string(TINY_JOB) + " --run-dir " + dir.str() +
                   " --nproc 2 --set plugin.name=ddp --set data.source=tokens "
                   "--set data.path=/nonexistent/tokens.bin");
  EXPECT_NE(r.code, 0);
  CAI_EXPECT_CONTAINS(r.output, "cai: error: ranks 0,1: ");
  size_t count = 0;
  for (size_t at = 0; (at = r.output.find("/nonexistent/tokens.bin", at)) != std::string::npos;
       ++at) {
    ++count;
  }
  EXPECT_EQ(count, 1u) << r.output;
  EXPECT_LT(r.output.find("cai: error: ranks 0,1: "), r.output.find("exited with status"))
      << r.output;
  CAI_EXPECT_CONTAINS(ReadFile((dir / "logs/rank-1.log").string()), "/nonexistent/tokens.bin");
}

TEST(TrainBadInput, NprocZeroAndUnknownPlugin) {
  ExpectRefused({"nproc 0", "", "--nproc 0", {"--nproc"}});
  ExpectRefused({"unknown plugin",
                 "",
                 "--set plugin.name=hello_strategie",
                 {"no such strategy. did you mean 'hello_strategy'?"}});
  ExpectRefused({"reference on two ranks",
                 "",
                 "--nproc 2",
                 {"plugin 'none' is the single-process reference"}});
}

}  // namespace
