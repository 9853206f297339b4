#include "comm/comm_bench.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <exception>
#include <string>
#include <thread>
#include <utility>
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

void Check(bool ok, const char* what) {
  if (!ok) {
    throw Error(CAI_INTERNAL, std::string("comm benchmark: ") + what + ": " + strerror(errno));
  }
}

class Fd {
 public:
  explicit Fd(int fd) : fd_(fd) { Check(fd_ >= 0, "socket"); }
  ~Fd() { ::close(fd_); }
  Fd(const Fd&) = delete;
  Fd& operator=(const Fd&) = delete;
  int get() const { return fd_; }

 private:
  int fd_;
};

// Moves `bytes` through `fd`, each call asking for all that is left, as Gloo's pairs do.
void Stream(int fd, char* data, size_t bytes, bool send) {
  for (size_t done = 0; done < bytes;) {
    const size_t chunk = bytes - done;
    const ssize_t n =
        send ? ::send(fd, data + done, chunk, MSG_NOSIGNAL) : ::recv(fd, data + done, chunk, 0);
    if (n < 0 && errno == EINTR) continue;
    Check(n > 0, send ? "send" : "recv");
    done += static_cast<size_t>(n);
  }
}

// The bus-bandwidth ceiling of the collectives in which every rank sends and receives at
// once: each rank sends `bytes` to the next rank on a plain TCP connection while it receives
// as much from the previous one, which is what a ring step does on every link at once, without
// the reduction, the framing or the synchronisation; busbw counts the bytes a rank sends, so
// no such collective's busbw can beat it. (A one-way figure measured the same way ran ~30%
// below gloo::broadcast, so it bounds nothing and broadcast gets no share.) Each rank listens
// on the address the collectives bind to (the addresses travel by all_gather). Returns the
// median over `reps` of bytes / the slowest rank's time, in GB/s.
double MeasureTcpRing(Communicator& comm, size_t bytes, int reps) {
  const int n = comm.world_size();
  const std::string& bind = comm.BindAddress();
  sockaddr_in self{};
  self.sin_family = AF_INET;
  if (inet_pton(AF_INET, bind.substr(0, bind.find(' ')).c_str(), &self.sin_addr) != 1) {
    throw Error(CAI_INTERNAL, "comm benchmark: the bind address '" + bind + "' is not IPv4");
  }
  Fd listener(::socket(AF_INET, SOCK_STREAM, 0));
  Check(::bind(listener.get(), reinterpret_cast<sockaddr*>(&self), sizeof(self)) == 0, "bind");
  Check(::listen(listener.get(), 1) == 0, "listen");
  socklen_t len = sizeof(self);
  Check(::getsockname(listener.get(), reinterpret_cast<sockaddr*>(&self), &len) == 0,
        "getsockname");

  const int64_t mine[2] = {self.sin_addr.s_addr, self.sin_port};
  const std::vector<int64_t> all = comm.AllGather(mine);

  // A connect completes against the listener's backlog, so every rank connects, then accepts.
  const int next = (comm.rank() + 1) % n;
  sockaddr_in peer{};
  peer.sin_family = AF_INET;
  peer.sin_addr.s_addr = static_cast<uint32_t>(all[2 * next]);
  peer.sin_port = static_cast<uint16_t>(all[2 * next + 1]);
  Fd to_next(::socket(AF_INET, SOCK_STREAM, 0));
  Check(::connect(to_next.get(), reinterpret_cast<sockaddr*>(&peer), sizeof(peer)) == 0, "connect");
  Fd from_prev(::accept(listener.get(), nullptr, nullptr));
  const int on = 1;
  for (int fd : {to_next.get(), from_prev.get()}) {
    Check(::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &on, sizeof(on)) == 0, "TCP_NODELAY");
  }

  std::vector<char> send_buf(bytes, 1), recv_buf(bytes);
  std::vector<double> times;
  for (int i = 0; i <= reps; ++i) {
    comm.Barrier();
    const auto start = std::chrono::steady_clock::now();
    std::exception_ptr send_error;
    std::thread sender([&] {
      try {
        Stream(to_next.get(), send_buf.data(), bytes, true);
      } catch (...) {
        send_error = std::current_exception();
      }
    });
    try {
      Stream(from_prev.get(), recv_buf.data(), bytes, false);
    } catch (...) {
      ::shutdown(to_next.get(), SHUT_RDWR);  // unblocks the sender
      sender.join();
      throw;
    }
    sender.join();
    if (send_error) std::rethrow_exception(send_error);
    // The slowest rank's time: a transfer takes as long as its slowest rank.
    const double t = comm.AllReduce(
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count(),
        CAI_REDUCE_MAX);
    if (i > 0) times.push_back(t);  // the first run grows the socket buffers
  }
  std::sort(times.begin(), times.end());
  return static_cast<double>(bytes) / times[times.size() / 2] / 1e9;
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
    // The transport's ceiling, measured before and after the collectives so that load drifting
    // on a shared machine shows; the summary holds each op against the higher of the two.
    const size_t bound_bytes = std::min<size_t>(options.max_bytes, size_t{256} << 20);
    const int bound_reps = 5;
    const double bound_before = n > 1 ? MeasureTcpRing(*comm, bound_bytes, bound_reps) : 0;
    // A broadcast's receivers send nothing back: the ring's bound is not its.
    auto bounded = [&](cai_comm_op op) { return n > 1 && op != CAI_COMM_BROADCAST; };
    char line[200];
    if (print) {
      out << "# cai comm benchmark: " << n << " ranks, float32, sum, " << comm->BackendInfo(nullptr)
          << "\n";
      if (n > 1) {
        std::snprintf(line, sizeof(line),
                      "# bound: TCP ring between the ranks, each sending and receiving %zu B at "
                      "once, median of %d: %.3f GB/s per rank (every op but broadcast)\n",
                      bound_bytes, bound_reps, bound_before);
        out << line;
      }
      std::snprintf(line, sizeof(line), "#%13s %12s %8s %6s %15s %12s %12s %12s %8s\n", "size(B)",
                    "count", "type", "redop", "op", "time(us)", "algbw(GB/s)", "busbw(GB/s)",
                    "of bound");
      out << line;
    }
    // Per op, the best busbw at sizes >= 64 MiB (where the bound's target applies).
    std::vector<std::pair<cai_comm_op, double>> large;
    for (cai_comm_op op : options.ops) {
      double best_large = 0;
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
        comm->Barrier();
        const auto start = std::chrono::steady_clock::now();
        for (int i = 0; i < iters; ++i) comm->RunSync(args);
        // The slowest rank's time is the collective's time.
        const double seconds = comm->AllReduce(
            std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count() / iters,
            CAI_REDUCE_MAX);
        const double size = static_cast<double>(count * sizeof(float));
        const double algbw = size / seconds / 1e9;
        const double busbw = algbw * BusFactor(op, n);
        if (count * sizeof(float) >= (size_t{64} << 20)) best_large = std::max(best_large, busbw);
        if (print) {
          char share[16] = "-";
          if (bounded(op))
            std::snprintf(share, sizeof(share), "%.0f%%", 100 * busbw / bound_before);
          std::snprintf(
              line, sizeof(line), "%14zu %12zu %8s %6s %15s %12.1f %12.3f %12.3f %8s\n",
              count * sizeof(float), count, "float",
              (op == CAI_COMM_ALL_REDUCE || op == CAI_COMM_REDUCE_SCATTER || op == CAI_COMM_REDUCE)
                  ? "sum"
                  : "none",
              CommOpName(op), seconds * 1e6, algbw, busbw, share);
          out << line << std::flush;
        }
      }
      if (best_large > 0 && bounded(op)) large.emplace_back(op, best_large);
    }
    if (n > 1) {
      const double bound_after = MeasureTcpRing(*comm, bound_bytes, bound_reps);
      const double bound = std::max(bound_before, bound_after);
      if (print) {
        std::snprintf(line, sizeof(line),
                      "# bound after: %.3f GB/s; against the higher, %.3f GB/s, the best busbw at "
                      ">= 64 MiB is:\n",
                      bound_after, bound);
        out << line;
        for (const auto& [op, busbw] : large) {
          std::snprintf(line, sizeof(line), "#   %-15s %8.3f GB/s %5.0f%%\n", CommOpName(op), busbw,
                        100 * busbw / bound);
          out << line;
        }
        out << std::flush;
      }
    }
    return 0;
  } catch (const std::exception& e) {
    out << "comm benchmark failed: " << e.what() << "\n";
    return 1;
  }
}

}  // namespace cai
