// The collective benchmark behind `cai bench comm` and bench/comm_bench: nccl-tests' table
// (size, count, type, time, algbw, busbw) for each collective over a range of sizes.
#pragma once

#include <cstddef>
#include <ostream>
#include <vector>

#include "cai/comm.h"

namespace cai {

struct CommBenchOptions {
  // Collectives to measure, in this order.
  std::vector<cai_comm_op> ops = {CAI_COMM_ALL_REDUCE, CAI_COMM_REDUCE_SCATTER,
                                  CAI_COMM_ALL_GATHER, CAI_COMM_BROADCAST,
                                  CAI_COMM_REDUCE,     CAI_COMM_ALL_TO_ALL};
  // Sizes are the whole buffer, as in nccl-tests: the input of reduce_scatter and all_to_all,
  // the output of all_gather, the tensor of the in-place ops. Each step multiplies by `factor`.
  size_t min_bytes = 4 << 10;
  size_t max_bytes = 256 << 20;
  size_t factor = 4;
  int warmup_iters = 2;
  // Timed iterations per size: max_iters for small sizes, fewer as the size grows so each
  // size moves about iter_bytes, never fewer than min_iters.
  int max_iters = 20;
  int min_iters = 3;
  size_t iter_bytes = size_t{1} << 30;
  // The summary gives each op's best busbw at this size and above, where issue-level targets
  // against the bound apply.
  size_t large_bytes = size_t{64} << 20;
};

// Runs on every rank of the world group of the initialised communicator (collective); rank 0
// writes the table to `out`, the others write nothing. Times are the slowest rank's average.
// Returns 0, or 1 after writing the error to `out` (on every rank).
int RunCommBenchmark(const CommBenchOptions& options, std::ostream& out);

}  // namespace cai
