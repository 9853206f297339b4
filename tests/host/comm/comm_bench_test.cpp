// The collective benchmark behind `cai bench comm`: its table, and the transport bound and the
// plain operations it measures in the same run, on 2 and 3 ranks.
#include "comm/comm_bench.h"

#include <regex>
#include <sstream>

#include "comm_test_util.h"
#include "util/subprocess.h"

namespace cai::test {
namespace {

using std::chrono::milliseconds;

void ExpectTableWithBound(int world, bool shared_memory) {
  RunRanks(world, [shared_memory](const RankContext& ctx) {
    InitRank(ctx, milliseconds(30000), CommOptions{}.lanes, shared_memory);
    CommBenchOptions options;
    options.ops = {CAI_COMM_ALL_REDUCE, CAI_COMM_REDUCE_SCATTER, CAI_COMM_ALL_GATHER,
                   CAI_COMM_BROADCAST};
    options.min_bytes = options.max_bytes = size_t{1} << 20;
    options.large_bytes = size_t{1} << 19;  // 3 ranks round the buffer down to 3 x 349,524 B
    options.min_iters = options.max_iters = 2;
    std::ostringstream out;
    ASSERT_EQ(RunCommBenchmark(options, out), 0) << out.str();
    const std::string text = out.str();
    if (ctx.rank != 0) {
      EXPECT_EQ(text, "");
      return;
    }
    // The bound, how busy the ranks were meanwhile, and the plain operations, before and after,
    // as positive figures.
    const std::regex before(R"(# bound: TCP ring between the ranks, each sending and receiving )"
                            R"(1048576 B at once, median of 9: ([0-9.]+) GB/s per rank .*; )"
                            R"(each rank's process busy ([0-9.]+) CPU-s per s meanwhile)");
    std::smatch m;
    ASSERT_TRUE(std::regex_search(text, m, before)) << text;
    EXPECT_GT(std::stod(m[1]), 0) << text;
    EXPECT_GT(std::stod(m[2]), 0) << text;
    const std::regex plain(R"(# plain: .*: reduce_scatter ([0-9.]+), all_gather ([0-9.]+) GB/s)");
    ASSERT_TRUE(std::regex_search(text, m, plain)) << text;
    EXPECT_GT(std::stod(m[1]), 0) << text;
    EXPECT_GT(std::stod(m[2]), 0) << text;
    const std::regex after(R"(# bound after: ([0-9.]+) GB/s \(busy ([0-9.]+) CPU-s per s\); )"
                           R"(plain after: reduce_scatter ([0-9.]+), all_gather ([0-9.]+) GB/s)");
    ASSERT_TRUE(std::regex_search(text, m, after)) << text;
    for (int i = 1; i <= 4; ++i) EXPECT_GT(std::stod(m[i]), 0) << text;
    // Through shared memory, that ring's own bound and copy, before and after.
    const std::regex shm_before(R"(# shm bound: shared memory between the ranks, each streaming )"
                                R"(1048576 B .*, median of 9: ([0-9.]+) GB/s per rank)");
    const std::regex shm_copy(R"(# shm copy: the same from and into buffers of 1048576 B in )"
                              R"(memory \(not a bound\): ([0-9.]+) GB/s per rank)");
    const std::regex shm_after(
        R"(# shm bound after: ([0-9.]+) GB/s; shm copy after: ([0-9.]+) GB/s\n)");
    for (const std::regex* r : {&shm_before, &shm_copy, &shm_after}) {
      ASSERT_EQ(std::regex_search(text, m, *r), shared_memory) << text;
      for (size_t i = 1; shared_memory && i < m.size(); ++i) EXPECT_GT(std::stod(m[i]), 0) << text;
    }
    // One row per op and one for all_gather in place, the ring ops with their share of the
    // bound, broadcast without.
    for (const char* op :
         {"all_reduce", "reduce_scatter", "all_gather", "all_gather\\(ip\\)", "broadcast"}) {
      const std::string share = std::string(op) == "broadcast" ? "-" : "[0-9]+%";
      const std::regex row(std::string(R"(\n +[0-9]+ +[0-9]+ +float +\w+ +)") + op +
                           R"( +[0-9.]+ +[0-9.]+ +[0-9.]+ +)" + share + "\n");
      EXPECT_TRUE(std::regex_search(text, row)) << op << " row missing in\n" << text;
    }
    // The summary: each ring op against the bound; all_reduce and reduce_scatter against their
    // plain versions too; broadcast not at all.
    const std::string share = R"( +[0-9.]+ GB/s +[0-9]+% of the bound [0-9.]+ GB/s)";
    // Through shared memory, against its bound and the TCP one.
    const std::string ring_share =
        shared_memory ? R"( +[0-9.]+ GB/s +[0-9]+% of the shm bound [0-9.]+ GB/s, +[0-9]+% of )"
                        R"(shm copy [0-9.]+ GB/s, +[0-9]+% of the TCP bound [0-9.]+ GB/s)"
                      : share;
    const std::string plain_share = R"(, +[0-9]+% of plain [0-9.]+ GB/s)";
    EXPECT_TRUE(std::regex_search(text, std::regex("\n#   all_reduce" + ring_share + plain_share +
                                                   R"( \(its reduce_scatter then all_gather\)\n)")))
        << text;
    EXPECT_TRUE(std::regex_search(
        text, std::regex("\n#   reduce_scatter" + ring_share + plain_share + "\n")))
        << text;
    EXPECT_TRUE(
        std::regex_search(text, std::regex("\n#   all_gather " + ring_share + plain_share + "\n")))
        << text;
    // In place there is no copy for the plain one to stand for.
    EXPECT_TRUE(std::regex_search(text, std::regex("\n#   all_gather\\(ip\\)" + ring_share + "\n")))
        << text;
    EXPECT_EQ(text.find("#   broadcast"), std::string::npos) << text;
    EXPECT_NE(text.find("best busbw at >= 524288 B is:"), std::string::npos) << text;
  });
}

TEST(CommBench, TwoRanks_TableAndTheBoundsMeasuredBeforeAndAfter) { ExpectTableWithBound(2, true); }
TEST(CommBench, ThreeRanks_TableAndTheBoundsMeasuredBeforeAndAfter) {
  ExpectTableWithBound(3, true);
}
TEST(CommBench, TwoRanks_OverTcp_TableAndTheTcpBoundMeasuredBeforeAndAfter) {
  ExpectTableWithBound(2, false);
}

}  // namespace
}  // namespace cai::test
