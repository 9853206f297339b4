#include "mem/pool.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <bit>
#include <cerrno>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <new>
#include <thread>
#include <utility>
#include <vector>

#include "core/env.h"
#include "core/status.h"
#include "core/strings.h"
#include "mem/kernels.h"
#include "mem/parallel.h"

namespace cai {
namespace {

constexpr size_t kDefaultAlignment = 64;
// Largest rounding step of a size class: the granularity PyTorch's caching allocator uses for
// large blocks, so a large block wastes at most 2 MiB.
constexpr size_t kMaxClassStep = size_t{2} << 20;
// What O_DIRECT needs aligned (file offsets, lengths, memory): the largest logical block size
// in use, so one value serves every disk.
constexpr size_t kDirectBlock = 4096;
// Staging for the parts of a transfer that are not block-aligned, per thread.
constexpr size_t kStagingBytes = size_t{4} << 20;
// Requests above this are refused before any rounding arithmetic could overflow.
constexpr size_t kMaxRequest = size_t{1} << 56;
// Host blocks from this size are mapped from the kernel rather than taken from glibc's heap:
// a block freed past the pool's cache then goes back to the kernel at once. From the heap it
// stayed resident as free space between live allocations, and with the trainer's raised trim
// threshold a rank's RSS grew by gigabytes that no accounting saw (bench/README.md).
constexpr size_t kMappedMin = size_t{1} << 20;

constexpr size_t kHugePage = size_t{2} << 20;

bool Mapped(size_t capacity, size_t alignment) {
  static const size_t page = static_cast<size_t>(sysconf(_SC_PAGESIZE));
  return capacity >= kMappedMin && alignment <= page;
}

size_t RoundUp(size_t n, size_t step) { return (n + step - 1) / step * step; }

// Whether `bytes` more would take the tier past its budget, counting its buffers and, on
// DEVICE, LibTorch's tensors.
bool OverBudget(const TierUsage& u, uint64_t bytes) {
  const uint64_t held = u.current_bytes + u.framework_bytes;
  return u.budget_bytes != 0 && bytes > u.budget_bytes - std::min(held, u.budget_bytes);
}

// Size classes 1/8 of a power of two apart (at least 64 bytes, at most 2 MiB): a reused block
// is at most 12.5% larger than the request.
size_t SizeClass(size_t bytes) {
  const size_t step = std::clamp<size_t>(std::bit_floor(bytes) / 8, 64, kMaxClassStep);
  return RoundUp(bytes, step);
}

std::string DefaultNvmeDirectory() {
  // A data path, not code: secure_getenv only, no trust checks.
  const char* tmp = SecureGetenv("TMPDIR");
  return tmp ? tmp : "/tmp";
}

size_t PageSize() { return static_cast<size_t>(sysconf(_SC_PAGESIZE)); }

void ZeroFill(void* data, size_t bytes) {
  ParallelFor(bytes, 4096,
              [&](size_t b, size_t e) { std::memset(static_cast<char*>(data) + b, 0, e - b); });
}

}  // namespace

std::string TierName(cai_mem_tier tier) {
  switch (tier) {
    case CAI_MEM_DEVICE:
      return "DEVICE";
    case CAI_MEM_PINNED_HOST:
      return "PINNED_HOST";
    case CAI_MEM_HOST:
      return "HOST";
    case CAI_MEM_NVME:
      return "NVME";
    default:
      return "tier " + std::to_string(tier);
  }
}

// One thread running copies in submission order; its destructor finishes what was submitted.
struct MemoryPool::CopyQueue {
  std::mutex mu;
  std::condition_variable ready;
  std::deque<std::packaged_task<void()>> tasks;
  bool stopping = false;
  std::thread worker{[this] {
    for (;;) {
      std::packaged_task<void()> task;
      {
        std::unique_lock lock(mu);
        ready.wait(lock, [&] { return stopping || !tasks.empty(); });
        if (tasks.empty()) return;
        task = std::move(tasks.front());
        tasks.pop_front();
      }
      task();
    }
  }};
  ~CopyQueue() {
    {
      std::lock_guard lock(mu);
      stopping = true;
    }
    ready.notify_one();
    worker.join();
  }
};

MemoryPool::MemoryPool() : nvme_dir_(DefaultNvmeDirectory()) {}

MemoryPool::~MemoryPool() {
  copies_.reset();  // submitted copies finish first: they may use the cached blocks' memory
  for (int tier = 0; tier < CAI_MEM_NUM_TIERS; ++tier) ReleaseCached(tier);
}

MemoryPool& MemoryPool::Global() {
  static MemoryPool* const pool = new MemoryPool;
  return *pool;
}

MemoryPool::Tier& MemoryPool::At(cai_mem_tier tier) {
  return const_cast<Tier&>(static_cast<const MemoryPool*>(this)->At(tier));
}

const MemoryPool::Tier& MemoryPool::At(cai_mem_tier tier) const {
  if (tier < 0 || tier >= CAI_MEM_NUM_TIERS) {
    throw Error(CAI_INVALID_ARGUMENT,
                "invalid memory tier " + std::to_string(tier) +
                    ": expected DEVICE (0), PINNED_HOST (1), HOST (2) or NVME (3)");
  }
  return tiers_[static_cast<size_t>(tier)];
}

cai_buffer* MemoryPool::Allocate(cai_mem_tier tier, size_t bytes, size_t alignment,
                                 std::string_view tag, bool zero_fill, bool unmapped) {
  Tier& t = At(tier);
  const std::string name = TierName(tier);
  if (bytes == 0) throw Error(CAI_INVALID_ARGUMENT, "cannot allocate 0 bytes on tier " + name);
  if (bytes > kMaxRequest) {
    throw Error(CAI_RESOURCE_EXHAUSTED,
                "cannot allocate " + FormatByteCount(bytes) + " on tier " + name + ": too large");
  }
  if (!std::has_single_bit(alignment) && alignment != 0) {
    throw Error(CAI_INVALID_ARGUMENT, "alignment " + std::to_string(alignment) +
                                          " requested on tier " + name +
                                          " is not a power of two (0 means 64 bytes)");
  }
  const size_t align = std::max(alignment, kDefaultAlignment);
  if (tier == CAI_MEM_NVME && align > PageSize()) {
    throw Error(CAI_INVALID_ARGUMENT, "alignment " + std::to_string(align) +
                                          " exceeds the page size (" + std::to_string(PageSize()) +
                                          "), the most the NVMe tier's file mappings give");
  }
  if (unmapped && tier != CAI_MEM_NVME) {
    throw Error(CAI_INVALID_ARGUMENT, "an unmapped block was requested on tier " + name +
                                          ": only NVME blocks can be unmapped (files without an "
                                          "address); allocate this one mapped");
  }
  // Unmapped blocks are whole direct-I/O blocks of their file, and not cached.
  const size_t capacity =
      unmapped ? RoundUp(bytes, kDirectBlock) : RoundUp(SizeClass(bytes), align);

  cai_buffer* block = nullptr;
  std::multimap<size_t, cai_buffer*> trimmed;
  {
    std::lock_guard lock(t.mu);
    TierUsage& u = t.usage;
    const uint64_t held = u.current_bytes + u.framework_bytes;
    if (OverBudget(u, bytes)) {
      throw Error(
          CAI_RESOURCE_EXHAUSTED,
          "cannot allocate " + FormatByteCount(bytes) +
              (tag.empty() ? std::string() : " for \"" + std::string(tag) + "\"") +
              " on memory tier " + name + ": its budget is " + FormatByteCount(u.budget_bytes) +
              " and " + FormatByteCount(u.current_bytes) + " are in use by " +
              std::to_string(u.num_allocations) + " buffers" +
              (u.framework_bytes == 0 ? std::string()
                                      : " and " + FormatByteCount(u.framework_bytes) +
                                            " by LibTorch's tensors (activations, temporaries)") +
              ". Free buffers on this tier, offload to another tier, or raise the "
              "budget (memory.device_budget / host_budget, cai_mem_api.set_budget)");
    }
    // Its own class first; failing that, the smallest cached block up to twice it, whose pages
    // are resident already where a new block would fault in every one of them.
    for (auto it = unmapped ? t.cached.end() : t.cached.lower_bound(capacity);
         it != t.cached.end() && it->first <= 2 * capacity; ++it) {
      if (it->second->alignment >= align) {
        block = it->second;
        t.cached.erase(it);
        u.cached_bytes -= block->capacity;
        break;
      }
    }
    // Cached blocks do not count against the budget, but they must not push what the tier
    // really holds past it either.
    if (!block && u.budget_bytes != 0 && held + u.cached_bytes + capacity > u.budget_bytes) {
      trimmed = TakeCached(t);
    }
    u.current_bytes += bytes;
    t.live_capacity += block ? block->capacity : capacity;
    t.max_live_capacity = std::max(t.max_live_capacity, t.live_capacity);
    u.peak_bytes = std::max(u.peak_bytes, u.current_bytes);
    u.total_peak_bytes = std::max(u.total_peak_bytes, u.current_bytes + u.framework_bytes);
    ++u.num_allocations;
  }
  for (auto& [size, cached] : trimmed) {
    UnmapBlock(*cached);
    delete cached;
  }

  if (!block) {
    try {
      block = new cai_buffer;
      if (unmapped) {
        block->fd = CreateNvmeFile(capacity);
        // O_DIRECT keeps the bytes out of the page cache too; a filesystem without it (tmpfs)
        // still keeps them out of the process, pwrite never maps them in.
        const int flags = fcntl(block->fd, F_GETFL);
        block->direct_io = flags >= 0 && fcntl(block->fd, F_SETFL, flags | O_DIRECT) == 0;
      } else {
        block->data = MapBlock(tier, capacity, align);
      }
    } catch (...) {
      delete block;
      std::lock_guard lock(t.mu);
      t.usage.current_bytes -= bytes;
      t.live_capacity -= capacity;
      --t.usage.num_allocations;
      throw;
    }
    block->capacity = capacity;
    block->alignment = align;
    block->tier = tier;
  }
  block->bytes = bytes;
  block->tag.assign(tag);
  for (size_t i = 0; i < 4; ++i) block->elements[i] = static_cast<int64_t>(bytes >> i);
  if (zero_fill && block->data) ZeroFill(block->data, bytes);  // a new file reads as zeros
  return block;
}

void MemoryPool::Free(cai_buffer* buffer) {
  if (!buffer) return;
  Tier& t = At(buffer->tier);
  {
    std::lock_guard lock(t.mu);
    t.usage.current_bytes -= buffer->bytes;
    t.live_capacity -= buffer->capacity;
    --t.usage.num_allocations;
    // Kept for reuse only while the blocks in use and cached together stay within an eighth
    // above the most ever in use: one block per size class and concurrent use, without a
    // bound, holds the sum of every class's peak, which a strategy whose buffer sizes vary
    // (ZeRO-3's chunks, staging of several sizes) sees grow step after step. The eighth is
    // room for blocks of other classes: with none, FSDP's mix of unit sizes sent blocks back
    // every step, and each came back as fresh pages to fault in and zero (bench/README.md).
    const uint64_t bound = t.max_live_capacity + t.max_live_capacity / 8;
    const uint64_t held = t.usage.current_bytes + t.usage.framework_bytes;
    if (buffer->fd < 0 && t.live_capacity + t.usage.cached_bytes + buffer->capacity <= bound &&
        (t.usage.budget_bytes == 0 ||
         held + t.usage.cached_bytes + buffer->capacity <= t.usage.budget_bytes)) {
      t.usage.cached_bytes += buffer->capacity;
      t.cached.emplace(buffer->capacity, buffer);
      return;
    }
  }
  UnmapBlock(*buffer);
  delete buffer;
}

void MemoryPool::SetBudget(cai_mem_tier tier, uint64_t bytes) {
  Tier& t = At(tier);
  std::multimap<size_t, cai_buffer*> trimmed;
  {
    std::lock_guard lock(t.mu);
    TierUsage& u = t.usage;
    if (bytes != 0 && bytes < u.current_bytes + u.framework_bytes) {
      throw Error(CAI_FAILED_PRECONDITION,
                  "cannot set the budget of memory tier " + TierName(tier) + " to " +
                      FormatByteCount(bytes) + ": " + FormatByteCount(u.current_bytes) +
                      " are in use by its buffers" +
                      (u.framework_bytes == 0 ? std::string()
                                              : " and " + FormatByteCount(u.framework_bytes) +
                                                    " by LibTorch's tensors") +
                      ". Free buffers on this tier first, or give a larger budget");
    }
    u.budget_bytes = bytes;
    if (bytes != 0 && u.current_bytes + u.cached_bytes > bytes) trimmed = TakeCached(t);
  }
  for (auto& [size, cached] : trimmed) {
    UnmapBlock(*cached);
    delete cached;
  }
}

TierUsage MemoryPool::Usage(cai_mem_tier tier) const {
  const Tier& t = At(tier);
  std::lock_guard lock(t.mu);
  return t.usage;
}

void MemoryPool::ResetPeak(cai_mem_tier tier) {
  Tier& t = At(tier);
  std::lock_guard lock(t.mu);
  t.usage.peak_bytes = t.usage.current_bytes;
  t.usage.framework_peak_bytes = t.usage.framework_bytes;
  t.usage.total_peak_bytes = t.usage.current_bytes + t.usage.framework_bytes;
}

bool MemoryPool::TryChargeFramework(uint64_t bytes) {
  Tier& t = At(CAI_MEM_DEVICE);
  std::lock_guard lock(t.mu);
  TierUsage& u = t.usage;
  if (OverBudget(u, bytes)) return false;
  u.framework_bytes += bytes;
  u.framework_peak_bytes = std::max(u.framework_peak_bytes, u.framework_bytes);
  u.total_peak_bytes = std::max(u.total_peak_bytes, u.current_bytes + u.framework_bytes);
  return true;
}

void MemoryPool::UnchargeFramework(uint64_t bytes) {
  Tier& t = At(CAI_MEM_DEVICE);
  std::lock_guard lock(t.mu);
  t.usage.framework_bytes -= std::min(bytes, t.usage.framework_bytes);
}

void MemoryPool::ReleaseCached(cai_mem_tier tier) {
  Tier& t = At(tier);
  std::multimap<size_t, cai_buffer*> trimmed;
  {
    std::lock_guard lock(t.mu);
    trimmed = TakeCached(t);
  }
  for (auto& [size, cached] : trimmed) {
    UnmapBlock(*cached);
    delete cached;
  }
}

std::multimap<size_t, cai_buffer*> MemoryPool::TakeCached(Tier& t) {
  t.usage.cached_bytes = 0;
  return std::exchange(t.cached, {});
}

void MemoryPool::SetNvmeDirectory(const std::string& dir) {
  struct stat st {};
  if (dir.empty() || stat(dir.c_str(), &st) != 0 || !S_ISDIR(st.st_mode) ||
      access(dir.c_str(), W_OK | X_OK) != 0) {
    throw Error(CAI_INVALID_ARGUMENT, "NVMe directory \"" + dir +
                                          "\" is not a writable directory: give an existing "
                                          "directory on the disk that should hold offloaded data");
  }
  std::lock_guard lock(nvme_mu_);
  nvme_dir_ = dir;
}

std::string MemoryPool::NvmeDirectory() const {
  std::lock_guard lock(nvme_mu_);
  return nvme_dir_;
}

namespace {
std::atomic<MemoryPool::HostReclaimer> g_host_reclaimer{nullptr};
}  // namespace

void* MapHostPages(size_t bytes) {
  void* data = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (data == MAP_FAILED) return nullptr;
  // Advice only: a kernel without transparent huge pages maps 4 KiB pages as before.
  if (bytes >= kHugePage) madvise(data, bytes, MADV_HUGEPAGE);
  return data;
}

void UnmapHostPages(void* data, size_t bytes) { munmap(data, bytes); }

void MemoryPool::SetHostReclaimer(HostReclaimer reclaimer) { g_host_reclaimer = reclaimer; }

void* MemoryPool::MapBlock(cai_mem_tier tier, size_t capacity, size_t alignment) {
  if (tier != CAI_MEM_NVME) {
    const bool mapped = Mapped(capacity, alignment);
    // Below kMappedMin a block comes from glibc's heap, whose free space covers it.
    if (HostReclaimer reclaim = g_host_reclaimer.load(); reclaim && mapped) reclaim(capacity);
    void* data = nullptr;
    if (mapped) {
      data = MapHostPages(capacity);
    } else if (posix_memalign(&data, alignment, capacity) != 0) {
      data = nullptr;
    }
    if (data == nullptr) {
      throw Error(CAI_RESOURCE_EXHAUSTED, "the system is out of host memory: cannot allocate " +
                                              FormatByteCount(capacity) + " for memory tier " +
                                              TierName(tier));
    }
    return data;
  }
  const int fd = CreateNvmeFile(capacity);
  void* data = mmap(nullptr, capacity, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  const int map_errno = errno;
  close(fd);
  if (data == MAP_FAILED) {
    throw Error(CAI_RESOURCE_EXHAUSTED, "cannot map " + FormatByteCount(capacity) +
                                            " of the NVMe tier's file in \"" + NvmeDirectory() +
                                            "\": " + std::strerror(map_errno));
  }
  return data;
}

int MemoryPool::CreateNvmeFile(size_t capacity) const {
  const std::string dir = NvmeDirectory();
  std::string path = dir + "/cai-nvme-XXXXXX";
  const int fd = mkstemp(path.data());
  if (fd < 0) {
    throw Error(CAI_FAILED_PRECONDITION,
                "cannot create the NVMe tier's backing file in \"" + dir +
                    "\": " + std::strerror(errno) +
                    ". Set the NVMe directory to a writable directory on a fast disk");
  }
  // Unlinked at once: the mapping keeps the space until munmap, and a crash leaves nothing.
  unlink(path.c_str());
  // Reserve the disk space now, so a full disk is an error here rather than SIGBUS on a
  // later write through the mapping.
  const int err = posix_fallocate(fd, 0, static_cast<off_t>(capacity));
  if (err != 0) {
    close(fd);
    throw Error(CAI_RESOURCE_EXHAUSTED,
                "cannot reserve " + FormatByteCount(capacity) + " for the NVMe tier in \"" + dir +
                    "\": " + std::strerror(err) + ". Free disk space or choose another directory");
  }
  return fd;
}

void MemoryPool::UnmapBlock(const cai_buffer& block) {
  if (block.fd >= 0) {
    close(block.fd);
  } else if (block.tier == CAI_MEM_NVME || Mapped(block.capacity, block.alignment)) {
    UnmapHostPages(block.data, block.capacity);
  } else {
    std::free(block.data);
  }
}

namespace {

// Whole blocks of an unmapped NVMe file, `bytes` at block-aligned `offset` (both multiples
// of kDirectBlock, `memory` aligned to it), moved with pread/pwrite until done.
void DirectIo(const cai_buffer& b, bool write, size_t offset, char* memory, size_t bytes) {
  while (bytes > 0) {
    const ssize_t n = write ? pwrite(b.fd, memory, bytes, static_cast<off_t>(offset))
                            : pread(b.fd, memory, bytes, static_cast<off_t>(offset));
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      const int err = n < 0 ? errno : EIO;
      throw Error(err == ENOSPC ? CAI_RESOURCE_EXHAUSTED : CAI_INTERNAL,
                  std::string("cannot ") + (write ? "write " : "read ") + FormatByteCount(bytes) +
                      " at offset " + std::to_string(offset) + " of the NVMe tier's file for \"" +
                      b.tag + "\": " + std::strerror(err));
    }
    offset += static_cast<size_t>(n);
    memory += n;
    bytes -= static_cast<size_t>(n);
  }
}

char* Staging() {
  struct Buffer {
    char* data = nullptr;
    ~Buffer() { std::free(data); }
  };
  thread_local Buffer staging;
  if (staging.data == nullptr) {
    void* p = nullptr;
    if (posix_memalign(&p, kDirectBlock, kStagingBytes) != 0) throw std::bad_alloc();
    staging.data = static_cast<char*>(p);
  }
  return staging.data;
}

// Moves [offset, offset + bytes) of an unmapped block to or from `memory`: aligned ranges
// straight from the caller's memory, the rest through a block-aligned staging buffer (a write
// that covers part of a block reads the block first, so its other bytes stay).
void FileTransfer(const cai_buffer& b, bool write, size_t offset, char* memory, size_t bytes) {
  const auto aligned = [](size_t v) { return v % kDirectBlock == 0; };
  if (aligned(offset) && aligned(bytes) && aligned(reinterpret_cast<uintptr_t>(memory))) {
    DirectIo(b, write, offset, memory, bytes);
    return;
  }
  char* staging = Staging();
  while (bytes > 0) {
    const size_t start = offset / kDirectBlock * kDirectBlock;
    const size_t head = offset - start;
    const size_t take = std::min(bytes, kStagingBytes - head);
    const size_t span = RoundUp(head + take, kDirectBlock);
    if (write) {
      if (head != 0 || take % kDirectBlock != 0) DirectIo(b, false, start, staging, span);
      std::memcpy(staging + head, memory, take);
      DirectIo(b, true, start, staging, span);
    } else {
      DirectIo(b, false, start, staging, span);
      std::memcpy(memory, staging + head, take);
    }
    offset += take;
    memory += take;
    bytes -= take;
  }
}

void CheckRange(const cai_buffer* b, size_t offset, size_t bytes, const void* memory,
                const char* what) {
  if (b == nullptr) throw Error(CAI_INVALID_ARGUMENT, std::string(what) + ": buffer is NULL");
  if (bytes > 0 && memory == nullptr) {
    throw Error(CAI_INVALID_ARGUMENT, std::string(what) + ": memory is NULL");
  }
  if (offset > b->bytes || bytes > b->bytes - offset) {
    throw Error(CAI_INVALID_ARGUMENT, std::string(what) + " of " + std::to_string(bytes) +
                                          " bytes at offset " + std::to_string(offset) +
                                          " runs past the end of the " + std::to_string(b->bytes) +
                                          "-byte buffer" +
                                          (b->tag.empty() ? std::string() : " \"" + b->tag + "\""));
  }
}

}  // namespace

void MemoryPool::Write(cai_buffer* buffer, size_t offset, const void* src, size_t bytes) {
  CheckRange(buffer, offset, bytes, src, "write");
  if (bytes == 0) return;
  if (buffer->fd >= 0) {
    FileTransfer(*buffer, true, offset, const_cast<char*>(static_cast<const char*>(src)), bytes);
  } else {
    ParallelMemcpy(static_cast<char*>(buffer->data) + offset, src, bytes);
  }
}

void MemoryPool::Read(const cai_buffer* buffer, size_t offset, void* dst, size_t bytes) {
  CheckRange(buffer, offset, bytes, dst, "read");
  if (bytes == 0) return;
  if (buffer->fd >= 0) {
    FileTransfer(*buffer, false, offset, static_cast<char*>(dst), bytes);
  } else {
    ParallelMemcpy(dst, static_cast<const char*>(buffer->data) + offset, bytes);
  }
}

std::future<void> MemoryPool::Submit(std::function<void()> copy) {
  std::packaged_task<void()> task(std::move(copy));
  std::future<void> done = task.get_future();
  CopyQueue* queue = nullptr;
  {
    std::lock_guard lock(copy_mu_);
    if (!copies_) copies_ = std::make_unique<CopyQueue>();
    queue = copies_.get();
  }
  {
    std::lock_guard lock(queue->mu);
    queue->tasks.push_back(std::move(task));
  }
  queue->ready.notify_one();
  return done;
}

}  // namespace cai
