#include "comm/shm_ring.h"

#include <fcntl.h>
#include <linux/futex.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <climits>
#include <cstring>
#include <random>
#include <stdexcept>

namespace cai::comm {

namespace {

constexpr uint64_t kMagic = 0x636169'73686d'31ULL;  // "caishm1"
constexpr size_t kHeaderBytes = 4096;               // keeps the slots page-aligned

// How long a waiter sleeps before it looks at the deadline, the abort flag and the peers.
constexpr std::chrono::milliseconds kPollInterval{5};

std::string Name(uint64_t id) {
  char name[32];
  std::snprintf(name, sizeof(name), "/cai-%016llx", static_cast<unsigned long long>(id));
  return name;
}

std::string Errno(const std::string& what) { return what + ": " + std::strerror(errno); }

void FutexWait(std::atomic<uint32_t>& word, uint32_t seen, std::chrono::milliseconds timeout) {
  const timespec ts{0, static_cast<long>(timeout.count()) * 1000000L};
  // Not FUTEX_PRIVATE: the word lives in memory shared with another process.
  syscall(SYS_futex, reinterpret_cast<uint32_t*>(&word), FUTEX_WAIT, seen, &ts, nullptr, 0);
}

void FutexWake(std::atomic<uint32_t>& word) {
  syscall(SYS_futex, reinterpret_cast<uint32_t*>(&word), FUTEX_WAKE, INT_MAX, nullptr, nullptr, 0);
}

// Maps `bytes` of the shared-memory object `fd`; nullptr on failure.
void* Map(int fd, size_t bytes) {
  void* p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  return p == MAP_FAILED ? nullptr : p;
}

}  // namespace

static_assert(std::atomic<uint32_t>::is_always_lock_free);

// The outbox's first page. `seq` and `ack` sit on cache lines of their own: each is written by
// one process and read by the other.
struct ShmRing::Header {
  uint64_t magic;
  uint64_t id;  // the random id its name carries, checked by the mapping neighbour
  uint64_t slots;
  uint64_t slot_bytes;
  alignas(64) std::atomic<uint32_t> seq;  // messages the owner has published
  alignas(64) std::atomic<uint32_t> ack;  // messages the reader has consumed
  std::byte* Slot(uint32_t message) {
    return reinterpret_cast<std::byte*>(this) + kHeaderBytes + (message % slots) * slot_bytes;
  }
};

ShmRing::ShmRing(int rank, int size) : rank_(rank), size_(size) {}

ShmRing::~ShmRing() {
  if (own_ != nullptr) munmap(own_, mapped_bytes_);
  if (left_ != nullptr) munmap(left_, mapped_bytes_);
}

std::unique_ptr<ShmRing> ShmRing::Open(int rank, int size, const Exchange& all_gather,
                                       std::string* why_not) {
  std::unique_ptr<ShmRing> ring(new ShmRing(rank, size));
  ring->mapped_bytes_ = kHeaderBytes + kSlots * kSlotBytes;
  std::string problem;

  // Our outbox, under a name nobody else can guess. posix_fallocate reserves its pages now: a
  // full /dev/shm must fail here, not as SIGBUS on the first write.
  uint64_t id = std::random_device{}() | (static_cast<uint64_t>(std::random_device{}()) << 32);
  id |= 1;  // never 0, which says "failed" in the exchange
  const std::string own_name = Name(id);
  const int fd = shm_open(own_name.c_str(), O_CREAT | O_EXCL | O_RDWR, 0600);
  // The name goes once every rank has mapped or given up, or at once if this rank cannot use
  // it, or when the exchange throws (a rank lost during setup): never left in /dev/shm.
  struct Unlink {
    std::string name;
    void Now() {
      if (!name.empty()) shm_unlink(name.c_str());
      name.clear();
    }
    ~Unlink() { Now(); }
  } unlink_own{fd >= 0 ? own_name : std::string()};
  if (fd < 0) {
    problem = Errno("shm_open " + own_name);
  } else {
    if (const int err = posix_fallocate(fd, 0, static_cast<off_t>(ring->mapped_bytes_))) {
      problem = "reserving " + std::to_string(ring->mapped_bytes_) +
                " B in /dev/shm: " + std::strerror(err);
    } else if (void* p = Map(fd, ring->mapped_bytes_); p == nullptr) {
      problem = Errno("mmap " + own_name);
    } else {
      ring->own_ = static_cast<Header*>(p);
      Header* h = ring->own_;
      h->id = id;
      h->slots = kSlots;
      h->slot_bytes = kSlotBytes;
      h->seq.store(0, std::memory_order_relaxed);
      h->ack.store(0, std::memory_order_relaxed);
      std::atomic_thread_fence(std::memory_order_release);
      h->magic = kMagic;
    }
    close(fd);
    if (!problem.empty()) unlink_own.Now();  // nobody will look for it
  }

  const int64_t mine = problem.empty() ? static_cast<int64_t>(id) : 0;
  const std::vector<int64_t> ids = all_gather(std::span<const int64_t>(&mine, 1));
  const int left = (rank + size - 1) % size;
  const uint64_t left_id = static_cast<uint64_t>(ids.at(static_cast<size_t>(left)));
  if (problem.empty() && left_id == 0) {
    problem = "rank " + std::to_string(left) + " could not create its outbox";
  }
  if (problem.empty()) {
    const std::string left_name = Name(left_id);
    const int lfd = shm_open(left_name.c_str(), O_RDWR, 0);
    struct stat st {};
    if (lfd < 0) {
      problem = Errno("shm_open " + left_name + " (rank " + std::to_string(left) +
                      "'s; on another host?)");
    } else if (fstat(lfd, &st) != 0 || static_cast<size_t>(st.st_size) != ring->mapped_bytes_) {
      problem = left_name + " is not an outbox of this build's size";
    } else if (void* p = Map(lfd, ring->mapped_bytes_); p == nullptr) {
      problem = Errno("mmap " + left_name);
    } else {
      ring->left_ = static_cast<Header*>(p);
      std::atomic_thread_fence(std::memory_order_acquire);
      if (ring->left_->magic != kMagic || ring->left_->id != left_id ||
          ring->left_->slots != kSlots || ring->left_->slot_bytes != kSlotBytes) {
        problem = left_name + " does not hold rank " + std::to_string(left) + "'s outbox";
      }
    }
    if (lfd >= 0) close(lfd);
  }

  // Everyone has mapped or given up: no name is needed any more.
  const int64_t ok = problem.empty() ? 1 : 0;
  const std::vector<int64_t> verdicts = all_gather(std::span<const int64_t>(&ok, 1));
  unlink_own.Now();
  for (int r = 0; r < size && problem.empty(); ++r) {
    if (verdicts.at(static_cast<size_t>(r)) == 0) {
      problem = "rank " + std::to_string(r) + " could not create its outbox or map its neighbour's";
    }
  }
  if (!problem.empty()) {
    if (why_not != nullptr) *why_not = problem;
    return nullptr;
  }
  return ring;
}

bool ShmRing::Runs(cai_comm_op op) {
  return op == CAI_COMM_ALL_REDUCE || op == CAI_COMM_REDUCE_SCATTER || op == CAI_COMM_ALL_GATHER;
}

bool ShmRing::Runs(const OpSpec& spec) {
  return spec.input.cuda_device < 0 && spec.output.cuda_device < 0 && Runs(spec.op);
}

void ShmRing::Abort() {
  aborted_.store(true);
  if (own_ != nullptr) FutexWake(own_->ack);
  if (left_ != nullptr) FutexWake(left_->seq);
}

void ShmRing::WaitFor(std::atomic<uint32_t>& counter, uint32_t target, const char* what) {
  // Counters wrap: "reached" is a signed distance, valid while fewer than 2^31 messages
  // separate the two sides (they are never more than kSlots apart).
  auto reached = [&](uint32_t v) { return static_cast<int32_t>(v - target) >= 0; };
  for (int spin = 0; spin < 64; ++spin) {
    if (reached(counter.load(std::memory_order_acquire))) return;
  }
  for (;;) {
    const uint32_t seen = counter.load(std::memory_order_acquire);
    if (reached(seen)) return;
    if (aborted_.load()) throw std::runtime_error("shared-memory ring: aborted");
    if (std::chrono::steady_clock::now() >= deadline_) {
      throw std::runtime_error(std::string("shared-memory ring: Timed out waiting for ") + what);
    }
    if (check_ != nullptr && *check_) (*check_)();
    FutexWait(counter, seen, kPollInterval);
  }
}

std::byte* ShmRing::BeginSend() {
  // Slot sent_ % kSlots is free once the reader has consumed the message kSlots before it.
  WaitFor(own_->ack, sent_ + 1 - static_cast<uint32_t>(kSlots), "the right neighbour to read");
  return own_->Slot(sent_);
}

void ShmRing::EndSend(size_t bytes) {
  own_->seq.store(++sent_, std::memory_order_release);
  FutexWake(own_->seq);
  bytes_sent_.fetch_add(bytes, std::memory_order_relaxed);
}

const std::byte* ShmRing::BeginReceive() {
  WaitFor(left_->seq, received_ + 1, "the left neighbour's data");
  return left_->Slot(received_);
}

void ShmRing::EndReceive() {
  left_->ack.store(++received_, std::memory_order_release);
  FutexWake(left_->ack);
}

// Segment k of every chunk: step 0 sends this rank's own values of chunk r-1; step s adds the
// partial of chunk r-s-2 arriving from the left to this rank's values of it, into the outbox
// (the next step's message) or, at the last step (chunk r), into the output. The partial sums
// accumulate in the same order as the TCP ring's, so both give the same bits.
void ShmRing::ReduceScatter(const OpSpec& spec) {
  const int n = size_;
  const size_t element = DTypeSize(spec.output.dtype);
  const size_t chunk = spec.output.bytes();
  const size_t segment = kSlotBytes / element * element;
  const ReduceFn reduce = ReduceFor(spec.output.dtype, spec.reduce);
  const std::byte* in = spec.input.data;
  auto at = [&](int c) { return in + static_cast<size_t>((c % n + n) % n) * chunk; };
  for (size_t off = 0; off < chunk; off += segment) {
    const size_t len = std::min(segment, chunk - off);
    std::memcpy(BeginSend(), at(rank_ - 1) + off, len);
    EndSend(len);
    for (int s = 0; s + 1 < n; ++s) {
      const std::byte* partial = BeginReceive();
      const std::byte* local = at(rank_ - s - 2) + off;
      if (s + 2 < n) {
        reduce(BeginSend(), partial, local, len / element);
        EndReceive();
        EndSend(len);
      } else {
        std::byte* out = spec.output.data + off;
        reduce(out, partial, local, len / element);
        EndReceive();
        if (spec.reduce == CAI_REDUCE_AVG) {
          Average(Buffer{out, len / element, spec.output.dtype, -1}, n);
        }
      }
    }
  }
}

// Segment k of every block: this rank's block goes out first; step s receives block r-s-1 into
// the output and, but at the last step, forwards it.
void ShmRing::AllGather(const OpSpec& spec) {
  const int n = size_;
  const size_t block = spec.input.bytes();
  const size_t segment = kSlotBytes;
  std::byte* out = spec.output.data;
  auto at = [&](int b) { return out + static_cast<size_t>((b % n + n) % n) * block; };
  const bool in_place = spec.input.data == at(rank_);
  for (size_t off = 0; off < block; off += segment) {
    const size_t len = std::min(segment, block - off);
    if (!in_place) std::memcpy(at(rank_) + off, spec.input.data + off, len);
    std::memcpy(BeginSend(), spec.input.data + off, len);
    EndSend(len);
    for (int s = 0; s + 1 < n; ++s) {
      const std::byte* data = BeginReceive();
      std::memcpy(at(rank_ - s - 1) + off, data, len);
      if (s + 2 < n) {
        std::memcpy(BeginSend(), data, len);
        EndSend(len);
      }
      EndReceive();
    }
  }
}

// In place on the output, cut into n chunks of N*c/n..N*(c+1)/n elements: per segment, the
// reduce-scatter's steps leave chunk r reduced (averaged for AVG) in place, and the all-gather's
// steps carry every reduced chunk around. Chunks differ by at most one element, so a segment of
// one chunk may be shorter (or empty) than the same segment of another; both sides of every
// message agree on its length, as they agree on its chunk.
void ShmRing::AllReduce(const OpSpec& spec) {
  const int n = size_;
  const Buffer& buffer = spec.output;
  const size_t element = DTypeSize(buffer.dtype);
  const size_t segment = kSlotBytes / element * element;
  const ReduceFn reduce = ReduceFor(buffer.dtype, spec.reduce);
  auto begin = [&](int c) {
    const size_t cc = static_cast<size_t>((c % n + n) % n);
    return buffer.numel * cc / static_cast<size_t>(n) * element;
  };
  auto length = [&](int c, size_t off) {
    const size_t cc = static_cast<size_t>((c % n + n) % n);
    const size_t bytes = (buffer.numel * (cc + 1) / static_cast<size_t>(n)) * element - begin(c);
    return off >= bytes ? 0 : std::min(segment, bytes - off);
  };
  const size_t longest =
      (buffer.numel + static_cast<size_t>(n) - 1) / static_cast<size_t>(n) * element;
  std::byte* data = buffer.data;
  for (size_t off = 0; off < longest; off += segment) {
    size_t len = length(rank_ - 1, off);
    std::memcpy(BeginSend(), data + begin(rank_ - 1) + off, len);
    EndSend(len);
    for (int s = 0; s + 1 < n; ++s) {
      const int c = rank_ - s - 2;
      len = length(c, off);
      std::byte* local = data + begin(c) + off;
      const std::byte* partial = BeginReceive();
      if (s + 2 < n) {
        reduce(BeginSend(), partial, local, len / element);
        EndReceive();
        EndSend(len);
        continue;
      }
      reduce(local, partial, local, len / element);  // chunk r, complete
      EndReceive();
      if (spec.reduce == CAI_REDUCE_AVG) Average(Buffer{local, len / element, buffer.dtype, -1}, n);
      std::memcpy(BeginSend(), local, len);
      EndSend(len);
    }
    for (int s = 0; s + 1 < n; ++s) {
      const int c = rank_ - s - 1;
      len = length(c, off);
      const std::byte* reduced = BeginReceive();
      std::memcpy(data + begin(c) + off, reduced, len);
      if (s + 2 < n) {
        std::memcpy(BeginSend(), reduced, len);
        EndSend(len);
      }
      EndReceive();
    }
  }
}

// The operation's deadline and peer check, for as long as it runs.
class ShmRing::Scope {
 public:
  Scope(ShmRing& ring, std::chrono::milliseconds timeout, const CheckPeers& check) : ring_(ring) {
    ring_.deadline_ = std::chrono::steady_clock::now() + timeout;
    ring_.check_ = &check;
  }
  ~Scope() { ring_.check_ = nullptr; }
  Scope(const Scope&) = delete;
  Scope& operator=(const Scope&) = delete;

 private:
  ShmRing& ring_;
};

void ShmRing::Run(const OpSpec& spec, const CheckPeers& check) {
  const Scope scope(*this, spec.timeout, check);
  switch (spec.op) {
    case CAI_COMM_REDUCE_SCATTER:
      ReduceScatter(spec);
      break;
    case CAI_COMM_ALL_GATHER:
      AllGather(spec);
      break;
    default:
      AllReduce(spec);
      break;
  }
}

void ShmRing::Stream(const std::byte* src, std::byte* dst, size_t window, size_t bytes,
                     std::chrono::milliseconds timeout, const CheckPeers& check) {
  const Scope scope(*this, timeout, check);
  for (size_t off = 0; off < bytes;) {
    const size_t len = std::min({kSlotBytes, bytes - off, window - off % window});
    std::memcpy(BeginSend(), src + off % window, len);
    EndSend(len);
    std::memcpy(dst + off % window, BeginReceive(), len);
    EndReceive();
    off += len;
  }
}

}  // namespace cai::comm
