// Two "nodes" on this machine: two network namespaces joined by a veth pair, with addresses of
// their own, two ranks in each, started with torchrun-style variables and MASTER_ADDR on the
// first namespace, the communicator bound to each namespace's veth end by CAI_SOCKET_IFNAME.
// The run must match the single-process reference; then the second node is lost (its link
// goes down, so nothing is reset, and its ranks are killed) and the first node's ranks must
// exit non-zero within 10 s naming a lost rank.
#include <array>
#include <cstdlib>

#include "failure_harness.h"

namespace cai::testing {
namespace {

namespace fs = std::filesystem;
using std::chrono::seconds;

struct Shell {
  int code;
  std::string output;
};

Shell Sh(const std::string& command) {
  Shell r{-1, ""};
  FILE* pipe = popen((command + " 2>&1").c_str(), "r");
  if (pipe == nullptr) return r;
  char buffer[4096];
  for (size_t n; (n = fread(buffer, 1, sizeof buffer, pipe)) > 0;) r.output.append(buffer, n);
  const int status = pclose(pipe);
  r.code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  return r;
}

// Two namespaces and the veth pair between them, named after this process so that concurrent
// tests do not collide; removed (with the pair) when it goes out of scope.
class TwoNodes {
 public:
  TwoNodes() {
    const std::string id = std::to_string(getpid());
    ns_ = {"cai-a-" + id, "cai-b-" + id};
    ifname_ = {"caiva" + id, "caivb" + id};
    const std::string net = "10.211." + std::to_string(getpid() % 250 + 1) + ".";
    addr_ = {net + "1", net + "2"};
  }
  ~TwoNodes() {
    for (const std::string& ns : ns_) Sh("ip netns del " + ns);
  }
  TwoNodes(const TwoNodes&) = delete;
  TwoNodes& operator=(const TwoNodes&) = delete;

  // Empty on success, else why the namespaces could not be made (and whether to skip).
  std::string Create(bool& unavailable) {
    unavailable = false;
    Shell probe = Sh("ip netns add " + ns_[0]);
    if (probe.code != 0) {
      unavailable = probe.code == 127 ||
                    probe.output.find("Operation not permitted") != std::string::npos ||
                    probe.output.find("Permission denied") != std::string::npos;
      return "ip netns add " + ns_[0] + ": " + probe.output;
    }
    const std::vector<std::string> steps = {
        "ip netns add " + ns_[1],
        "ip link add " + ifname_[0] + " netns " + ns_[0] + " type veth peer name " + ifname_[1] +
            " netns " + ns_[1],
        "ip -n " + ns_[0] + " addr add " + addr_[0] + "/24 dev " + ifname_[0],
        "ip -n " + ns_[1] + " addr add " + addr_[1] + "/24 dev " + ifname_[1],
        "ip -n " + ns_[0] + " link set " + ifname_[0] + " up",
        "ip -n " + ns_[1] + " link set " + ifname_[1] + " up",
        "ip -n " + ns_[0] + " link set lo up",
        "ip -n " + ns_[1] + " link set lo up"};
    for (const std::string& step : steps) {
      Shell r = Sh(step);
      if (r.code != 0) return step + ": " + r.output;
    }
    return "";
  }

  // Starts rank `rank` of 4: ranks 0 and 1 on node 0, 2 and 3 on node 1.
  RankProcess Start(int rank, const std::vector<std::string>& args, const fs::path& log) const {
    const int node = rank / 2;
    return StartRank(
        {"ip", "netns", "exec", ns_[node]}, args,
        {"RANK=" + std::to_string(rank), "WORLD_SIZE=4", "LOCAL_RANK=" + std::to_string(rank % 2),
         "LOCAL_WORLD_SIZE=2", "MASTER_ADDR=" + addr_[0], "MASTER_PORT=29500",
         "CAI_SOCKET_IFNAME=" + ifname_[node]},
        log);
  }

  void LinkDown(int node) const {
    Sh("ip -n " + ns_[node] + " link set " + ifname_[node] + " down");
  }
  const std::string& address(int node) const { return addr_[node]; }
  const std::string& ifname(int node) const { return ifname_[node]; }

 private:
  std::array<std::string, 2> ns_, ifname_, addr_;
};

TEST(MultiNode, MultiNode_TwoNamespacesOverVeth_MatchesReferenceAndLostNodeIsDetected) {
  if (geteuid() != 0) GTEST_SKIP() << "creating network namespaces needs root (CAP_NET_ADMIN)";
  TwoNodes nodes;
  bool unavailable = false;
  const std::string error = nodes.Create(unavailable);
  if (unavailable) GTEST_SKIP() << "network namespaces are unavailable here: " << error;
  ASSERT_EQ(error, "");

  const fs::path root = fs::path(CAI_FAILURE_TEST_RUNS) / "multinode";
  const std::vector<std::string> batch = {"train.global_batch=8"};
  std::vector<std::string> ref_sets = batch;
  ref_sets.push_back("plugin.name=none");
  const TrainRun ref = RunTrain(root / "reference", kTinyGptJob, 1, ref_sets, CAI_DDP_MANIFEST);
  ASSERT_EQ(ref.exit_code, 0) << ref.output;

  // The run: 6 steps of ddp over the veth pair.
  const fs::path dir = root / "veth";
  WriteJob(dir);
  std::vector<std::string> args = {CAI_EXE, "train", (dir / "job.toml").string(), "--run-dir",
                                   (dir / "run").string(), "--set", "plugin.name=ddp",
                                   // The "nodes" share this host's /dev/shm: TCP, as between
                                   // real nodes.
                                   "--set", "launch.comm_transport=tcp", "--set", batch[0]};
  std::vector<RankProcess> ranks;
  for (int r = 0; r < 4; ++r) {
    ranks.push_back(nodes.Start(r, args, dir / ("rank-" + std::to_string(r) + ".out")));
  }
  for (int r = 0; r < 4; ++r) {
    const int status = WaitExit(ranks[r].pid, seconds(300));
    ASSERT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0)
        << "rank " << r << " (status " << status << "):\n"
        << ReadFile(ranks[r].log);
    // Bound to the veth end it was told, not to loopback.
    CAI_EXPECT_CONTAINS(ReadFile(ranks[r].log), "collectives bind to " + nodes.address(r / 2) +
                                                    " (interface " + nodes.ifname(r / 2) +
                                                    " from CAI_SOCKET_IFNAME)");
    CAI_EXPECT_CONTAINS(ReadFile(ranks[r].log),
                        "all_reduce, reduce_scatter and all_gather go over TCP, not through "
                        "shared memory (launch.comm_transport = \"tcp\")");
  }
  TrainRun run = conformance::ReadRun(dir / "run");
  run.exit_code = 0;
  ExpectMatches(ref, run, 1e-5);

  // Node 1 is lost: its link goes down first, so neither its ranks' deaths nor anything else
  // resets a connection on node 0; only the heartbeats tell.
  const fs::path lost = root / "lost";
  WriteJob(lost);
  ranks.clear();
  for (int r = 0; r < 4; ++r) {
    ranks.push_back(
        nodes.Start(r, TrainArgs(lost, batch), lost / ("rank-" + std::to_string(r) + ".out")));
  }
  WaitForCheckpoints(lost / "run", ranks, 2);
  const auto start = std::chrono::steady_clock::now();
  nodes.LinkDown(1);
  for (int r : {2, 3}) kill(ranks[r].pid, SIGKILL);
  for (int r : {0, 1}) {
    const int status = WaitExit(ranks[r].pid, seconds(30));
    const double took =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    const std::string log = ReadFile(ranks[r].log);
    std::printf("rank %d exited %.1f s after node 1 was lost\n", r, took);
    EXPECT_LT(took, 10.0) << log;
    EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) != 0) << "status " << status << log;
    const bool named = log.find("rank 2 stopped answering") != std::string::npos ||
                       log.find("rank 3 stopped answering") != std::string::npos;
    EXPECT_TRUE(named) << log;
    CAI_EXPECT_CONTAINS(log, "its last heartbeat said it was in ");
  }
  for (int r : {2, 3}) waitpid(ranks[r].pid, nullptr, 0);
  ExpectLastCheckpointResumes(lost, 4, batch);
}

}  // namespace
}  // namespace cai::testing
