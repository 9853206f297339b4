// Ranks of `cai train` started one by one (as torchrun, srun or mpirun start them), watched,
// signalled and checked: what the failure-detection tests share.
#pragma once

#include <fcntl.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <string>
#include <thread>
#include <vector>

#include "checkpoint/checkpoint.h"
#include "launch/port_reservation.h"
#include "train_run.h"

extern char** environ;

namespace cai::testing {

struct RankProcess {
  pid_t pid = -1;
  std::filesystem::path log;  // its stdout and stderr
};

#ifndef CAI_EXPECT_CONTAINS
#define CAI_EXPECT_CONTAINS(haystack, needle)                      \
  EXPECT_NE(std::string(haystack).find(needle), std::string::npos) \
      << "missing: " << (needle) << "\nin:\n"                      \
      << (haystack)
#endif

// The tiny GPT-2 job with ddp, run long (the test ends it), saving a checkpoint every 2 steps.
inline void WriteJob(const std::filesystem::path& dir) {
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir);
  std::ofstream(dir / "job.toml") << kTinyGptJob;
}

inline std::vector<std::string> TrainArgs(const std::filesystem::path& dir,
                                          std::vector<std::string> extra_sets = {}) {
  std::vector<std::string> args = {CAI_EXE, "train", (dir / "job.toml").string(), "--run-dir",
                                   (dir / "run").string()};
  std::vector<std::string> sets = {"plugin.name=ddp", "train.steps=100000", "checkpoint.every=2",
                                   "checkpoint.at_end=false"};
  sets.insert(sets.end(), extra_sets.begin(), extra_sets.end());
  for (const std::string& s : sets) {
    args.push_back("--set");
    args.push_back(s);
  }
  return args;
}

// Starts `prefix` + `args` (prefix: e.g. {"ip", "netns", "exec", "ns"}, which execs in place)
// with this process's environment less any launcher variable, plus `vars`, and only the ddp
// plugin discoverable; stdout and stderr go to `log`. The process dies with the test.
inline RankProcess StartRank(const std::vector<std::string>& prefix,
                             const std::vector<std::string>& args,
                             const std::vector<std::string>& vars,
                             const std::filesystem::path& log) {
  std::vector<std::string> argv = prefix;
  argv.insert(argv.end(), args.begin(), args.end());
  std::vector<std::string> env;
  for (char** e = environ; *e != nullptr; ++e) {
    if (!conformance::IsInheritedLauncherVariable(*e)) env.emplace_back(*e);
  }
  env.push_back(std::string("CAI_PLUGIN_FILES=") + CAI_DDP_MANIFEST);
  env.insert(env.end(), vars.begin(), vars.end());
  std::vector<char*> argp, envp;
  for (std::string& a : argv) argp.push_back(a.data());
  argp.push_back(nullptr);
  for (std::string& e : env) envp.push_back(e.data());
  envp.push_back(nullptr);
  std::fflush(stdout);
  std::fflush(stderr);
  const pid_t parent = getpid();
  const pid_t pid = fork();
  if (pid == 0) {
    prctl(PR_SET_PDEATHSIG, SIGKILL);
    if (getppid() != parent) _exit(127);
    const int fd = open(log.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
    dup2(fd, STDOUT_FILENO);
    dup2(fd, STDERR_FILENO);
    execvpe(argp[0], argp.data(), envp.data());
    _exit(127);
  }
  return {pid, log};
}

// Whether `pid` runs (a zombie does not).
inline bool ProcessAlive(pid_t pid) {
  std::ifstream stat("/proc/" + std::to_string(pid) + "/stat");
  std::string field;
  for (int i = 0; i < 3 && stat >> field; ++i) {
  }
  return stat && field != "Z" && field != "X";
}

// The pid a rank's log names ("rank 1 of 3 (pid 1234, ...").
inline pid_t PidInLog(const std::filesystem::path& log) {
  const std::string text = ReadFile(log);
  const size_t at = text.find("(pid ");
  return at == std::string::npos ? -1 : static_cast<pid_t>(std::stol(text.substr(at + 5)));
}

// The wait status of child `pid`, waiting up to `limit` (then killing it: status -1).
inline int WaitExit(pid_t pid, std::chrono::seconds limit) {
  const auto deadline = std::chrono::steady_clock::now() + limit;
  int status = 0;
  while (waitpid(pid, &status, WNOHANG) != pid) {
    if (std::chrono::steady_clock::now() > deadline) {
      kill(pid, SIGKILL);
      waitpid(pid, &status, 0);
      return -1;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  return status;
}

inline int CompleteCheckpoints(const std::filesystem::path& run_dir) {
  int n = 0;
  std::error_code ec;
  for (const auto& entry : std::filesystem::directory_iterator(run_dir / "checkpoints", ec)) {
    n += std::filesystem::exists(entry.path() / "COMPLETE") ? 1 : 0;
  }
  return n;
}

// Waits (up to 3 minutes) until the run has `n` complete checkpoints; fails, with the logs,
// if one of `procs` ends first.
inline void WaitForCheckpoints(const std::filesystem::path& run_dir,
                               const std::vector<RankProcess>& procs, int n) {
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::minutes(3);
  while (CompleteCheckpoints(run_dir) < n) {
    for (const RankProcess& p : procs) {
      ASSERT_TRUE(ProcessAlive(p.pid)) << p.log << " ended early:\n" << ReadFile(p.log);
    }
    ASSERT_LT(std::chrono::steady_clock::now(), deadline) << "no checkpoint in 3 minutes";
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
}

// Sends `signal` to `victim` (rank `victim_rank`) and expects every survivor to exit non-zero
// within 10 s, its output naming the victim and a collective; then kills the victim.
inline void ExpectDetected(const RankProcess& victim, int signal,
                           const std::vector<RankProcess>& survivors, int victim_rank) {
  const auto start = std::chrono::steady_clock::now();
  ASSERT_EQ(kill(victim.pid, signal), 0);
  std::vector<int> status(survivors.size(), 0);
  std::vector<double> took(survivors.size(), -1);
  size_t left = survivors.size();
  while (left > 0 && std::chrono::steady_clock::now() - start < std::chrono::seconds(30)) {
    for (size_t i = 0; i < survivors.size(); ++i) {
      if (took[i] >= 0 || waitpid(survivors[i].pid, &status[i], WNOHANG) != survivors[i].pid) {
        continue;
      }
      took[i] = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
      --left;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  const std::string name = "rank " + std::to_string(victim_rank);
  for (size_t i = 0; i < survivors.size(); ++i) {
    const std::string log = ReadFile(survivors[i].log);
    if (took[i] < 0) {
      ADD_FAILURE() << survivors[i].log << " still running 30 s after " << name << " got signal "
                    << signal << ":\n"
                    << log;
      kill(survivors[i].pid, SIGKILL);
      waitpid(survivors[i].pid, nullptr, 0);
      continue;
    }
    std::printf("%s: exited %.1f s after %s got signal %d\n", survivors[i].log.c_str(), took[i],
                name.c_str(), signal);
    EXPECT_LT(took[i], 10.0) << log;
    EXPECT_TRUE(WIFEXITED(status[i]) && WEXITSTATUS(status[i]) != 0) << "status " << status[i];
    // Which rank, and the collective: "rank 1 stopped answering ... it was in all_reduce #40
    // on group 'world'", "rank 2 closed its connection ... #40".
    CAI_EXPECT_CONTAINS(log, name);
    CAI_EXPECT_CONTAINS(log, " on group 'world'");
    const size_t error = log.find("[error]");
    if (error != std::string::npos) {
      std::printf("  %s\n", log.substr(error, log.find('\n', error) - error).c_str());
    }
  }
  kill(victim.pid, SIGKILL);
  waitpid(victim.pid, nullptr, 0);
}

// The run's latest checkpoint is complete, and a run of `nproc` ranks resumes from it for 2
// more steps.
inline void ExpectLastCheckpointResumes(const std::filesystem::path& dir, int nproc,
                                        std::vector<std::string> sets = {}) {
  const auto latest = ckpt::FindLatestCheckpoint(dir / "run" / "checkpoints");
  ASSERT_TRUE(latest.has_value()) << "no complete checkpoint in " << dir;
  const std::string complete = ReadFile(*latest / "COMPLETE");
  const size_t at = complete.find("step = ");
  ASSERT_NE(at, std::string::npos) << complete;
  const int64_t step = std::stoll(complete.substr(at + 7));
  sets.insert(sets.end(), {"plugin.name=ddp", "checkpoint.resume=true", "checkpoint.every=0",
                           "train.steps=" + std::to_string(step + 2)});
  const TrainRun resumed = RunTrain(dir, kTinyGptJob, nproc, sets, CAI_DDP_MANIFEST,
                                    /*resume=*/true, "resume.txt");
  ASSERT_EQ(resumed.exit_code, 0) << resumed.output;
  CAI_EXPECT_CONTAINS(resumed.output, "resumed from ");
  CAI_EXPECT_CONTAINS(resumed.output, "(step " + std::to_string(step));
  ASSERT_FALSE(resumed.steps.empty()) << resumed.output;
  EXPECT_EQ(resumed.steps.back(), step + 2) << resumed.output;
}

}  // namespace cai::testing
