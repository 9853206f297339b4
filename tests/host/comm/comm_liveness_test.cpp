// Failure detection without the collective timeout (heartbeats), the call check, binding
// to a named interface, and the rendezvous store's connection.
#include <atomic>
#include <cstdlib>
#include <memory>
#include <thread>
#include <vector>

#include "comm/liveness.h"
#include "comm/store.h"
#include "comm_test_util.h"

namespace cai::test {
namespace {

using std::chrono::milliseconds;
using std::chrono::seconds;
using Clock = std::chrono::steady_clock;

const cai_comm_api& Api() { return *CommApi(); }

void Init(const RankContext& ctx, milliseconds heartbeat_timeout) {
  CommOptions options;
  options.rank = ctx.rank;
  options.world_size = ctx.world_size;
  options.master_port = ctx.port;
  options.timeout = seconds(60);  // far beyond what any test waits: only the heartbeat can end it
  options.heartbeat_timeout = heartbeat_timeout;
  Communicator::Init(options);
}

// Forks a rank running `body`; its gtest failures become exit status 1. The rank leaves with
// _exit and no Shutdown, as a rank whose peer is gone would.
pid_t ForkRank(const RankContext& ctx, const std::function<void(const RankContext&)>& body) {
  std::fflush(stdout);
  std::fflush(stderr);
  const pid_t pid = fork();
  if (pid != 0) return pid;
  int code = 0;
  try {
    body(ctx);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "rank %d threw: %s\n", ctx.rank, e.what());
    code = 2;
  }
  if (::testing::Test::HasFailure()) code = 1;
  std::fflush(stdout);
  std::fflush(stderr);
  _exit(code);
}

// Waits up to `limit` for `pid` and expects exit status 0; kills it if it is still running.
void ExpectExitsCleanly(pid_t pid, int rank, seconds limit) {
  const auto deadline = Clock::now() + limit;
  int status = 0;
  while (waitpid(pid, &status, WNOHANG) != pid) {
    if (Clock::now() > deadline) {
      ADD_FAILURE() << "rank " << rank << " still running after " << limit.count() << " s";
      kill(pid, SIGKILL);
      waitpid(pid, &status, 0);
      return;
    }
    std::this_thread::sleep_for(milliseconds(20));
  }
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0)
      << "rank " << rank << " failed (status " << status << ")";
}

void AllReduce(HostTensor<float>& x, Outcome* outcome = nullptr) {
  cai_comm_args args = Args(CAI_COMM_ALL_REDUCE, nullptr, &x.t);
  if (outcome) {
    *outcome = Take(Api().run(&args, nullptr));
  } else {
    RunOp(args);
  }
}

// A stopped rank resets nothing: without heartbeats its peers would wait out the 60 s timeout.
// `victim` stops itself after the first all-reduce; the others' second all-reduce must fail
// within 10 s naming it and the collective it was last in, whether or not it serves the store.
void StoppedRankIsNamedWithin10s(int world, int victim) {
  const launch::PortReservation port("127.0.0.1");
  std::vector<pid_t> pids;
  for (int rank = 0; rank < world; ++rank) {
    pids.push_back(ForkRank({rank, world, port.port()}, [victim](const RankContext& ctx) {
      Init(ctx, milliseconds(5000));
      HostTensor<float> x(1000, kF32);
      AllReduce(x);
      // The victim beats (twice a second) after the all-reduce, then stops.
      if (ctx.rank == victim) {
        std::this_thread::sleep_for(milliseconds(1500));
        raise(SIGSTOP);
        return;
      }
      std::this_thread::sleep_for(milliseconds(1700));
      const auto start = Clock::now();
      Outcome o;
      AllReduce(x, &o);
      const double took = std::chrono::duration<double>(Clock::now() - start).count();
      EXPECT_EQ(o.code, CAI_UNAVAILABLE) << o.message;
      EXPECT_LT(took, 10.0) << o.message;
      std::printf("rank %d: failed after %.1f s: %s\n", ctx.rank, took, o.message.c_str());
      EXPECT_NE(o.message.find("all_reduce #2 on group 'world' (rank " + std::to_string(ctx.rank)),
                std::string::npos)
          << o.message;
      const std::string v = "rank " + std::to_string(victim);
      EXPECT_NE(o.message.find(v + " stopped answering"), std::string::npos) << o.message;
      EXPECT_NE(o.message.find("said it was in no collective (computing or idle; last "
                               "finished: all_reduce #1 on group 'world')"),
                std::string::npos)
          << o.message;
      EXPECT_NE(o.message.find("(this rank) is in all_reduce #2 on group 'world'"),
                std::string::npos)
          << o.message;
      // Aborted: what comes next fails at once.
      Outcome next;
      AllReduce(x, &next);
      EXPECT_EQ(next.code, CAI_FAILED_PRECONDITION) << next.message;
    }));
  }
  for (int rank = 0; rank < world; ++rank) {
    if (rank != victim) ExpectExitsCleanly(pids[rank], rank, seconds(40));
  }
  kill(pids[victim], SIGKILL);
  waitpid(pids[victim], nullptr, 0);
}

TEST(CommLiveness, Comm_ThreeRanks_StoppedRank_OthersFailWithin10sNamingItAndItsCollective) {
  StoppedRankIsNamedWithin10s(3, 1);
}

TEST(CommLiveness, Comm_ThreeRanks_StoppedRank0_OthersFailWithin10sNamingIt) {
  StoppedRankIsNamedWithin10s(3, 0);
}

// A killed rank resets its connections: a peer in a collective with it fails at once, naming it.
TEST(CommLiveness, Comm_ThreeRanks_KilledRank_PeersInCollectiveFailAtOnceNamingIt) {
  const launch::PortReservation port("127.0.0.1");
  std::vector<pid_t> pids;
  for (int rank = 0; rank < 3; ++rank) {
    pids.push_back(ForkRank({rank, 3, port.port()}, [](const RankContext& ctx) {
      Init(ctx, milliseconds(5000));
      HostTensor<float> x(1000, kF32);
      AllReduce(x);
      if (ctx.rank == 2) raise(SIGKILL);
      std::this_thread::sleep_for(milliseconds(300));
      const auto start = Clock::now();
      Outcome o;
      AllReduce(x, &o);
      const double took = std::chrono::duration<double>(Clock::now() - start).count();
      std::printf("rank %d: failed after %.1f s: %s\n", ctx.rank, took, o.message.c_str());
      EXPECT_EQ(o.code, CAI_UNAVAILABLE) << o.message;
      EXPECT_LT(took, 3.0) << o.message;
      EXPECT_NE(o.message.find("rank 2 closed its connection (it exited or was killed); the "
                               "last collective it started was #1"),
                std::string::npos)
          << o.message;
      // Rank 0 serves the store the other reads rank 2's progress from: it stays a moment.
      if (ctx.rank == 0) std::this_thread::sleep_for(milliseconds(2000));
    }));
  }
  for (int rank = 0; rank < 2; ++rank) ExpectExitsCleanly(pids[rank], rank, seconds(40));
  waitpid(pids[2], nullptr, 0);
}

// A cascade: rank 2 is killed in a collective with rank 1 only; rank 1 fails and exits; rank 0,
// in a collective with rank 1 only, meets nothing but rank 1 hanging up. It must still name
// rank 2, the first loss, which rank 1 published before closing its connections.
TEST(CommLiveness, Comm_ThreeRanks_KilledRankSeenThroughAnotherRank_NamesTheFirstLoss) {
  const launch::PortReservation port("127.0.0.1");
  std::vector<pid_t> pids;
  for (int rank = 0; rank < 3; ++rank) {
    pids.push_back(ForkRank({rank, 3, port.port()}, [](const RankContext& ctx) {
      Init(ctx, milliseconds(5000));
      const int32_t low[] = {0, 1};
      const int32_t high[] = {1, 2};
      cai_comm_group* g01 = nullptr;
      cai_comm_group* g12 = nullptr;
      CAI_EXPECT_OK(Api().new_group(low, 2, &g01));
      CAI_EXPECT_OK(Api().new_group(high, 2, &g12));
      HostTensor<float> x(1000, kF32);
      AllReduce(x);
      if (ctx.rank == 2) raise(SIGKILL);
      if (ctx.rank == 1) std::this_thread::sleep_for(milliseconds(300));
      cai_comm_args args = Args(CAI_COMM_ALL_REDUCE, nullptr, &x.t);
      args.group = ctx.rank == 1 ? g12 : g01;
      const auto start = Clock::now();
      const Outcome o = Take(Api().run(&args, nullptr));
      const double took = std::chrono::duration<double>(Clock::now() - start).count();
      std::printf("rank %d: failed after %.1f s: %s\n", ctx.rank, took, o.message.c_str());
      EXPECT_EQ(o.code, CAI_UNAVAILABLE) << o.message;
      EXPECT_LT(took, 3.0) << o.message;
      EXPECT_NE(o.message.find("(world rank 2) closed its connection (it exited or was killed)"),
                std::string::npos)
          << o.message;
      EXPECT_NE(o.message.find("(noticed by world rank 1 in all_reduce #1 on group"),
                std::string::npos)
          << o.message;
      // Rank 1 leaves as a rank that lost a peer does, which is all rank 0 sees of the loss.
      if (ctx.rank == 1) {
        std::fflush(stdout);
        _exit(::testing::Test::HasFailure() ? 1 : 0);
      }
    }));
  }
  for (int rank = 0; rank < 2; ++rank) ExpectExitsCleanly(pids[rank], rank, seconds(40));
  waitpid(pids[2], nullptr, 0);
}

// The cascade above relies on this order: a rank that learns of a verdict while its own
// collective is failing must find the communicator already aborted with the report, or it names
// the peer that hung up on it. CI once caught the verdict's waiter woken between the two.
TEST(CommLiveness, Liveness_VerdictFromAPeer_CheckVerdictReturnsOnlyOnceTheFailureWasActedOn) {
  const launch::PortReservation port("127.0.0.1");
  comm::Store store("127.0.0.1", port.port(), /*is_server=*/true, seconds(10));
  comm::LivenessOptions options;
  options.world_size = 2;
  options.interval = milliseconds(2000);
  options.limit = seconds(30);
  options.bind_address = "127.0.0.1";
  std::atomic<bool> acted{false};
  options.rank = 0;
  comm::Liveness watcher(
      store, options, [] { return std::string("all_reduce #1"); },
      [&](const std::string&) {
        // Slow, as an abort that shuts down every group's connections can be.
        std::this_thread::sleep_for(milliseconds(300));
        acted = true;
      });
  options.rank = 1;
  comm::Liveness reporter(
      store, options, [] { return std::string("all_reduce #1"); }, [](const std::string&) {});
  watcher.Start(store);
  reporter.Start(store);
  reporter.Report("rank 2 closed its connection");
  EXPECT_TRUE(watcher.CheckVerdict());
  EXPECT_TRUE(acted) << "CheckVerdict returned before the failure handler finished";
}

TEST(CommLiveness, Comm_TwoRanks_LongCollectiveOnHealthyGroup_DoesNotTripHeartbeat) {
  RunRanks(2, [](const RankContext& ctx) {
    Init(ctx, milliseconds(1000));
    HostTensor<float> x(10, kF32);
    x.data.assign(10, 1.0f);
    // Rank 1 arrives 4 heartbeat timeouts late; both stay alive, so nothing trips.
    if (ctx.rank == 1) std::this_thread::sleep_for(milliseconds(4000));
    const auto start = Clock::now();
    AllReduce(x);
    if (ctx.rank == 0) {
      EXPECT_GE(Clock::now() - start, milliseconds(3500));
    }
    EXPECT_EQ(x.data[0], 2.0f);
  });
}

TEST(CommLiveness, Comm_TwoRanks_DifferentCalls_FailOnEveryRankListingEachCall) {
  RunRanks(2, [](const RankContext& ctx) {
    Init(ctx, milliseconds(5000));
    // Element counts differ.
    HostTensor<float> x(ctx.rank == 0 ? 100 : 99, kF32);
    Outcome o;
    AllReduce(x, &o);
    EXPECT_EQ(o.code, CAI_INVALID_ARGUMENT) << o.message;
    EXPECT_NE(o.message.find("ranks called different collectives as all_reduce #1 on group "
                             "'world'"),
              std::string::npos)
        << o.message;
    EXPECT_NE(o.message.find("rank 0: all_reduce(sum) of 100 float32"), std::string::npos)
        << o.message;
    EXPECT_NE(o.message.find("rank 1: all_reduce(sum) of 99 float32"), std::string::npos)
        << o.message;
    EXPECT_NE(o.message.find("launch.check_calls = false"), std::string::npos) << o.message;
  });
  RunRanks(3, [](const RankContext& ctx) {
    Init(ctx, milliseconds(5000));
    // Operations and dtypes differ: an all-gather of int32 against broadcasts of float32.
    HostTensor<float> f(6, kF32);
    HostTensor<int32_t> in(2, kI32), out(6, kI32);
    cai_comm_args args = ctx.rank == 2 ? Args(CAI_COMM_ALL_GATHER, &in.t, &out.t)
                                       : Args(CAI_COMM_BROADCAST, nullptr, &f.t);
    Outcome o = Take(Api().run(&args, nullptr));
    EXPECT_EQ(o.code, CAI_INVALID_ARGUMENT) << o.message;
    EXPECT_NE(o.message.find("rank 0: broadcast from/to root 0 of 6 float32"), std::string::npos)
        << o.message;
    EXPECT_NE(o.message.find("rank 2: all_gather of 2 int32 into 6"), std::string::npos)
        << o.message;
    // The group is broken for every rank alike.
    Outcome next = Take(Api().run(&args, nullptr));
    EXPECT_EQ(next.code, CAI_FAILED_PRECONDITION) << next.message;
  });
}

TEST(CommLiveness, Comm_NamedInterface_BindsToItOrNamesTheMissingOne) {
  RunRanks(2, [](const RankContext& ctx) {
    CommOptions options;
    options.rank = ctx.rank;
    options.world_size = ctx.world_size;
    options.master_port = ctx.port;
    options.timeout = seconds(30);
    options.socket_ifname = "lo";
    Communicator::Init(options);
    HostTensor<float> x(4, kF32);
    AllReduce(x);
  });
  RunRanks(1, [](const RankContext& ctx) {
    CommOptions options;
    options.master_port = ctx.port;
    options.timeout = seconds(30);
    options.socket_ifname = "cai-nosuch0";
    try {
      Communicator::Init(options);
      ADD_FAILURE() << "Init bound to an interface that does not exist";
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), CAI_INVALID_ARGUMENT) << e.what();
      EXPECT_NE(std::string(e.what()).find("network interface 'cai-nosuch0' "
                                           "(launch.socket_ifname) does not exist"),
                std::string::npos)
          << e.what();
      EXPECT_NE(std::string(e.what()).find("lo 127.0.0.1"), std::string::npos) << e.what();
    }
    setenv("GLOO_SOCKET_IFNAME", "cai-nosuch1,lo", 1);
    options.socket_ifname.clear();
    try {
      Communicator::Init(options);
      ADD_FAILURE() << "Init bound to an interface that does not exist";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("'cai-nosuch1' (GLOO_SOCKET_IFNAME)"), std::string::npos)
          << e.what();
    }
  });
}

// LibTorch 1.13's store client sleeps a second after each refused connection; a rank that asks
// before rank 0 listens (the usual order at a job's start) must not lose that second.
TEST(Store, ClientStartedBeforeTheServer_ConnectsAsSoonAsItListens) {
  const launch::PortReservation port("127.0.0.1");
  Clock::time_point served, connected;
  std::thread client([&] {
    comm::Store store("127.0.0.1", port.port(), /*is_server=*/false, seconds(10));
    connected = Clock::now();
    store.SetString("k", "v");
  });
  std::this_thread::sleep_for(milliseconds(300));
  served = Clock::now();
  comm::Store server("127.0.0.1", port.port(), /*is_server=*/true, seconds(10));
  client.join();
  // The client's set returns once sent; the server may not have handled it yet.
  server.wait({"k"}, seconds(10));
  EXPECT_EQ(server.TryGet("k").value_or(""), "v");
  // LibTorch's own retry comes ~0.7 s after the server starts here; a loaded 2-core machine
  // still wakes a 10 ms sleeper well within 0.5 s.
  EXPECT_LT(connected - served, milliseconds(500));
}

TEST(Store, ClientWithNoServer_FailsAfterItsTimeoutNamingTheAddress) {
  const launch::PortReservation port("127.0.0.1");
  const auto start = Clock::now();
  try {
    comm::Store store("127.0.0.1", port.port(), /*is_server=*/false, milliseconds(400));
    ADD_FAILURE() << "a client reached a store nobody serves";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), CAI_UNAVAILABLE);
    const std::string address = "127.0.0.1:" + std::to_string(port.port());
    EXPECT_NE(std::string(e.what()).find("cannot reach the rendezvous store at " + address),
              std::string::npos)
        << e.what();
    EXPECT_NE(std::string(e.what()).find("is rank 0 running"), std::string::npos) << e.what();
  }
  EXPECT_GE(Clock::now() - start, milliseconds(400));
}

// A rank's heartbeat thread sleeps in poll() between beats; leaving must not wait for the next.
TEST(CommLiveness, Leave_ReturnsWithoutWaitingForTheNextBeat) {
  const launch::PortReservation port("127.0.0.1");
  comm::Store store("127.0.0.1", port.port(), /*is_server=*/true, seconds(10));
  comm::LivenessOptions options;
  options.world_size = 2;
  options.interval = seconds(5);
  options.limit = seconds(30);
  options.bind_address = "127.0.0.1";
  std::vector<std::unique_ptr<comm::Liveness>> ranks;
  for (int r = 0; r < 2; ++r) {
    options.rank = r;
    ranks.push_back(std::make_unique<comm::Liveness>(
        store, options, [] { return std::string("idle"); }, [](const std::string&) {}));
  }
  for (auto& r : ranks) r->Start(store);
  std::this_thread::sleep_for(milliseconds(100));
  const auto start = Clock::now();
  for (auto& r : ranks) r->Leave();
  EXPECT_LT(Clock::now() - start, milliseconds(1000));
}

}  // namespace
}  // namespace cai::test
