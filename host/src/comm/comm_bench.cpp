#include "comm/comm_bench.h"

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <exception>
#include <vector>

#include "comm/communicator.h"
#include "core/status.h"

namespace cai {

namespace {

// A 1-D fp32 view of `data` (borrowed for one call, as the ABI allows).
struct Tensor1d {
  explicit Tensor1d(std::vector<float>& data)
      : shape(static_cast<int64_t>(data.size())), stride(1) {
    tensor.data = data.data();
    tensor.device = {CAI_DEVICE_CPU, 0};
    tensor.ndim = 1;
    tensor.dtype = {CAI_DTYPE_FLOAT, 32, 1};
    tensor.shape = &shape;
    tensor.strides = &stride;
    tensor.byte_offset = 0;
  }
  int64_t shape;
  int64_t stride;
  cai_tensor tensor{};
};

// nccl-tests' bus bandwidth factors (doc/PERFORMANCE.md there): the fraction of the buffer
// that crosses the slowest link in an optimal algorithm, so busbw is comparable across n.
double BusFactor(cai_comm_op op, int n) {
  switch (op) {
    case CAI_COMM_ALL_REDUCE:
      return 2.0 * (n - 1) / n;
    case CAI_COMM_REDUCE_SCATTER:
    case CAI_COMM_ALL_GATHER:
    case CAI_COMM_ALL_TO_ALL:
      return static_cast<double>(n - 1) / n;
    default:
      return 1.0;
  }
}

}  // namespace

int RunCommBenchmark(const CommBenchOptions& options, std::ostream& out) {
  try {
    Communicator* comm = Communicator::Get();
    if (comm == nullptr) {
      throw Error(CAI_FAILED_PRECONDITION, "comm benchmark: the communicator is not initialised");
    }
    if (options.min_bytes == 0 || options.max_bytes < options.min_bytes || options.factor < 2) {
      throw Error(CAI_INVALID_ARGUMENT,
                  "comm benchmark: need 0 < min_bytes <= max_bytes and factor >= 2");
    }
    const int n = comm->world_size();
    const bool print = comm->rank() == 0;
    char line[160];
    if (print) {
      out << "# cai comm benchmark: " << n << " ranks, float32, sum, " << comm->BackendInfo(nullptr)
          << "\n";
      std::snprintf(line, sizeof(line), "#%13s %12s %8s %6s %15s %12s %12s %12s\n", "size(B)",
                    "count", "type", "redop", "op", "time(us)", "algbw(GB/s)", "busbw(GB/s)");
      out << line;
    }
    for (cai_comm_op op : options.ops) {
      for (size_t bytes = options.min_bytes; bytes <= options.max_bytes; bytes *= options.factor) {
        // Whole-buffer element count, rounded down to a multiple of n so every op can split it.
        const size_t count = std::max<size_t>(n, bytes / sizeof(float) / n * n);
        const size_t part = count / n;
        const bool big_in = op == CAI_COMM_REDUCE_SCATTER || op == CAI_COMM_ALL_TO_ALL;
        const bool big_out = op != CAI_COMM_REDUCE_SCATTER;
        std::vector<float> in_data(big_in ? count : part, 1.0f);
        std::vector<float> out_data(big_out ? count : part, 1.0f);
        Tensor1d in(in_data);
        Tensor1d out_t(out_data);
        cai_comm_args args{};
        args.struct_size = CAI_COMM_ARGS_STRUCT_SIZE;
        args.op = op;
        args.reduce_op = CAI_REDUCE_SUM;
        args.input = &in.tensor;
        args.output = &out_t.tensor;
        const int iters = std::clamp(static_cast<int>(options.iter_bytes / (count * 4)),
                                     options.min_iters, options.max_iters);
        for (int i = 0; i < options.warmup_iters; ++i) comm->RunSync(args);

        cai_comm_args barrier{};
        barrier.struct_size = CAI_COMM_ARGS_STRUCT_SIZE;
        barrier.op = CAI_COMM_BARRIER;
        comm->RunSync(barrier);
        const auto start = std::chrono::steady_clock::now();
        for (int i = 0; i < iters; ++i) comm->RunSync(args);
        std::vector<double> seconds(
            1, std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count() /
                   iters);
        // The slowest rank's time is the collective's time.
        int64_t one = 1, stride = 1;
        cai_tensor t{
            seconds.data(), {CAI_DEVICE_CPU, 0}, 1, {CAI_DTYPE_FLOAT, 64, 1}, &one, &stride, 0};
        cai_comm_args max_args{};
        max_args.struct_size = CAI_COMM_ARGS_STRUCT_SIZE;
        max_args.op = CAI_COMM_ALL_REDUCE;
        max_args.reduce_op = CAI_REDUCE_MAX;
        max_args.output = &t;
        comm->RunSync(max_args);
        if (print) {
          const double size = static_cast<double>(count * sizeof(float));
          const double algbw = size / seconds[0] / 1e9;
          std::snprintf(
              line, sizeof(line), "%14zu %12zu %8s %6s %15s %12.1f %12.3f %12.3f\n",
              count * sizeof(float), count, "float",
              (op == CAI_COMM_ALL_REDUCE || op == CAI_COMM_REDUCE_SCATTER || op == CAI_COMM_REDUCE)
                  ? "sum"
                  : "none",
              CommOpName(op), seconds[0] * 1e6, algbw, algbw * BusFactor(op, n));
          out << line << std::flush;
        }
      }
    }
    return 0;
  } catch (const std::exception& e) {
    out << "comm benchmark failed: " << e.what() << "\n";
    return 1;
  }
}

}  // namespace cai
