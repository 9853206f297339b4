// Failures: timeouts that name the operation, group and missing rank; argument validation.
#include "comm_test_util.h"

namespace cai::test {
namespace {

using std::chrono::milliseconds;
using std::chrono::steady_clock;

const cai_comm_api& Api() { return *CommApi(); }

TEST(Comm, Comm_TwoAndThreeRanks_CollectiveWithAbsentRank_TimesOutNamingRankAndOp) {
  for (int world : {2, 3}) {
    RunRanks(world, [](const RankContext& ctx) {
      InitRank(ctx, milliseconds(20000));
      const int absent = ctx.world_size - 1;
      if (ctx.rank == absent) {
        // Alive but never joins the all-reduce; leaves after the others have given up.
        std::this_thread::sleep_for(milliseconds(8000));
        return;
      }
      HostTensor<float> x(1001, kF32);
      cai_comm_args args = Args(CAI_COMM_ALL_REDUCE, nullptr, &x.t);
      args.timeout_ms = 1500;
      const auto start = steady_clock::now();
      Outcome o = Take(Api().run(&args, nullptr));
      const auto took = steady_clock::now() - start;
      EXPECT_EQ(o.code, CAI_DEADLINE_EXCEEDED) << o.message;
      // The bound leaves room for a loaded 2-core machine, yet sits well before the absent
      // rank leaves (8 s), so only the timeout can have ended the wait.
      EXPECT_LT(took, milliseconds(1500 + 5000)) << o.message;
      EXPECT_GE(took, milliseconds(1400)) << o.message;
      EXPECT_NE(o.message.find("all_reduce #1 on group 'world'"), std::string::npos) << o.message;
      EXPECT_NE(o.message.find("(rank " + std::to_string(ctx.rank) + " of"), std::string::npos)
          << o.message;
      EXPECT_NE(
          o.message.find("rank " + std::to_string(absent) + " has not started any collective"),
          std::string::npos)
          << o.message;
      // The group is now unusable; later operations fail at once instead of hanging.
      Outcome next = Take(Api().run(&args, nullptr));
      EXPECT_EQ(next.code, CAI_FAILED_PRECONDITION) << next.message;
      // Rank 0 serves the store the other ranks read progress from: it stays until they have
      // read it (a rank timing out a moment later on a loaded machine).
      if (ctx.rank == 0) std::this_thread::sleep_for(milliseconds(4000));
    });
  }
}

TEST(Comm, Comm_TwoRanks_RecvWithoutSender_TimesOutNamingPeer) {
  RunRanks(2, [](const RankContext& ctx) {
    InitRank(ctx, milliseconds(20000));
    if (ctx.rank == 1) {
      std::this_thread::sleep_for(milliseconds(2500));
      return;
    }
    HostTensor<int32_t> x(10, kI32);
    cai_comm_args args = Args(CAI_COMM_RECV, nullptr, &x.t);
    args.peer = 1;
    args.tag = 3;
    args.timeout_ms = 800;
    Outcome o = Take(Api().run(&args, nullptr));
    EXPECT_EQ(o.code, CAI_DEADLINE_EXCEEDED) << o.message;
    EXPECT_NE(o.message.find("recv from rank 1 (tag 3) on group 'world' (rank 0 of 2)"),
              std::string::npos)
        << o.message;
    EXPECT_NE(o.message.find("rank 1 did not post the matching send"), std::string::npos)
        << o.message;
  });
}

TEST(Comm, Comm_ThreeRanks_RendezvousWithRankMissing_NamesIt) {
  RunRanks(3,
           [](const RankContext& ctx) {
             // Rank 0 serves the store, so its report is the one that cannot race the store's
             // shutdown; rank 1 must fail too, however its store connection ends.
             try {
               InitRank(ctx, milliseconds(1500));
               ADD_FAILURE() << "init succeeded without rank 2";
             } catch (const Error& e) {
               if (ctx.rank == 0) {
                 EXPECT_EQ(e.code(), CAI_DEADLINE_EXCEEDED) << e.what();
                 EXPECT_NE(std::string(e.what()).find("rank 2 did not join"), std::string::npos)
                     << e.what();
               }
             } catch (const std::exception& e) {
               EXPECT_NE(ctx.rank, 0) << e.what();
             }
             EXPECT_EQ(Communicator::Get(), nullptr);
           },
           {0, 1});
}

TEST(Comm, Comm_NotInitialised_ApiFailsWithFailedPrecondition) {
  ASSERT_EQ(Communicator::Get(), nullptr);
  const cai_comm_api& api = Api();
  EXPECT_EQ(api.struct_size, CAI_COMM_API_STRUCT_SIZE);
  EXPECT_EQ(api.world(), nullptr);
  EXPECT_EQ(api.rank(nullptr), -1);
  cai_comm_args args = Args(CAI_COMM_BARRIER, nullptr, nullptr);
  Outcome o = Take(api.run(&args, nullptr));
  EXPECT_EQ(o.code, CAI_FAILED_PRECONDITION);
  EXPECT_NE(o.message.find("not initialised"), std::string::npos) << o.message;
  api.work_release(nullptr);
  api.destroy_group(nullptr);
}

// One scenario per bad argument: the expected code and a phrase the message must contain.
TEST(Comm, Comm_TwoRanks_InvalidArguments_RejectedWithClearMessages) {
  RunRanks(2, [](const RankContext& ctx) {
    InitRank(ctx, milliseconds(20000));
    HostTensor<float> a(6, kF32), b(3, kF32), c(4, kF32);
    HostTensor<int32_t> i32(3, kI32);
    HostTensor<uint16_t> bool_like(3, cai_dtype{CAI_DTYPE_BOOL, 8, 1});
    auto expect = [&](cai_comm_args args, cai_status_code code, const std::string& phrase) {
      cai_comm_work* work = reinterpret_cast<cai_comm_work*>(0x1);
      Outcome o = Take(Api().run(&args, &work));
      EXPECT_EQ(o.code, code) << o.message;
      EXPECT_NE(o.message.find(phrase), std::string::npos) << o.message;
      EXPECT_EQ(work, reinterpret_cast<cai_comm_work*>(0x1)) << "out-parameter touched";
    };
    cai_comm_args small = Args(CAI_COMM_ALL_REDUCE, nullptr, &a.t);
    small.struct_size = offsetof(cai_comm_args, output);
    expect(small, CAI_INVALID_ARGUMENT, "struct_size");
    expect(Args(CAI_COMM_ALL_REDUCE, nullptr, nullptr), CAI_INVALID_ARGUMENT,
           "all_reduce on group 'world': output is NULL");
    expect(Args(CAI_COMM_REDUCE_SCATTER, &a.t, &c.t), CAI_INVALID_ARGUMENT,
           "input has 6 elements, expected group size 2 x output's 4");
    expect(Args(CAI_COMM_ALL_GATHER, &b.t, &c.t), CAI_INVALID_ARGUMENT,
           "output has 4 elements, expected group size 2 x input's 3");
    expect(Args(CAI_COMM_ALL_GATHER, &i32.t, &a.t), CAI_INVALID_ARGUMENT,
           "input is int32 but output is float32");
    expect(Args(CAI_COMM_ALL_TO_ALL, &b.t, &b.t), CAI_INVALID_ARGUMENT, "divisible");
    expect(Args(CAI_COMM_ALL_REDUCE, nullptr, &bool_like.t), CAI_INVALID_ARGUMENT, "dtype");
    cai_comm_args root = Args(CAI_COMM_BROADCAST, nullptr, &a.t);
    root.root = 2;
    expect(root, CAI_INVALID_ARGUMENT, "root 2 is not a rank");
    cai_comm_args self = Args(CAI_COMM_SEND, &a.t, nullptr);
    self.peer = ctx.rank;
    expect(self, CAI_INVALID_ARGUMENT, "is not another rank");
    cai_comm_args redop = Args(CAI_COMM_ALL_REDUCE, nullptr, &a.t);
    redop.reduce_op = 9;
    expect(redop, CAI_INVALID_ARGUMENT, "unknown cai_reduce_op 9");
    cai_comm_args op = Args(42, nullptr, &a.t);
    expect(op, CAI_INVALID_ARGUMENT, "unknown cai_comm_op 42");
    cai_comm_args async = Args(CAI_COMM_BARRIER, nullptr, nullptr);
    async.async = true;
    Outcome o = Take(Api().run(&async, nullptr));
    EXPECT_EQ(o.code, CAI_INVALID_ARGUMENT) << o.message;

    HostTensor<float> strided(6, kF32);
    int64_t shape[2] = {2, 3};
    int64_t strides[2] = {1, 2};  // column-major: not contiguous
    strided.t.ndim = 2;
    strided.t.shape = shape;
    strided.t.strides = strides;
    expect(Args(CAI_COMM_ALL_REDUCE, nullptr, &strided.t), CAI_INVALID_ARGUMENT, "not contiguous");
    HostTensor<float> rocm(3, kF32);
    rocm.t.device = {10, 0};  // DLPack's kDLROCM: neither backend takes it
    expect(Args(CAI_COMM_ALL_REDUCE, nullptr, &rocm.t), CAI_UNIMPLEMENTED,
           "is on device type 10; the communicator takes host memory (Gloo) and CUDA memory "
           "(NCCL)");
    HostTensor<float> null_data(3, kF32);
    null_data.t.data = nullptr;
    expect(Args(CAI_COMM_ALL_REDUCE, nullptr, &null_data.t), CAI_INVALID_ARGUMENT,
           "NULL data pointer");

    const int32_t dup[] = {0, 0};
    const int32_t out_of_range[] = {0, 5};
    cai_comm_group* g = reinterpret_cast<cai_comm_group*>(0x1);
    Outcome d = Take(Api().new_group(dup, 2, &g));
    EXPECT_EQ(d.code, CAI_INVALID_ARGUMENT);
    EXPECT_NE(d.message.find("listed twice"), std::string::npos) << d.message;
    Outcome r = Take(Api().new_group(out_of_range, 2, &g));
    EXPECT_EQ(r.code, CAI_INVALID_ARGUMENT);
    EXPECT_NE(r.message.find("outside the world of 2"), std::string::npos) << r.message;
    EXPECT_EQ(g, reinterpret_cast<cai_comm_group*>(0x1));

    cai_comm_counters counters{};
    counters.struct_size = 8;
    Outcome cs = Take(Api().counters(nullptr, &counters));
    EXPECT_EQ(cs.code, CAI_INVALID_ARGUMENT);
    EXPECT_NE(cs.message.find("counters: out.struct_size is 8, smaller than the"),
              std::string::npos)
        << cs.message;
    // Nothing invalid was counted.
    counters.struct_size = CAI_COMM_COUNTERS_STRUCT_SIZE;
    CAI_EXPECT_OK(Api().counters(nullptr, &counters));
    EXPECT_EQ(counters.calls[CAI_COMM_ALL_REDUCE], 0u);
    EXPECT_NE(std::string(Api().backend_info(nullptr)).find("reduce_scatter=ring"),
              std::string::npos);
    CAI_EXPECT_OK([] {
      cai_comm_args barrier = Args(CAI_COMM_BARRIER, nullptr, nullptr);
      return Api().run(&barrier, nullptr);
    }());
  });
}

}  // namespace
}  // namespace cai::test
