// The collective benchmark behind `cai bench comm`: its table, and the transport bound it
// measures in the same run, on 2 and 3 ranks.
#include "comm/comm_bench.h"

#include <regex>
#include <sstream>

#include "comm_test_util.h"
#include "util/subprocess.h"

namespace cai::test {
namespace {

using std::chrono::milliseconds;

void ExpectTableWithBound(int world) {
  RunRanks(world, [](const RankContext& ctx) {
    InitRank(ctx, milliseconds(30000));
    CommBenchOptions options;
    options.ops = {CAI_COMM_ALL_REDUCE, CAI_COMM_REDUCE_SCATTER, CAI_COMM_BROADCAST};
    options.min_bytes = options.max_bytes = size_t{1} << 20;
    options.min_iters = options.max_iters = 2;
    std::ostringstream out;
    ASSERT_EQ(RunCommBenchmark(options, out), 0) << out.str();
    const std::string text = out.str();
    if (ctx.rank != 0) {
      EXPECT_EQ(text, "");
      return;
    }
    // The bound, before and after, as positive rates.
    const std::regex before(R"(# bound: TCP ring between the ranks, each sending and receiving )"
                            R"(1048576 B at once, median of 5: ([0-9.]+) GB/s per rank)");
    std::smatch m;
    ASSERT_TRUE(std::regex_search(text, m, before)) << text;
    EXPECT_GT(std::stod(m[1]), 0) << text;
    const std::regex after(R"(# bound after: ([0-9.]+) GB/s)");
    ASSERT_TRUE(std::regex_search(text, m, after)) << text;
    EXPECT_GT(std::stod(m[1]), 0) << text;
    // One row per op, the ring ops with their share of the bound, broadcast without.
    for (const char* op : {"all_reduce", "reduce_scatter", "broadcast"}) {
      const std::string share = std::string(op) == "broadcast" ? "-" : "[0-9]+%";
      const std::regex row(std::string(R"(\n +[0-9]+ +[0-9]+ +float +\w+ +)") + op +
                           R"( +[0-9.]+ +[0-9.]+ +[0-9.]+ +)" + share + "\n");
      EXPECT_TRUE(std::regex_search(text, row)) << op << " row missing in\n" << text;
    }
  });
}

TEST(CommBench, TwoRanks_TableAndTheTcpBoundMeasuredBeforeAndAfter) { ExpectTableWithBound(2); }
TEST(CommBench, ThreeRanks_TableAndTheTcpBoundMeasuredBeforeAndAfter) { ExpectTableWithBound(3); }

}  // namespace
}  // namespace cai::test
