// Wire bytes (Communicator::WireBytes: what this rank's sockets sent, from the kernel's TCP
// counters) of every operation at 3 MiB on 2 and 3 ranks, against what its algorithm sends per
// rank (gloo_ops.cpp and Gloo's sources): the measurement that catches a reduce-scatter done
// as an all-reduce, which the bytes handed to it cannot.
#include <cstdio>

#include "comm_test_util.h"

namespace cai::test {
namespace {

using std::chrono::milliseconds;
constexpr milliseconds kTimeout{30000};

// 3 MiB: 1/n chunks and Gloo's ring segments divide it evenly on 2 and 3 ranks, so every
// rank's algorithmic cost is exact, and Gloo's segments stay at most 1 MiB.
constexpr size_t kBytes = size_t{3} << 20;
constexpr size_t kFloats = kBytes / sizeof(float);

// Gloo frames each message on the wire: the sender writes a 48-byte preamble announcing it
// and one before its data, the receiver one saying it is ready (tcp/pair.cc). An operation
// here sends at most a few dozen messages; 4 KiB (0.13% of kBytes) bounds their framing.
constexpr uint64_t kFraming = 4096;

uint64_t Wire(cai_comm_op op, const cai_comm_group* group = nullptr) {
  return Communicator::Get()->WireBytes(group).bytes[op];
}

uint64_t Handed(cai_comm_op op) {
  cai_comm_counters c{};
  c.struct_size = CAI_COMM_COUNTERS_STRUCT_SIZE;
  EXPECT_EQ(Take(CommApi()->counters(nullptr, &c)).code, CAI_OK);
  return c.bytes[op];
}

// gloo::broadcast's binomial tree (broadcast.cc): the copies of the tensor `rank` sends. With
// the root as virtual rank 0, in the round of bit b every virtual rank below b that has the
// tensor sends it to virtual rank + b.
uint64_t BroadcastCopiesSent(int n, int rank, int root) {
  const int vrank = (rank - root + n) % n;
  uint64_t copies = 0;
  for (int bit = 1; bit < n; bit <<= 1) {
    if (vrank < bit && vrank + bit < n) ++copies;
  }
  return copies;
}

// What each operation's algorithm sends from `rank` for a buffer of `bytes` (the in-place
// tensor, reduce_scatter's input, all_gather's output, all_to_all's input), root 0.
uint64_t AlgorithmBytes(cai_comm_op op, int n, int rank, uint64_t bytes) {
  switch (op) {
    case CAI_COMM_ALL_REDUCE:  // ring: reduce-scatter, then all-gather
      return 2 * (n - 1) * bytes / n;
    case CAI_COMM_REDUCE_SCATTER:  // our ring: n-1 steps of one chunk
    case CAI_COMM_ALL_GATHER:      // ring: n-1 steps of one chunk
    case CAI_COMM_ALL_TO_ALL:      // pairwise: every chunk but our own
      return (n - 1) * bytes / n;
    case CAI_COMM_BROADCAST:
      return BroadcastCopiesSent(n, rank, 0) * bytes;
    case CAI_COMM_REDUCE:
      // gloo::reduce: a ring reduce-scatter, (n-1)/n of the tensor while it is at most 2n
      // of Gloo's 1 MiB segments (beyond, its pipeline sends segments - 2 of them), then every
      // rank but the root sends its reduced 1/n to the root.
      return (n - 1) * bytes / n + (rank == 0 ? 0 : bytes / n);
    default:
      return 0;
  }
}

void ExpectWire(const RankContext& ctx, cai_comm_op op, uint64_t expected) {
  const uint64_t wire = Wire(op);
  std::printf("wire bytes: %d ranks, rank %d, %-14s handed %9llu wire %9llu algorithm %9llu\n",
              ctx.world_size, ctx.rank, CommOpName(op), static_cast<unsigned long long>(Handed(op)),
              static_cast<unsigned long long>(wire), static_cast<unsigned long long>(expected));
  EXPECT_GE(wire, expected) << CommOpName(op) << " on rank " << ctx.rank;
  EXPECT_LE(wire, expected + kFraming) << CommOpName(op) << " on rank " << ctx.rank;
}

TEST(Comm, Comm_TwoAndThreeRanks_WireBytesOfEachOp_MatchItsAlgorithm) {
  for (int world : {2, 3}) {
    RunRanks(world, [](const RankContext& ctx) {
      InitRank(ctx, kTimeout);
      const int n = ctx.world_size;
      HostTensor<float> whole(kFloats, kF32), other(kFloats, kF32), chunk(kFloats / n, kF32);
      for (size_t i = 0; i < kFloats; ++i) whole.data[i] = static_cast<float>(i % 7);
      const auto check = [&](cai_comm_args args) {
        CommApi()->reset_counters();
        RunOp(args);
        ExpectWire(ctx, args.op, AlgorithmBytes(args.op, n, ctx.rank, kBytes));
      };
      check(Args(CAI_COMM_ALL_REDUCE, nullptr, &whole.t));
      check(Args(CAI_COMM_REDUCE_SCATTER, &whole.t, &chunk.t));
      check(Args(CAI_COMM_ALL_GATHER, &chunk.t, &whole.t));
      check(Args(CAI_COMM_BROADCAST, nullptr, &whole.t));
      check(Args(CAI_COMM_REDUCE, nullptr, &whole.t));
      check(Args(CAI_COMM_ALL_TO_ALL, &whole.t, &other.t));
      check(Args(CAI_COMM_BARRIER, nullptr, nullptr));

      // Around the ring: each rank sends the tensor right and receives one from the left. The
      // data is the send's; the recv sends only its ready notification.
      CommApi()->reset_counters();
      cai_comm_args send = Args(CAI_COMM_SEND, &whole.t, nullptr);
      send.peer = (ctx.rank + 1) % n;
      send.async = true;
      cai_comm_work* work = nullptr;
      CAI_EXPECT_OK(CommApi()->run(&send, &work));
      cai_comm_args recv = Args(CAI_COMM_RECV, nullptr, &other.t);
      recv.peer = (ctx.rank + n - 1) % n;
      RunOp(recv);
      CAI_EXPECT_OK(CommApi()->work_wait(work, 0));
      CommApi()->work_release(work);
      EXPECT_GE(Wire(CAI_COMM_SEND), kBytes);
      EXPECT_LE(Wire(CAI_COMM_SEND) + Wire(CAI_COMM_RECV), kBytes + kFraming);

      // Per group: a pair's all-reduce counts on the pair and in the totals, not on the world.
      const int32_t pair[] = {0, 1};
      cai_comm_group* g = nullptr;
      CAI_EXPECT_OK(CommApi()->new_group(pair, 2, &g));
      CommApi()->reset_counters();
      if (g != nullptr) {
        cai_comm_args in_pair = Args(CAI_COMM_ALL_REDUCE, nullptr, &whole.t);
        in_pair.group = g;
        RunOp(in_pair);
        EXPECT_GE(Wire(CAI_COMM_ALL_REDUCE, g), kBytes);  // 2(n-1)/n with n = 2
        EXPECT_LE(Wire(CAI_COMM_ALL_REDUCE, g), kBytes + kFraming);
        EXPECT_EQ(Wire(CAI_COMM_ALL_REDUCE), Wire(CAI_COMM_ALL_REDUCE, g));
      }
      EXPECT_EQ(Wire(CAI_COMM_ALL_REDUCE, CommApi()->world()), 0u);
      CommApi()->destroy_group(g);
      RunOp(Args(CAI_COMM_BARRIER, nullptr, nullptr));
    });
  }
}

// The control: an all-reduce of the bytes a reduce-scatter is handed puts twice its bytes on
// the wire, 2(n-1)/n against (n-1)/n. A reduce-scatter implemented as an all-reduce (which
// c10d's ProcessGroupGloo would force) would therefore fail the test above and this one.
TEST(Comm, Comm_TwoAndThreeRanks_AllReduceOfSameBytes_SendsTwiceTheReduceScatter) {
  for (int world : {2, 3}) {
    RunRanks(world, [](const RankContext& ctx) {
      InitRank(ctx, kTimeout);
      HostTensor<float> grad(kFloats, kF32), shard(kFloats / ctx.world_size, kF32);
      CommApi()->reset_counters();
      RunOp(Args(CAI_COMM_REDUCE_SCATTER, &grad.t, &shard.t));
      RunOp(Args(CAI_COMM_ALL_REDUCE, nullptr, &grad.t));
      EXPECT_EQ(Handed(CAI_COMM_REDUCE_SCATTER), Handed(CAI_COMM_ALL_REDUCE));
      const double ratio = static_cast<double>(Wire(CAI_COMM_ALL_REDUCE)) /
                           static_cast<double>(Wire(CAI_COMM_REDUCE_SCATTER));
      EXPECT_NEAR(ratio, 2.0, 0.01) << "rank " << ctx.rank;
    });
  }
}

TEST(Comm, Comm_OneRank_NothingOnTheWire) {
  RunRanks(1, [](const RankContext& ctx) {
    InitRank(ctx, kTimeout);
    HostTensor<float> x(1024, kF32);
    RunOp(Args(CAI_COMM_ALL_REDUCE, nullptr, &x.t));
    const WireCounters wire = Communicator::Get()->WireBytes(nullptr);
    EXPECT_EQ(wire.bytes[CAI_COMM_ALL_REDUCE], 0u);
    EXPECT_EQ(wire.unmeasured_calls[CAI_COMM_ALL_REDUCE], 0u);
  });
}

}  // namespace
}  // namespace cai::test
