// Failure detection end to end: `cai train` ranks started one by one with torchrun, SLURM or
// Open MPI variables, as a cluster's launcher starts them, or by `cai train --nproc`. One rank
// is stopped (SIGSTOP: a hang, which resets no connection) or killed (SIGKILL) mid-run; every
// other rank must exit non-zero within 10 s naming it and the collective it was in, and the
// last complete checkpoint must stay intact and resume.
#include "failure_harness.h"

namespace cai::testing {
namespace {

namespace fs = std::filesystem;
using std::chrono::seconds;

enum class Launcher { kTorchrun, kSlurm, kOpenMpi, kMpich };

// The variables `launcher` gives rank `rank` of `world` (the master is this machine).
std::vector<std::string> LauncherVars(Launcher launcher, int rank, int world, int port) {
  const std::string r = std::to_string(rank), w = std::to_string(world);
  const std::string master = "MASTER_PORT=" + std::to_string(port);
  switch (launcher) {
    case Launcher::kTorchrun:
      return {"RANK=" + r, "WORLD_SIZE=" + w, "LOCAL_RANK=" + r, "MASTER_ADDR=127.0.0.1", master};
    case Launcher::kSlurm:
      return {"SLURM_PROCID=" + r,  "SLURM_NTASKS=" + w,
              "SLURM_LOCALID=" + r, "SLURM_LAUNCH_NODE_IPADDR=127.0.0.1",
              "SLURM_JOB_ID=4242",  master};
    case Launcher::kOpenMpi:
      return {"OMPI_COMM_WORLD_RANK=" + r, "OMPI_COMM_WORLD_SIZE=" + w,
              "OMPI_COMM_WORLD_LOCAL_RANK=" + r, "MASTER_ADDR=127.0.0.1", master};
    case Launcher::kMpich:
      return {"PMI_RANK=" + r, "PMI_SIZE=" + w, "MPI_LOCALRANKID=" + r, "MASTER_ADDR=127.0.0.1",
              master};
  }
  return {};
}

// Three ranks under `launcher`; `victim` gets `signal` once two checkpoints exist. Returns the
// test directory (job.toml, run/).
fs::path SignalOneRank(const std::string& name, Launcher launcher, int victim, int signal) {
  const fs::path dir = fs::path(CAI_FAILURE_TEST_RUNS) / name;
  WriteJob(dir);
  const int world = 3;
  const launch::PortReservation port("127.0.0.1");
  std::vector<RankProcess> ranks;
  for (int r = 0; r < world; ++r) {
    ranks.push_back(StartRank({}, TrainArgs(dir), LauncherVars(launcher, r, world, port.port()),
                              dir / ("rank-" + std::to_string(r) + ".out")));
  }
  WaitForCheckpoints(dir / "run", ranks, 2);
  std::vector<RankProcess> survivors;
  for (int r = 0; r < world; ++r) {
    if (r != victim) survivors.push_back(ranks[r]);
  }
  ExpectDetected(ranks[victim], signal, survivors, victim);
  return dir;
}

TEST(Failure, Failure_Torchrun_StoppedRank_OthersExitWithin10sNamingIt_CheckpointResumes) {
  const fs::path dir = SignalOneRank("torchrun_stop", Launcher::kTorchrun, /*victim=*/1, SIGSTOP);
  ExpectLastCheckpointResumes(dir, 3);
}

TEST(Failure, Failure_Slurm_StoppedRank0_OthersExitWithin10sNamingIt) {
  // Rank 0 also serves the rendezvous store: the others find it gone from the store.
  SignalOneRank("slurm_stop_rank0", Launcher::kSlurm, /*victim=*/0, SIGSTOP);
}

TEST(Failure, Failure_OpenMpi_KilledRank_OthersExitWithin10sNamingIt) {
  SignalOneRank("openmpi_kill", Launcher::kOpenMpi, /*victim=*/2, SIGKILL);
}

TEST(Failure, Failure_Mpich_StoppedRank2_OthersExitWithin10sNamingIt) {
  SignalOneRank("mpich_stop", Launcher::kMpich, /*victim=*/2, SIGSTOP);
}

TEST(Failure, Failure_Nproc_StoppedRank_OthersExitWithin10sAndLauncherEnds) {
  const fs::path dir = fs::path(CAI_FAILURE_TEST_RUNS) / "nproc_stop";
  WriteJob(dir);
  std::vector<std::string> args = TrainArgs(dir);
  args.insert(args.begin() + 3, {"--nproc", "3"});
  const RankProcess launcher = StartRank({}, args, {}, dir / "launcher.out");
  WaitForCheckpoints(dir / "run", {launcher}, 2);
  // The launcher's ranks are its children; each logs its pid.
  std::vector<RankProcess> ranks;
  for (int r = 0; r < 3; ++r) {
    const fs::path log = dir / "run" / "logs" / ("rank-" + std::to_string(r) + ".log");
    ranks.push_back({PidInLog(log), log});
  }
  const auto start = std::chrono::steady_clock::now();
  ASSERT_EQ(kill(ranks[1].pid, SIGSTOP), 0);
  // The survivors are the launcher's children, not ours: watch them through /proc. The first
  // to notice exits naming rank 1; the launcher then stops the others.
  std::string logs;
  for (int r : {0, 2}) {
    while (ProcessAlive(ranks[r].pid) && std::chrono::steady_clock::now() - start < seconds(20)) {
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
    }
    const double took =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    std::printf("rank %d ended %.1f s after rank 1 stopped\n", r, took);
    EXPECT_LT(took, 10.0) << "rank " << r << " still running " << took << " s after rank 1 stopped";
    logs += ReadFile(ranks[r].log);
  }
  CAI_EXPECT_CONTAINS(logs, "lost a peer, stopping: rank 1 stopped answering");
  CAI_EXPECT_CONTAINS(logs, "its last heartbeat said it was in ");
  // The launcher continues the stopped rank so that its SIGTERM ends it, then exits non-zero.
  const int status = WaitExit(launcher.pid, seconds(20));
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) != 0) << "status " << status;
  CAI_EXPECT_CONTAINS(ReadFile(launcher.log), "cai: error: rank ");
}

}  // namespace
}  // namespace cai::testing
