// Every collective on 2 and 3 ranks (3: nothing divides evenly) against values computed here.
#include <sys/resource.h>

#include <bit>
#include <cmath>
#include <csignal>
#include <cstring>

#include "comm_test_util.h"

namespace cai::test {
namespace {

using std::chrono::milliseconds;
constexpr milliseconds kTimeout{30000};

const cai_comm_api& Api() { return *CommApi(); }

// Small integers, so that sums, products and averages are exact in every dtype (uint8 too).
double Value(int rank, size_t i) { return 1.0 + static_cast<double>((rank + i) % 3); }

template <class T>
void CheckAllReduce(const RankContext& ctx, cai_dtype dtype, cai_reduce_op op, size_t n) {
  HostTensor<T> x(n, dtype);
  for (size_t i = 0; i < n; ++i) x.data[i] = static_cast<T>(Value(ctx.rank, i));
  cai_comm_args args = Args(CAI_COMM_ALL_REDUCE, nullptr, &x.t);
  args.reduce_op = op;
  RunOp(args);
  for (size_t i = 0; i < n; ++i) {
    double expected = op == CAI_REDUCE_PRODUCT ? 1.0 : 0.0;
    if (op == CAI_REDUCE_MAX) expected = -1e300;
    if (op == CAI_REDUCE_MIN) expected = 1e300;
    for (int r = 0; r < ctx.world_size; ++r) {
      const double v = Value(r, i);
      if (op == CAI_REDUCE_SUM || op == CAI_REDUCE_AVG) expected += v;
      if (op == CAI_REDUCE_PRODUCT) expected *= v;
      if (op == CAI_REDUCE_MAX) expected = std::max(expected, v);
      if (op == CAI_REDUCE_MIN) expected = std::min(expected, v);
    }
    T want = static_cast<T>(expected);
    if (op == CAI_REDUCE_AVG) want = static_cast<T>(static_cast<T>(expected) / ctx.world_size);
    ASSERT_EQ(x.data[i], want) << "dtype bits " << int(dtype.bits) << " op " << op << " i " << i;
  }
}

TEST(Comm, Comm_TwoAndThreeRanks_AllReduceEveryDtypeAndOp_MatchesReference) {
  for (int world : {2, 3}) {
    RunRanks(world, [](const RankContext& ctx) {
      InitRank(ctx, kTimeout);
      for (cai_reduce_op op :
           {CAI_REDUCE_SUM, CAI_REDUCE_AVG, CAI_REDUCE_MAX, CAI_REDUCE_MIN, CAI_REDUCE_PRODUCT}) {
        CheckAllReduce<float>(ctx, kF32, op, 1001);
        CheckAllReduce<double>(ctx, kF64, op, 1001);
        CheckAllReduce<int32_t>(ctx, kI32, op, 1001);
        CheckAllReduce<int64_t>(ctx, kI64, op, 1001);
        CheckAllReduce<uint8_t>(ctx, kU8, op, 1001);
      }
      // Large enough for Gloo's ring to cut each chunk into several segments.
      CheckAllReduce<float>(ctx, kF32, CAI_REDUCE_SUM, 3 * 1000 * 1000 + 1);
    });
  }
}

uint16_t ToBf16(float f) { return static_cast<uint16_t>(std::bit_cast<uint32_t>(f) >> 16); }
float FromBf16(uint16_t b) { return std::bit_cast<float>(static_cast<uint32_t>(b) << 16); }
// Exact for the values used here (multiples of 1/4 below 2048).
uint16_t ToF16(float f) {
  if (f == 0) return 0;
  int e = 0;
  const float m = std::frexp(f, &e);  // f = m * 2^e, m in [0.5, 1)
  return static_cast<uint16_t>(((e - 1 + 15) << 10) |
                               (static_cast<uint32_t>(std::ldexp(m, 11)) & 0x3ff));
}
float FromF16(uint16_t h) {
  const int e = (h >> 10) & 0x1f;
  return h == 0 ? 0.0f : std::ldexp(1.0f + (h & 0x3ff) / 1024.0f, e - 15);
}

TEST(Comm, Comm_TwoAndThreeRanks_AllReduceBf16AndFp16_MatchesFp32Sum) {
  for (int world : {2, 3}) {
    RunRanks(world, [](const RankContext& ctx) {
      InitRank(ctx, kTimeout);
      const size_t n = 1001;
      auto value = [](int r, size_t i) { return 0.25f * static_cast<float>((r * 7 + i) % 64); };
      HostTensor<uint16_t> bf(n, kBF16), hf(n, kF16);
      for (size_t i = 0; i < n; ++i) {
        bf.data[i] = ToBf16(value(ctx.rank, i));
        hf.data[i] = ToF16(value(ctx.rank, i));
      }
      RunOp(Args(CAI_COMM_ALL_REDUCE, nullptr, &bf.t));
      cai_comm_args max = Args(CAI_COMM_ALL_REDUCE, nullptr, &hf.t);
      max.reduce_op = CAI_REDUCE_MAX;
      RunOp(Args(CAI_COMM_ALL_REDUCE, nullptr, &hf.t));
      for (size_t i = 0; i < n; ++i) {
        float sum = 0;
        for (int r = 0; r < ctx.world_size; ++r) sum += value(r, i);
        ASSERT_EQ(FromBf16(bf.data[i]), sum) << i;
        ASSERT_EQ(FromF16(hf.data[i]), sum) << i;
      }
      for (size_t i = 0; i < n; ++i) hf.data[i] = ToF16(value(ctx.rank, i));
      RunOp(max);
      for (size_t i = 0; i < n; ++i) {
        float m = 0;
        for (int r = 0; r < ctx.world_size; ++r) m = std::max(m, value(r, i));
        ASSERT_EQ(FromF16(hf.data[i]), m) << i;
      }
    });
  }
}

void CheckReduceScatter(const RankContext& ctx, size_t chunk, cai_reduce_op op) {
  const size_t n = static_cast<size_t>(ctx.world_size);
  HostTensor<float> in(n * chunk, kF32), out(chunk, kF32);
  for (size_t i = 0; i < n * chunk; ++i) in.data[i] = static_cast<float>(Value(ctx.rank, i));
  const std::vector<float> before = in.data;
  cai_comm_args args = Args(CAI_COMM_REDUCE_SCATTER, &in.t, &out.t);
  args.reduce_op = op;
  RunOp(args);
  for (size_t i = 0; i < chunk; ++i) {
    float sum = 0;
    for (int r = 0; r < ctx.world_size; ++r) {
      sum += static_cast<float>(Value(r, ctx.rank * chunk + i));
    }
    ASSERT_EQ(out.data[i], op == CAI_REDUCE_AVG ? sum / ctx.world_size : sum) << i;
  }
  ASSERT_EQ(in.data, before) << "reduce_scatter modified its input";
}

TEST(Comm, Comm_TwoAndThreeRanks_ReduceScatterUneven_MatchesSum) {
  for (int world : {2, 3}) {
    RunRanks(world, [](const RankContext& ctx) {
      InitRank(ctx, kTimeout);
      CheckReduceScatter(ctx, 17, CAI_REDUCE_SUM);
      CheckReduceScatter(ctx, 17, CAI_REDUCE_AVG);
      CheckReduceScatter(ctx, 1, CAI_REDUCE_SUM);
      // Chunks of several 1 MiB segments, the last one partial.
      CheckReduceScatter(ctx, 700001, CAI_REDUCE_SUM);
    });
  }
}

void CheckAllGather(const RankContext& ctx, size_t n) {
  HostTensor<int64_t> in(n, kI64), out(n * ctx.world_size, kI64);
  for (size_t i = 0; i < n; ++i) in.data[i] = ctx.rank * 1000000 + static_cast<int64_t>(i);
  RunOp(Args(CAI_COMM_ALL_GATHER, &in.t, &out.t));
  for (int r = 0; r < ctx.world_size; ++r) {
    for (size_t i = 0; i < n; ++i) {
      ASSERT_EQ(out.data[r * n + i], r * 1000000 + static_cast<int64_t>(i));
    }
  }
}

// ZeRO's re-gather: each rank's input is its own chunk of the output buffer (NCCL's in-place
// form), which must neither be copied onto itself nor disturb the other chunks' arrival.
void CheckAllGatherInPlace(const RankContext& ctx, size_t n) {
  HostTensor<float> out(n * ctx.world_size, kF32);
  for (size_t i = 0; i < n; ++i) {
    out.data[ctx.rank * n + i] = static_cast<float>(ctx.rank * 1000000 + i % 1000);
  }
  cai_tensor in = out.t;
  int64_t chunk = static_cast<int64_t>(n);
  in.data = out.data.data() + ctx.rank * n;
  in.shape = &chunk;
  RunOp(Args(CAI_COMM_ALL_GATHER, &in, &out.t));
  for (int r = 0; r < ctx.world_size; ++r) {
    for (size_t i = 0; i < n; ++i) {
      ASSERT_EQ(out.data[r * n + i], static_cast<float>(r * 1000000 + i % 1000));
    }
  }
}

TEST(Comm, Comm_TwoAndThreeRanks_AllGatherUneven_ConcatenatesInRankOrder) {
  for (int world : {2, 3}) {
    RunRanks(world, [](const RankContext& ctx) {
      InitRank(ctx, kTimeout);
      for (size_t n : {size_t{1}, size_t{1001}, size_t{400003}}) CheckAllGather(ctx, n);
    });
  }
}

TEST(Comm, Comm_TwoAndThreeRanks_AllGatherInPlace_ConcatenatesInRankOrder) {
  for (int world : {2, 3}) {
    RunRanks(world, [](const RankContext& ctx) {
      InitRank(ctx, kTimeout);
      for (size_t n : {size_t{1}, size_t{1001}, size_t{400003}}) CheckAllGatherInPlace(ctx, n);
    });
  }
}

// Large collectives through shared memory (comm/shm_ring.h: segments of 256 KiB, eight slots
// per outbox) and, with the shared memory turned off, over TCP split over the lanes
// (comm::RunCollective), each lane moving an uneven share of every chunk on connections of its
// own: all give the same values at sizes that do not divide by the slots, the lanes, the ranks
// or Gloo's 1 MiB segments.
TEST(Comm,
     Comm_TwoAndThreeRanks_LargeOpsThroughSharedMemoryAndOverOneAndThreeLanes_MatchReference) {
  struct Transport {
    bool shared_memory;
    int lanes;
  };
  for (int world : {2, 3}) {
    for (const Transport t : {Transport{true, 2}, Transport{false, 1}, Transport{false, 3}}) {
      RunRanks(world, [t](const RankContext& ctx) {
        InitRank(ctx, kTimeout, t.lanes, t.shared_memory);
        ASSERT_EQ(Communicator::Get()->SharedMemory(nullptr), t.shared_memory);
        CheckAllReduce<float>(ctx, kF32, CAI_REDUCE_AVG, 786433);
        CheckAllReduce<int32_t>(ctx, kI32, CAI_REDUCE_MAX, 1048577);
        CheckAllReduce<double>(ctx, kF64, CAI_REDUCE_SUM, 2);  // 3 ranks: an empty chunk
        CheckReduceScatter(ctx, 700001, CAI_REDUCE_AVG);
        CheckReduceScatter(ctx, 400003, CAI_REDUCE_SUM);
        CheckAllGather(ctx, 400003);
        CheckAllGatherInPlace(ctx, 786433);
      });
    }
  }
}

// One rank that cannot reserve its outbox (here: a file size limit below the outbox's 2 MiB,
// as a full /dev/shm would) keeps every rank of the group on TCP, each naming why, and the
// collectives still give the right values.
TEST(Comm, Comm_TwoAndThreeRanks_OneRankWithoutSharedMemory_AllFallBackToTcp) {
  for (int world : {2, 3}) {
    RunRanks(world, [](const RankContext& ctx) {
      if (ctx.rank == 1) {
        std::signal(SIGXFSZ, SIG_IGN);  // posix_fallocate then fails with EFBIG
        const rlimit limit{size_t{1} << 20, size_t{1} << 20};
        ASSERT_EQ(setrlimit(RLIMIT_FSIZE, &limit), 0);
      }
      InitRank(ctx, kTimeout);
      EXPECT_FALSE(Communicator::Get()->SharedMemory(nullptr));
      const std::string info = Api().backend_info(nullptr);
      // The others learn it from the exchange, as "... could not create its outbox" (rank 1's
      // right neighbour) or "... could not create its outbox or map its neighbour's".
      const std::string why = ctx.rank == 1
                                  ? "not through shared memory (reserving 2101248 B in /dev/shm: "
                                    "File too large): all_reduce=gloo::allreduce ring"
                                  : "not through shared memory (rank 1 could not create its outbox";
      EXPECT_NE(info.find(why), std::string::npos) << info;
      CheckAllReduce<float>(ctx, kF32, CAI_REDUCE_SUM, 1001);
      CheckReduceScatter(ctx, 17, CAI_REDUCE_SUM);
      CheckAllGather(ctx, 1001);
    });
  }
}

// Which transport a group's ring collectives take is the one backend_info names.
TEST(Comm, Comm_TwoRanks_BackendInfo_NamesTheTransport) {
  for (bool shared_memory : {true, false}) {
    RunRanks(2, [shared_memory](const RankContext& ctx) {
      InitRank(ctx, kTimeout, CommOptions{}.lanes, shared_memory);
      const std::string info = Api().backend_info(nullptr);
      EXPECT_EQ(info.find("reduce_scatter=ring through shared memory") != std::string::npos,
                shared_memory)
          << info;
      EXPECT_EQ(info.find("not through shared memory (launch.comm_transport = \"tcp\")") !=
                    std::string::npos,
                !shared_memory)
          << info;
      const int32_t both[] = {0, 1};
      cai_comm_group* g = nullptr;
      CAI_EXPECT_OK(Api().new_group(both, 2, &g));
      EXPECT_EQ(Communicator::Get()->SharedMemory(g), shared_memory);
      Api().destroy_group(g);
    });
  }
}

TEST(Comm, Comm_TwoAndThreeRanks_BroadcastFromEveryRoot_CopiesRootTensor) {
  for (int world : {2, 3}) {
    RunRanks(world, [](const RankContext& ctx) {
      InitRank(ctx, kTimeout);
      for (int root = 0; root < ctx.world_size; ++root) {
        HostTensor<double> x(1001, kF64);
        for (size_t i = 0; i < 1001; ++i) x.data[i] = ctx.rank * 10.0 + i;
        cai_comm_args args = Args(CAI_COMM_BROADCAST, nullptr, &x.t);
        args.root = root;
        RunOp(args);
        for (size_t i = 0; i < 1001; ++i) ASSERT_EQ(x.data[i], root * 10.0 + i);
      }
    });
  }
}

TEST(Comm, Comm_TwoAndThreeRanks_ReduceToEveryRoot_SumsOnRoot) {
  for (int world : {2, 3}) {
    RunRanks(world, [](const RankContext& ctx) {
      InitRank(ctx, kTimeout);
      for (int root = 0; root < ctx.world_size; ++root) {
        HostTensor<int32_t> x(1001, kI32);
        for (size_t i = 0; i < 1001; ++i) x.data[i] = static_cast<int32_t>(Value(ctx.rank, i));
        cai_comm_args args = Args(CAI_COMM_REDUCE, nullptr, &x.t);
        args.root = root;
        RunOp(args);
        if (ctx.rank != root) continue;
        for (size_t i = 0; i < 1001; ++i) {
          int32_t sum = 0;
          for (int r = 0; r < ctx.world_size; ++r) sum += static_cast<int32_t>(Value(r, i));
          ASSERT_EQ(x.data[i], sum) << i;
        }
      }
    });
  }
}

TEST(Comm, Comm_TwoAndThreeRanks_AllToAll_DeliversChunkJToRankJ) {
  for (int world : {2, 3}) {
    RunRanks(world, [](const RankContext& ctx) {
      InitRank(ctx, kTimeout);
      const size_t chunk = 333;
      const size_t n = chunk * ctx.world_size;
      HostTensor<float> in(n, kF32), out(n, kF32);
      // Element k of chunk j on rank i is 1000*i + 100*j + k%100.
      for (size_t i = 0; i < n; ++i) {
        in.data[i] = 1000.0f * ctx.rank + 100.0f * (i / chunk) + (i % chunk) % 100;
      }
      RunOp(Args(CAI_COMM_ALL_TO_ALL, &in.t, &out.t));
      for (size_t i = 0; i < n; ++i) {
        ASSERT_EQ(out.data[i], 1000.0f * (i / chunk) + 100.0f * ctx.rank + (i % chunk) % 100);
      }
    });
  }
}

TEST(Comm, Comm_TwoAndThreeRanks_SendRecvAroundRing_DeliversLeftNeighbourData) {
  for (int world : {2, 3}) {
    RunRanks(world, [](const RankContext& ctx) {
      InitRank(ctx, kTimeout);
      const int right = (ctx.rank + 1) % ctx.world_size;
      const int left = (ctx.rank + ctx.world_size - 1) % ctx.world_size;
      for (int tag : {0, 7}) {
        HostTensor<int32_t> out(50001, kI32), in(50001, kI32);
        for (size_t i = 0; i < 50001; ++i) out.data[i] = ctx.rank * 100000 + tag + int(i);
        cai_comm_args send = Args(CAI_COMM_SEND, &out.t, nullptr);
        send.peer = right;
        send.tag = tag;
        send.async = true;
        cai_comm_work* work = nullptr;
        CAI_EXPECT_OK(Api().run(&send, &work));
        cai_comm_args recv = Args(CAI_COMM_RECV, nullptr, &in.t);
        recv.peer = left;
        recv.tag = tag;
        RunOp(recv);
        CAI_EXPECT_OK(Api().work_wait(work, 0));
        EXPECT_TRUE(Api().work_is_completed(work));
        Api().work_release(work);
        for (size_t i = 0; i < 50001; ++i) ASSERT_EQ(in.data[i], left * 100000 + tag + int(i));
      }
    });
  }
}

TEST(Comm, Comm_TwoAndThreeRanks_SubGroups_ReduceAmongMembersOnly) {
  for (int world : {2, 3}) {
    RunRanks(world, [](const RankContext& ctx) {
      InitRank(ctx, kTimeout);
      // {last, 0}: listed out of order, so group rank 0 is the last world rank.
      const int32_t pair[] = {ctx.world_size - 1, 0};
      const int32_t solo[] = {1};
      cai_comm_group* g = nullptr;
      cai_comm_group* s = nullptr;
      CAI_EXPECT_OK(Api().new_group(pair, 2, &g));
      CAI_EXPECT_OK(Api().new_group(solo, 1, &s));
      const bool in_pair = ctx.rank == 0 || ctx.rank == ctx.world_size - 1;
      ASSERT_EQ(g != nullptr, in_pair);
      ASSERT_EQ(s != nullptr, ctx.rank == 1);
      if (g != nullptr) {
        EXPECT_EQ(Api().size(g), 2);
        EXPECT_EQ(Api().rank(g), ctx.rank == 0 ? 1 : 0);
        HostTensor<float> x(1001, kF32);
        for (auto& v : x.data) v = static_cast<float>(ctx.rank + 1);
        cai_comm_args args = Args(CAI_COMM_ALL_REDUCE, nullptr, &x.t);
        args.group = g;
        RunOp(args);
        for (float v : x.data) ASSERT_EQ(v, 1.0f + ctx.world_size);
        cai_comm_counters c{};
        c.struct_size = CAI_COMM_COUNTERS_STRUCT_SIZE;
        CAI_EXPECT_OK(Api().counters(g, &c));
        EXPECT_EQ(c.calls[CAI_COMM_ALL_REDUCE], 1u);
        EXPECT_EQ(c.bytes[CAI_COMM_ALL_REDUCE], 1001u * 4);
      }
      if (s != nullptr) {
        HostTensor<float> x(5, kF32);
        for (auto& v : x.data) v = 3.0f;
        cai_comm_args args = Args(CAI_COMM_ALL_REDUCE, nullptr, &x.t);
        args.group = s;
        RunOp(args);
        for (float v : x.data) ASSERT_EQ(v, 3.0f);
      }
      Api().destroy_group(g);
      Api().destroy_group(s);
      Api().destroy_group(Api().world());  // ignored, as comm.h says
      RunOp(Args(CAI_COMM_BARRIER, nullptr, nullptr));
    });
  }
}

TEST(Comm, Comm_TwoAndThreeRanks_AsyncOpsInFlight_CompleteInIssueOrderWithCorrectValues) {
  for (int world : {2, 3}) {
    RunRanks(world, [](const RankContext& ctx) {
      InitRank(ctx, kTimeout);
      constexpr int kOps = 4;
      const size_t n = 1 << 20;
      std::vector<std::unique_ptr<HostTensor<float>>> xs;
      std::vector<cai_comm_work*> works;
      for (int k = 0; k < kOps; ++k) {
        xs.push_back(std::make_unique<HostTensor<float>>(n, kF32));
        for (auto& v : xs.back()->data) v = static_cast<float>(k + ctx.rank);
        cai_comm_args args = Args(CAI_COMM_ALL_REDUCE, nullptr, &xs.back()->t);
        args.async = true;
        cai_comm_work* w = nullptr;
        CAI_EXPECT_OK(Api().run(&args, &w));
        works.push_back(w);
      }
      // Compute on the caller's thread while the group's worker communicates.
      double acc = 0;
      for (int i = 0; i < 1000000; ++i) acc += std::sqrt(static_cast<double>(i));
      EXPECT_GT(acc, 0);
      // Waiting for the last one implies the earlier ones ran: one worker, issue order.
      CAI_EXPECT_OK(Api().work_wait(works.back(), 0));
      for (int k = 0; k < kOps; ++k) EXPECT_TRUE(Api().work_is_completed(works[k])) << k;
      for (int k = 0; k < kOps; ++k) {
        CAI_EXPECT_OK(Api().work_wait(works[k], 0));
        Api().work_release(works[k]);
        const float want =
            static_cast<float>(ctx.world_size * k + ctx.world_size * (ctx.world_size - 1) / 2);
        for (float v : xs[k]->data) ASSERT_EQ(v, want) << k;
      }
    });
  }
}

TEST(Comm, Comm_TwoAndThreeRanks_Counters_CountBytesHandedToEachOp) {
  for (int world : {2, 3}) {
    RunRanks(world, [](const RankContext& ctx) {
      InitRank(ctx, kTimeout);
      Api().reset_counters();
      const size_t n = static_cast<size_t>(ctx.world_size);
      const size_t psi = 1000 * n;  // parameters; fp32, so the flat gradient is 4 psi bytes
      HostTensor<float> grad(psi, kF32), shard(psi / n, kF32), params(psi, kF32);
      RunOp(Args(CAI_COMM_REDUCE_SCATTER, &grad.t, &shard.t));
      RunOp(Args(CAI_COMM_ALL_GATHER, &shard.t, &params.t));
      RunOp(Args(CAI_COMM_ALL_REDUCE, nullptr, &grad.t));
      RunOp(Args(CAI_COMM_ALL_REDUCE, nullptr, &grad.t));
      RunOp(Args(CAI_COMM_BARRIER, nullptr, nullptr));
      cai_comm_counters c{};
      c.struct_size = CAI_COMM_COUNTERS_STRUCT_SIZE;
      CAI_EXPECT_OK(Api().counters(nullptr, &c));
      EXPECT_EQ(c.bytes[CAI_COMM_REDUCE_SCATTER], 4 * psi);
      EXPECT_EQ(c.bytes[CAI_COMM_ALL_GATHER], 4 * psi / n);
      EXPECT_EQ(c.bytes[CAI_COMM_ALL_REDUCE], 2 * 4 * psi);
      EXPECT_EQ(c.bytes[CAI_COMM_BARRIER], 0u);
      EXPECT_EQ(c.calls[CAI_COMM_REDUCE_SCATTER], 1u);
      EXPECT_EQ(c.calls[CAI_COMM_ALL_REDUCE], 2u);
      EXPECT_EQ(c.calls[CAI_COMM_BARRIER], 1u);
      EXPECT_EQ(c.calls[CAI_COMM_BROADCAST], 0u);
      cai_comm_counters w{};
      w.struct_size = CAI_COMM_COUNTERS_STRUCT_SIZE;
      CAI_EXPECT_OK(Api().counters(Api().world(), &w));
      EXPECT_EQ(w.bytes[CAI_COMM_REDUCE_SCATTER], 4 * psi);
      Api().reset_counters();
      CAI_EXPECT_OK(Api().counters(nullptr, &c));
      EXPECT_EQ(c.calls[CAI_COMM_ALL_REDUCE], 0u);
    });
  }
}

TEST(Comm, Comm_OneRank_CollectivesAreLocal) {
  RunRanks(1, [](const RankContext& ctx) {
    InitRank(ctx, kTimeout);
    HostTensor<float> in(8, kF32), out(8, kF32);
    for (size_t i = 0; i < 8; ++i) in.data[i] = static_cast<float>(i);
    RunOp(Args(CAI_COMM_REDUCE_SCATTER, &in.t, &out.t));
    EXPECT_EQ(out.data, in.data);
    RunOp(Args(CAI_COMM_ALL_REDUCE, nullptr, &out.t));
    EXPECT_EQ(out.data, in.data);
    HostTensor<float> g(8, kF32);
    RunOp(Args(CAI_COMM_ALL_GATHER, &in.t, &g.t));
    EXPECT_EQ(g.data, in.data);
    RunOp(Args(CAI_COMM_BARRIER, nullptr, nullptr));
  });
}

}  // namespace
}  // namespace cai::test
