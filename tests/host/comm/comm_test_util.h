// Multi-process harness for the communicator tests: each rank is a forked child of the test
// process that rendezvouses on a free loopback port; its gtest failures become its exit status.
#pragma once

#include <gtest/gtest.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <functional>
#include <string>
#include <thread>
#include <vector>

#include "cai/comm.h"
#include "comm/comm_api.h"
#include "comm/communicator.h"
#include "core/status.h"
#include "launch/port_reservation.h"

namespace cai::test {

struct RankContext {
  int rank;
  int world_size;
  int port;
};

inline void InitRank(const RankContext& ctx, std::chrono::milliseconds timeout,
                     int lanes = CommOptions{}.lanes,
                     bool shared_memory = CommOptions{}.shared_memory) {
  CommOptions options;
  options.rank = ctx.rank;
  options.world_size = ctx.world_size;
  options.master_port = ctx.port;
  options.timeout = timeout;
  options.lanes = lanes;
  options.shared_memory = shared_memory;
  Communicator::Init(options);
}

// Forks one child per rank in `started` (default: all) of a world of `world_size`, runs `body`
// in each and expects every child to exit 0 within `limit`; children still running then are
// killed, so no process outlives the test. `body` initialises the communicator itself
// (InitRank) so that rendezvous failures can be tested too.
inline void RunRanks(int world_size, const std::function<void(const RankContext&)>& body,
                     std::vector<int> started = {},
                     std::chrono::seconds limit = std::chrono::seconds(90)) {
  if (started.empty()) {
    for (int r = 0; r < world_size; ++r) started.push_back(r);
  }
  // Held until the ranks end, so that no test running alongside is handed the store's port.
  const launch::PortReservation port("127.0.0.1");
  std::fflush(stdout);
  std::fflush(stderr);
  std::vector<pid_t> pids;
  for (int rank : started) {
    const pid_t pid = fork();
    ASSERT_GE(pid, 0);
    if (pid == 0) {
      int code = 0;
      try {
        body(RankContext{rank, world_size, port.port()});
      } catch (const std::exception& e) {
        std::fprintf(stderr, "rank %d threw: %s\n", rank, e.what());
        code = 2;
      }
      if (::testing::Test::HasFailure()) code = 1;
      try {
        Communicator::Shutdown();
      } catch (const std::exception& e) {
        std::fprintf(stderr, "rank %d shutdown threw: %s\n", rank, e.what());
        code = 3;
      }
      std::fflush(stdout);
      std::fflush(stderr);
      _exit(code);
    }
    pids.push_back(pid);
  }
  const auto deadline = std::chrono::steady_clock::now() + limit;
  std::vector<bool> reaped(pids.size(), false);
  size_t left = pids.size();
  while (left > 0) {
    for (size_t i = 0; i < pids.size(); ++i) {
      if (reaped[i]) continue;
      int status = 0;
      if (waitpid(pids[i], &status, WNOHANG) == pids[i]) {
        reaped[i] = true;
        --left;
        EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0)
            << "rank " << started[i] << " of " << world_size << " failed (status " << status << ")";
      }
    }
    if (left > 0 && std::chrono::steady_clock::now() > deadline) {
      for (size_t i = 0; i < pids.size(); ++i) {
        if (reaped[i]) continue;
        ADD_FAILURE() << "rank " << started[i] << " still running after " << limit.count()
                      << " s; killed";
        kill(pids[i], SIGKILL);
        waitpid(pids[i], nullptr, 0);
        reaped[i] = true;
        --left;
      }
    }
    if (left > 0) std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
}

// A host tensor of `n` elements of storage type T with the given ABI dtype.
template <class T>
struct HostTensor {
  HostTensor(size_t n, cai_dtype dtype) : data(n), shape(static_cast<int64_t>(n)) {
    t.data = data.data();
    t.device = {CAI_DEVICE_CPU, 0};
    t.ndim = 1;
    t.dtype = dtype;
    t.shape = &shape;
    t.strides = &stride;
    t.byte_offset = 0;
  }
  HostTensor(const HostTensor&) = delete;
  HostTensor& operator=(const HostTensor&) = delete;
  std::vector<T> data;
  int64_t shape;
  int64_t stride = 1;
  cai_tensor t{};
};

inline constexpr cai_dtype kF32{CAI_DTYPE_FLOAT, 32, 1};
inline constexpr cai_dtype kF64{CAI_DTYPE_FLOAT, 64, 1};
inline constexpr cai_dtype kF16{CAI_DTYPE_FLOAT, 16, 1};
inline constexpr cai_dtype kBF16{CAI_DTYPE_BFLOAT, 16, 1};
inline constexpr cai_dtype kI32{CAI_DTYPE_INT, 32, 1};
inline constexpr cai_dtype kI64{CAI_DTYPE_INT, 64, 1};
inline constexpr cai_dtype kU8{CAI_DTYPE_UINT, 8, 1};

inline cai_comm_args Args(cai_comm_op op, const cai_tensor* input, const cai_tensor* output) {
  cai_comm_args args{};
  args.struct_size = CAI_COMM_ARGS_STRUCT_SIZE;
  args.op = op;
  args.input = input;
  args.output = output;
  return args;
}

// The status's code and message, destroying it.
struct Outcome {
  cai_status_code code;
  std::string message;
};
inline Outcome Take(cai_status* status) {
  Outcome o{StatusCode(status), StatusMessage(status)};
  DestroyStatus(status);
  return o;
}

#define CAI_EXPECT_OK(expr)                            \
  do {                                                 \
    ::cai::test::Outcome o_ = ::cai::test::Take(expr); \
    ASSERT_EQ(o_.code, CAI_OK) << o_.message;          \
  } while (0)

inline void RunOp(cai_comm_args args) { CAI_EXPECT_OK(CommApi()->run(&args, nullptr)); }

}  // namespace cai::test
