#include "comm/comm_bench.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <exception>
#include <memory>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "comm/communicator.h"
#include "comm/shm_ring.h"
#include "core/status.h"

namespace cai {

namespace {

// A 1-D fp32 view of `numel` floats at `data` (borrowed for one call, as the ABI allows).
struct Tensor1d {
  Tensor1d(float* data, size_t numel) : shape(static_cast<int64_t>(numel)), stride(1) {
    tensor.data = data;
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

// A peer silent this long on the benchmark's own connections ends the run (a stopped rank
// never leaves the others hanging there; the collectives have the communicator's timeout).
constexpr int kIoTimeoutSeconds = 120;

// Moves `bytes` through `fd`, each call asking for all that is left, as Gloo's pairs do.
void Stream(int fd, char* data, size_t bytes, bool send, int peer) {
  for (size_t done = 0; done < bytes;) {
    const size_t chunk = bytes - done;
    const ssize_t n =
        send ? ::send(fd, data + done, chunk, MSG_NOSIGNAL) : ::recv(fd, data + done, chunk, 0);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
      throw Error(CAI_DEADLINE_EXCEEDED, std::string("comm benchmark: rank ") +
                                             std::to_string(peer) + (send ? " took" : " sent") +
                                             " nothing for " + std::to_string(kIoTimeoutSeconds) +
                                             " s on the benchmark's own connection");
    }
    if (n == 0) {
      throw Error(CAI_UNAVAILABLE, "comm benchmark: rank " + std::to_string(peer) +
                                       " closed the benchmark's own connection");
    }
    Check(n > 0, send ? "send" : "recv");
    done += static_cast<size_t>(n);
  }
}

double CpuSeconds() {
  rusage usage{};
  getrusage(RUSAGE_SELF, &usage);
  auto seconds = [](const timeval& t) { return t.tv_sec + t.tv_usec / 1e6; };
  return seconds(usage.ru_utime) + seconds(usage.ru_stime);
}

double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

// The slowest rank's seconds for fn, started together.
template <class Fn>
double Timed(Communicator& comm, Fn&& fn) {
  comm.Barrier();
  const auto start = std::chrono::steady_clock::now();
  fn();
  return comm.AllReduce(
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count(),
      CAI_REDUCE_MAX);
}

// Plain TCP connections around the ring, each rank to the next, beside the communicator's own.
// They measure two things in the same run as the collectives:
// - the bound: each rank sends `bytes` to the next rank while it receives as much from the
//   previous one, which is what a ring step does on every link at once, without the reduction,
//   the framing or the synchronisation; busbw counts the bytes a rank sends, so no collective in
//   which every rank sends and receives can beat it. (A one-way figure measured the same way ran
//   ~30% below gloo::broadcast, so it bounds nothing and broadcast gets no share.) Also how busy
//   each rank's process is meanwhile: on loopback the kernel's copies are the transfer, so a
//   rank near one CPU-second per second while the machine has a CPU per rank is CPU-bound, and
//   every byte an operation touches besides the transfer comes out of it.
// - the plain operations: reduce_scatter and all_gather as the simplest ring over these sockets
//   does them (blocking sends on a thread, receives in 1 MiB segments, each reduced as it
//   arrives; all_gather copies its own block into place first), with none of Gloo's messages,
//   I/O threads or notifications. Not a bound (a cleverer schedule could beat it): what the
//   transport plus the operation's own memory work cost, so that the distance from it is what
//   the communicator's implementation adds.
// Each rank listens on the address the collectives bind to (the addresses travel by
// all_gather). Sockets time out after kIoTimeoutSeconds so a stopped peer ends the benchmark.
class PlainRing {
 public:
  explicit PlainRing(Communicator& comm) : comm_(comm), n_(comm.world_size()), r_(comm.rank()) {
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
    sockaddr_in peer{};
    peer.sin_family = AF_INET;
    peer.sin_addr.s_addr = static_cast<uint32_t>(all[2 * Next()]);
    peer.sin_port = static_cast<uint16_t>(all[2 * Next() + 1]);
    to_next_ = std::make_unique<Fd>(::socket(AF_INET, SOCK_STREAM, 0));
    Check(::connect(to_next_->get(), reinterpret_cast<sockaddr*>(&peer), sizeof(peer)) == 0,
          "connect");
    from_prev_ = std::make_unique<Fd>(::accept(listener.get(), nullptr, nullptr));
    const int on = 1;
    const timeval timeout{kIoTimeoutSeconds, 0};
    for (int fd : {to_next_->get(), from_prev_->get()}) {
      Check(::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &on, sizeof(on)) == 0, "TCP_NODELAY");
      Check(::setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &timeout, sizeof(timeout)) == 0,
            "SO_RCVTIMEO");
      Check(::setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &timeout, sizeof(timeout)) == 0,
            "SO_SNDTIMEO");
    }
  }

  struct Figures {
    double bound = 0;           // GB/s a rank sends while receiving as much
    double cpu_per_rank = 0;    // CPU-seconds per second of the bound, averaged over the ranks
    double reduce_scatter = 0;  // the plain operations' busbw, GB/s
    double all_gather = 0;
  };

  // Medians over `reps` runs (after one that grows the socket buffers) of the bound at `bytes`
  // per rank and of the plain operations on a whole buffer of `bytes`; the three alternate
  // within each run so that load drifting on the machine reaches all of them.
  Figures Measure(size_t bytes, int reps) {
    const size_t block = std::max<size_t>(1, bytes / sizeof(float) / n_);
    const size_t count = block * n_;
    std::vector<char> send_buf(bytes, 1), recv_buf(bytes);
    std::vector<float> whole(count, 1.0f), part(block, 1.0f), scratch(2 * block);
    std::vector<double> bound, cpu, rs, ag;
    const double ring_bytes = static_cast<double>(count * sizeof(float)) * (n_ - 1) / n_;
    for (int i = 0; i <= reps; ++i) {
      double busy = 0;
      const double t_bound = Timed(comm_, [&] {
        const double cpu0 = CpuSeconds();
        const auto start = std::chrono::steady_clock::now();
        Exchange(send_buf.data(), recv_buf.data(), bytes, bytes, [](size_t, size_t) {});
        busy = (CpuSeconds() - cpu0) /
               std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
      });
      busy = comm_.AllReduce(busy, CAI_REDUCE_SUM) / n_;
      const double t_rs =
          Timed(comm_, [&] { ReduceScatter(whole.data(), part.data(), scratch, block); });
      const double t_ag = Timed(comm_, [&] { AllGather(part.data(), whole.data(), block); });
      if (i == 0) continue;  // the first run grows the socket buffers
      bound.push_back(static_cast<double>(bytes) / t_bound / 1e9);
      cpu.push_back(busy);
      rs.push_back(ring_bytes / t_rs / 1e9);
      ag.push_back(ring_bytes / t_ag / 1e9);
    }
    return {Median(bound), Median(cpu), Median(rs), Median(ag)};
  }

 private:
  int Next() const { return (r_ + 1) % n_; }
  int Prev() const { return (r_ + n_ - 1) % n_; }

  // Sends `bytes` from `send` to the next rank on a thread while receiving as much from the
  // previous one into `recv`, `segment` bytes at a time, calling arrived(offset, length) after
  // each.
  template <class Arrived>
  void Exchange(const char* send, char* recv, size_t bytes, size_t segment, Arrived&& arrived) {
    std::exception_ptr send_error;
    std::thread sender([&] {
      try {
        Stream(to_next_->get(), const_cast<char*>(send), bytes, true, Next());
      } catch (...) {
        send_error = std::current_exception();
      }
    });
    try {
      for (size_t off = 0; off < bytes; off += segment) {
        const size_t len = std::min(segment, bytes - off);
        Stream(from_prev_->get(), recv + off, len, false, Prev());
        arrived(off, len);
      }
    } catch (...) {
      ::shutdown(to_next_->get(), SHUT_RDWR);  // unblocks the sender
      sender.join();
      throw;
    }
    sender.join();
    if (send_error) std::rethrow_exception(send_error);
  }

  // Step s sends the partial sum of block (r-s-1) and receives that of block (r-s-2), adding
  // this rank's own block to each segment as it arrives; the last step's lands in `out`.
  void ReduceScatter(const float* in, float* out, std::vector<float>& scratch, size_t block) {
    const size_t bytes = block * sizeof(float);
    const float* send = in + static_cast<size_t>(Prev()) * block;
    for (int s = 0; s + 1 < n_; ++s) {
      float* acc = s + 2 == n_ ? out : scratch.data() + (s % 2) * block;
      const float* local = in + static_cast<size_t>((r_ - s - 2 + 2 * n_) % n_) * block;
      Exchange(reinterpret_cast<const char*>(send), reinterpret_cast<char*>(acc), bytes,
               kPlainSegment, [&](size_t off, size_t len) {
                 float* a = acc + off / sizeof(float);
                 const float* b = local + off / sizeof(float);
                 for (size_t k = 0; k < len / sizeof(float); ++k) a[k] += b[k];
               });
      send = acc;
    }
  }

  // This rank's block copied into place, then step s forwards block (r-s) and receives block
  // (r-s-1).
  void AllGather(const float* in, float* out, size_t block) {
    const size_t bytes = block * sizeof(float);
    std::memcpy(out + static_cast<size_t>(r_) * block, in, bytes);
    auto at = [&](int b) { return reinterpret_cast<char*>(out + static_cast<size_t>(b) * block); };
    for (int s = 0; s + 1 < n_; ++s) {
      Exchange(at((r_ - s + n_) % n_), at((r_ - s - 1 + n_) % n_), bytes, kPlainSegment,
               [](size_t, size_t) {});
    }
  }

  static constexpr size_t kPlainSegment = size_t{1} << 20;
  Communicator& comm_;
  int n_, r_;
  std::unique_ptr<Fd> to_next_, from_prev_;
};

// The shared-memory ring measured as the TCP bound is, on a ring of its own beside the
// communicator's: every rank streams `bytes` into its outbox while streaming as much out of its
// left neighbour's, slot by slot (comm::ShmRing::Stream).
// - The bound: from and into one slot-sized buffer of its own, which stays in cache, so that
//   nothing but the slots' own traffic between the two processes limits it. Every byte an
//   operation sends goes through a slot, written by one rank and read by the next, and no
//   operation has a source or destination cheaper than cache: none can beat it.
// - The copy (not a bound): from and into buffers of `bytes`, in memory, what moving bytes
//   between two processes' own buffers through shared memory costs, as sockets do in the TCP
//   bound (where the kernel makes the same two copies). An operation touches at least as much
//   memory per byte sent; one whose data is still in cache when it copies it out (all_reduce's
//   reduced chunk, all_gather's in-place block) can still come close to it or pass it.
class ShmBound {
 public:
  explicit ShmBound(Communicator& comm) : comm_(comm) {
    std::string why_not;
    ring_ = comm::ShmRing::Open(
        comm.rank(), comm.world_size(),
        [&](std::span<const int64_t> mine) { return comm.AllGather(mine); }, &why_not);
    if (!ring_) throw Error(CAI_UNAVAILABLE, "comm benchmark: no shared-memory ring: " + why_not);
  }

  struct Figures {
    double bound = 0;  // GB/s per rank, cache to cache
    double copy = 0;   // GB/s per rank, memory to memory
  };

  // Medians over `reps` runs of each, alternating, after one that faults the pages in.
  Figures Measure(size_t bytes, int reps) {
    std::vector<std::byte> src(bytes, std::byte{1}), dst(bytes);
    const comm::ShmRing::CheckPeers none;
    auto stream = [&](size_t window) {
      return Timed(comm_, [&] {
        ring_->Stream(src.data(), dst.data(), window, bytes, std::chrono::minutes(2), none);
      });
    };
    std::vector<double> bound, copy;
    for (int i = 0; i <= reps; ++i) {
      const double t_bound = stream(comm::ShmRing::kSlotBytes);
      const double t_copy = stream(bytes);
      if (i == 0) continue;
      bound.push_back(static_cast<double>(bytes) / t_bound / 1e9);
      copy.push_back(static_cast<double>(bytes) / t_copy / 1e9);
    }
    return {Median(bound), Median(copy)};
  }

 private:
  Communicator& comm_;
  std::unique_ptr<comm::ShmRing> ring_;
};

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
    // The transport's ceiling and the plain operations, measured before and after the
    // collectives so that load drifting on a shared machine shows; the summary holds each op
    // against the higher of the two.
    const size_t bound_bytes = std::min<size_t>(options.max_bytes, size_t{256} << 20);
    const int bound_reps = 9;
    std::unique_ptr<PlainRing> ring;
    PlainRing::Figures before;
    // all_reduce, reduce_scatter and all_gather run through shared memory on this group: their
    // bound is then the shared-memory ring's.
    const bool shm = comm->SharedMemory(nullptr);
    std::unique_ptr<ShmBound> shm_ring;
    ShmBound::Figures shm_before;
    if (n > 1) {
      ring = std::make_unique<PlainRing>(*comm);
      before = ring->Measure(bound_bytes, bound_reps);
      if (shm) {
        shm_ring = std::make_unique<ShmBound>(*comm);
        shm_before = shm_ring->Measure(bound_bytes, bound_reps);
      }
    }
    // A broadcast's receivers send nothing back: the ring's bound is not its.
    auto bounded = [&](cai_comm_op op) { return n > 1 && op != CAI_COMM_BROADCAST; };
    auto through_shm = [&](cai_comm_op op) { return shm && comm::ShmRing::Runs(op); };
    char line[400];
    if (print) {
      out << "# cai comm benchmark: " << n << " ranks, float32, sum, " << comm->BackendInfo(nullptr)
          << "\n";
      if (n > 1) {
        std::snprintf(line, sizeof(line),
                      "# bound: TCP ring between the ranks, each sending and receiving %zu B at "
                      "once, median of %d: %.3f GB/s per rank (every op but broadcast); each "
                      "rank's process busy %.2f CPU-s per s meanwhile, %u CPUs online\n",
                      bound_bytes, bound_reps, before.bound, before.cpu_per_rank,
                      std::thread::hardware_concurrency());
        out << line;
        std::snprintf(line, sizeof(line),
                      "# plain: the same sockets, blocking, 1 MiB segments reduced as they arrive, "
                      "no framing (not a bound): reduce_scatter %.3f, all_gather %.3f GB/s busbw "
                      "on %zu B\n",
                      before.reduce_scatter, before.all_gather, bound_bytes);
        out << line;
        if (shm) {
          std::snprintf(line, sizeof(line),
                        "# shm bound: shared memory between the ranks, each streaming %zu B "
                        "into its outbox while streaming as much out of its neighbour's, from and "
                        "into a slot-sized buffer in cache, median of %d: %.3f GB/s per rank "
                        "(all_reduce, reduce_scatter, all_gather)\n",
                        bound_bytes, bound_reps, shm_before.bound);
          out << line;
          std::snprintf(line, sizeof(line),
                        "# shm copy: the same from and into buffers of %zu B in memory (not a "
                        "bound): %.3f GB/s per rank\n",
                        bound_bytes, shm_before.copy);
          out << line;
        }
      }
      std::snprintf(line, sizeof(line), "#%13s %12s %8s %6s %15s %12s %12s %12s %8s\n", "size(B)",
                    "count", "type", "redop", "op", "time(us)", "algbw(GB/s)", "busbw(GB/s)",
                    "of bound");
      out << line;
    }
    // Each op, and all_gather once more in place (its input this rank's block of the output, as
    // ZeRO gathers its updated shards; nccl-tests' in-place column): no copy of its own block.
    struct Case {
      cai_comm_op op;
      bool in_place;
      const char* name;
    };
    std::vector<Case> cases;
    for (cai_comm_op op : options.ops) {
      cases.push_back({op, false, CommOpName(op)});
      if (op == CAI_COMM_ALL_GATHER) cases.push_back({op, true, "all_gather(ip)"});
    }
    // Per case, the best busbw at sizes >= options.large_bytes (where the bound's target applies).
    std::vector<std::pair<Case, double>> large;
    for (const Case& c : cases) {
      const cai_comm_op op = c.op;
      double best_large = 0;
      for (size_t bytes = options.min_bytes; bytes <= options.max_bytes; bytes *= options.factor) {
        // Whole-buffer element count, rounded down to a multiple of n so every op can split it.
        const size_t count = std::max<size_t>(n, bytes / sizeof(float) / n * n);
        const size_t part = count / n;
        const bool big_in = op == CAI_COMM_REDUCE_SCATTER || op == CAI_COMM_ALL_TO_ALL;
        const bool big_out = op != CAI_COMM_REDUCE_SCATTER;
        std::vector<float> in_data(c.in_place ? 0 : big_in ? count : part, 1.0f);
        std::vector<float> out_data(big_out ? count : part, 1.0f);
        Tensor1d in(c.in_place ? out_data.data() + comm->rank() * part : in_data.data(),
                    c.in_place ? part : in_data.size());
        Tensor1d out_t(out_data.data(), out_data.size());
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
        if (count * sizeof(float) >= options.large_bytes) best_large = std::max(best_large, busbw);
        if (print) {
          char share[16] = "-";
          if (bounded(op)) {
            std::snprintf(share, sizeof(share), "%.0f%%",
                          100 * busbw / (through_shm(op) ? shm_before.bound : before.bound));
          }
          std::snprintf(
              line, sizeof(line), "%14zu %12zu %8s %6s %15s %12.1f %12.3f %12.3f %8s\n",
              count * sizeof(float), count, "float",
              (op == CAI_COMM_ALL_REDUCE || op == CAI_COMM_REDUCE_SCATTER || op == CAI_COMM_REDUCE)
                  ? "sum"
                  : "none",
              c.name, seconds * 1e6, algbw, busbw, share);
          out << line << std::flush;
        }
      }
      if (best_large > 0 && bounded(op)) large.emplace_back(c, best_large);
    }
    if (n > 1) {
      const PlainRing::Figures after = ring->Measure(bound_bytes, bound_reps);
      const ShmBound::Figures shm_after =
          shm ? shm_ring->Measure(bound_bytes, bound_reps) : ShmBound::Figures{};
      const double shm_bound = std::max(shm_before.bound, shm_after.bound);
      const double shm_copy = std::max(shm_before.copy, shm_after.copy);
      const double bound = std::max(before.bound, after.bound);
      const double plain_rs = std::max(before.reduce_scatter, after.reduce_scatter);
      const double plain_ag = std::max(before.all_gather, after.all_gather);
      // An all_reduce is a reduce_scatter then an all_gather, each moving half its busbw's
      // bytes, so its plain figure is the harmonic mean of theirs.
      const double plain_ar = 2 / (1 / plain_rs + 1 / plain_ag);
      const bool whole_mib = options.large_bytes % (size_t{1} << 20) == 0;
      if (print) {
        std::snprintf(line, sizeof(line),
                      "# bound after: %.3f GB/s (busy %.2f CPU-s per s); plain after: "
                      "reduce_scatter %.3f, all_gather %.3f GB/s; against the higher of each, the "
                      "best busbw at >= %zu %s is:\n",
                      after.bound, after.cpu_per_rank, after.reduce_scatter, after.all_gather,
                      whole_mib ? options.large_bytes >> 20 : options.large_bytes,
                      whole_mib ? "MiB" : "B");
        out << line;
        if (shm) {
          std::snprintf(line, sizeof(line),
                        "# shm bound after: %.3f GB/s; shm copy after: %.3f GB/s\n",
                        shm_after.bound, shm_after.copy);
          out << line;
        }
        for (const auto& [c, busbw] : large) {
          const cai_comm_op op = c.op;
          if (through_shm(op)) {
            std::snprintf(line, sizeof(line),
                          "#   %-15s %8.3f GB/s %5.0f%% of the shm bound %.3f GB/s, %5.0f%% of "
                          "shm copy %.3f GB/s, %5.0f%% of the TCP bound %.3f GB/s",
                          c.name, busbw, 100 * busbw / shm_bound, shm_bound, 100 * busbw / shm_copy,
                          shm_copy, 100 * busbw / bound, bound);
          } else {
            std::snprintf(line, sizeof(line), "#   %-15s %8.3f GB/s %5.0f%% of the bound %.3f GB/s",
                          c.name, busbw, 100 * busbw / bound, bound);
          }
          out << line;
          // The plain all_gather copies its own block in, as the out-of-place one does.
          const double plain = op == CAI_COMM_ALL_REDUCE                  ? plain_ar
                               : op == CAI_COMM_REDUCE_SCATTER            ? plain_rs
                               : op == CAI_COMM_ALL_GATHER && !c.in_place ? plain_ag
                                                                          : 0;
          if (plain > 0) {
            std::snprintf(line, sizeof(line), ", %5.0f%% of plain %.3f GB/s%s", 100 * busbw / plain,
                          plain,
                          op == CAI_COMM_ALL_REDUCE ? " (its reduce_scatter then all_gather)" : "");
            out << line;
          }
          out << "\n";
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
