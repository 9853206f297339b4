#include "mem/pool.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <bit>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <new>
#include <utility>
#include <vector>

#include "core/env.h"
#include "core/status.h"
#include "core/strings.h"
#include "mem/parallel.h"

namespace cai {
namespace {

constexpr size_t kDefaultAlignment = 64;
// Largest rounding step of a size class: the granularity PyTorch's caching allocator uses for
// large blocks, so a large block wastes at most 2 MiB.
constexpr size_t kMaxClassStep = size_t{2} << 20;
// Requests above this are refused before any rounding arithmetic could overflow.
constexpr size_t kMaxRequest = size_t{1} << 56;

size_t RoundUp(size_t n, size_t step) { return (n + step - 1) / step * step; }

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

MemoryPool::MemoryPool() : nvme_dir_(DefaultNvmeDirectory()) {}

MemoryPool::~MemoryPool() {
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
                                 std::string_view tag, bool zero_fill) {
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
  const size_t capacity = RoundUp(SizeClass(bytes), align);

  cai_buffer* block = nullptr;
  std::unordered_multimap<size_t, cai_buffer*> trimmed;
  {
    std::lock_guard lock(t.mu);
    TierUsage& u = t.usage;
    const uint64_t held = u.current_bytes + u.framework_bytes;
    if (u.budget_bytes != 0 && bytes > u.budget_bytes - std::min(held, u.budget_bytes)) {
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
    auto [first, last] = t.cached.equal_range(capacity);
    for (auto it = first; it != last; ++it) {
      if (it->second->alignment >= align) {
        block = it->second;
        t.cached.erase(it);
        u.cached_bytes -= capacity;
        break;
      }
    }
    // Cached blocks do not count against the budget, but they must not push what the tier
    // really holds past it either.
    if (!block && u.budget_bytes != 0 && held + u.cached_bytes + capacity > u.budget_bytes) {
      trimmed = TakeCached(t);
    }
    u.current_bytes += bytes;
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
      block->data = MapBlock(tier, capacity, align);
    } catch (...) {
      delete block;
      std::lock_guard lock(t.mu);
      t.usage.current_bytes -= bytes;
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
  if (zero_fill) ZeroFill(block->data, bytes);
  return block;
}

void MemoryPool::Free(cai_buffer* buffer) {
  if (!buffer) return;
  Tier& t = At(buffer->tier);
  std::lock_guard lock(t.mu);
  t.usage.current_bytes -= buffer->bytes;
  --t.usage.num_allocations;
  t.usage.cached_bytes += buffer->capacity;
  t.cached.emplace(buffer->capacity, buffer);
}

void MemoryPool::SetBudget(cai_mem_tier tier, uint64_t bytes) {
  Tier& t = At(tier);
  std::unordered_multimap<size_t, cai_buffer*> trimmed;
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
  const uint64_t held = u.current_bytes + u.framework_bytes;
  if (u.budget_bytes != 0 && bytes > u.budget_bytes - std::min(held, u.budget_bytes)) return false;
  u.framework_bytes += bytes;
  u.framework_peak_bytes = std::max(u.framework_peak_bytes, u.framework_bytes);
  u.total_peak_bytes = std::max(u.total_peak_bytes, held + bytes);
  return true;
}

void MemoryPool::UnchargeFramework(uint64_t bytes) {
  Tier& t = At(CAI_MEM_DEVICE);
  std::lock_guard lock(t.mu);
  t.usage.framework_bytes -= std::min(bytes, t.usage.framework_bytes);
}

void MemoryPool::ReleaseCached(cai_mem_tier tier) {
  Tier& t = At(tier);
  std::unordered_multimap<size_t, cai_buffer*> trimmed;
  {
    std::lock_guard lock(t.mu);
    trimmed = TakeCached(t);
  }
  for (auto& [size, cached] : trimmed) {
    UnmapBlock(*cached);
    delete cached;
  }
}

std::unordered_multimap<size_t, cai_buffer*> MemoryPool::TakeCached(Tier& t) {
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

void MemoryPool::SetHostReclaimer(HostReclaimer reclaimer) { g_host_reclaimer = reclaimer; }

void* MemoryPool::MapBlock(cai_mem_tier tier, size_t capacity, size_t alignment) {
  if (tier != CAI_MEM_NVME) {
    if (HostReclaimer reclaim = g_host_reclaimer.load()) reclaim(capacity);
    void* data = nullptr;
    if (posix_memalign(&data, alignment, capacity) != 0) {
      throw Error(CAI_RESOURCE_EXHAUSTED, "the system is out of host memory: cannot allocate " +
                                              FormatByteCount(capacity) + " for memory tier " +
                                              TierName(tier));
    }
    return data;
  }
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
  void* data = mmap(nullptr, capacity, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  const int map_errno = errno;
  close(fd);
  if (data == MAP_FAILED) {
    throw Error(CAI_RESOURCE_EXHAUSTED, "cannot map " + FormatByteCount(capacity) +
                                            " of the NVMe tier's file in \"" + dir +
                                            "\": " + std::strerror(map_errno));
  }
  return data;
}

void MemoryPool::UnmapBlock(const cai_buffer& block) {
  if (block.tier == CAI_MEM_NVME) {
    munmap(block.data, block.capacity);
  } else {
    std::free(block.data);
  }
}

}  // namespace cai
