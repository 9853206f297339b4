// The counting CPU allocator behind framework_allocator.h. Everything here depends on c10's
// allocator interface as LibTorch 1.13 and 2.x define it (c10/core/Allocator.h,
// c10/core/CPUAllocator.h); if a release changes it, this is the only file to touch.
//
// Each allocation asks the allocator it replaced for kHeader more bytes and keeps, in front of
// the data, the size it counted and that allocator's own context and deleter (a cached block
// keeps them while it waits for reuse). The DataPtr it
// returns has the data pointer as its context, so the context carries the size (the deleter
// reads it from the header), and Allocator::raw_allocate, which asserts data == context, keeps
// working for the LibTorch code that uses it.
#include "model/framework_allocator.h"

#include <c10/core/Allocator.h>
#include <c10/core/CPUAllocator.h>
#include <c10/core/alignment.h>

#include <algorithm>
#include <atomic>
#include <bit>
#include <map>
#include <mutex>
#include <new>
#include <vector>

#include "core/status.h"
#include "core/strings.h"
#include "mem/pool.h"

namespace cai {
namespace {

std::atomic<uint64_t> g_current{0};
std::atomic<uint64_t> g_peak{0};
std::atomic<uint64_t> g_max{0};  // the most ever live; ResetFrameworkPeak leaves it
std::atomic<bool> g_installed{false};
std::atomic<MemoryPool*> g_charged_pool{nullptr};

struct Site {
  const char* phase = nullptr;
  int32_t unit = -1;
  const std::string* unit_name = nullptr;
};
thread_local Site t_site;

struct Header {
  void* inner_context;
  c10::DeleterFnPtr inner_deleter;  // nullptr for a block mapped here (Fresh)
  size_t bytes;         // counted: the request, or its size class for a block the cache may keep
  MemoryPool* charged;  // the pool the live block is charged to, or nullptr
};
// LibTorch's CPU allocator aligns to gAlignment (64 bytes, for AVX-512): a header of that size
// keeps the data aligned as it would have been.
constexpr size_t kHeader = c10::gAlignment;
static_assert(sizeof(Header) <= kHeader);

// Blocks from 1 MiB are rounded up to a size class (eight per power of two, at most 12.5%
// more) so that a freed block serves any later request of its class. Smaller ones stay with
// glibc, whose heap reuses them without returning them to the kernel.
constexpr size_t kCacheMin = size_t{1} << 20;

size_t SizeClass(size_t bytes) {
  if (bytes < kCacheMin) return bytes;
  const size_t step = (size_t{1} << (std::bit_width(bytes) - 1)) / 8;
  return (bytes + step - 1) / step * step;
}

// Freed large blocks kept for reuse, as PyTorch's CUDA caching allocator keeps device memory:
// every step allocates the same activation buffers, and memory handed back to the kernel is
// page-faulted in again on the next step (on a virtual machine, where a fault costs
// microseconds, a third of a rank's time). The cache keeps a block only while the blocks
// live and cached together stay within a quarter above the most ever live at once, so the
// process never holds much more than it did at its peak without the cache. The quarter is
// room for the blocks of other classes it holds: with none, a step's mix of classes sent a few
// blocks back to the kernel and faulted them in again every step (a 0.84M-parameter DDP job
// took twice the page faults); with an eighth, ZeRO-2 at 30M parameters in bf16 sent back the
// 208 MiB softmax of its 50,304-word vocabulary twice a step, while the 2-6 MiB blocks of the
// backward pass filled the room (bench/README.md).
struct Cache {
  std::mutex mutex;
  std::map<size_t, std::vector<char*>> free;  // size class -> headers of free blocks
  uint64_t cached_bytes = 0;
  bool enabled = true;
};
Cache& TheCache() {
  static Cache* cache = new Cache;  // outlives every static tensor freed at exit
  return *cache;
}

void Count(uint64_t bytes) {
  const uint64_t now = g_current.fetch_add(bytes, std::memory_order_relaxed) + bytes;
  for (auto* high : {&g_peak, &g_max}) {
    uint64_t seen = high->load(std::memory_order_relaxed);
    while (now > seen && !high->compare_exchange_weak(seen, now, std::memory_order_relaxed)) {
    }
  }
}

void Release(char* base) {
  const Header header = *reinterpret_cast<const Header*>(base);
  if (header.inner_deleter != nullptr) {
    header.inner_deleter(header.inner_context);
  } else {
    UnmapHostPages(base, header.bytes + kHeader);
  }
}

// The device out-of-memory error of a request `pool`'s DEVICE budget has no room for, naming
// the allocation site of this thread.
[[noreturn]] void ThrowOverBudget(const MemoryPool& pool, size_t bytes) {
  const TierUsage u = pool.Usage(CAI_MEM_DEVICE);
  const Site& site = t_site;
  std::string what = site.phase ? site.phase : "an operation outside the training step";
  if (site.unit >= 0) {
    what += " of unit " + std::to_string(site.unit);
    if (site.unit_name) what += " ('" + *site.unit_name + "')";
  }
  throw Error(CAI_RESOURCE_EXHAUSTED,
              "device out of memory: cannot allocate " + FormatByteCount(bytes) +
                  " for LibTorch's tensors in " + what + " on memory tier DEVICE: its budget is " +
                  FormatByteCount(u.budget_bytes) + ", of which LibTorch holds " +
                  FormatByteCount(u.framework_bytes) + " and the strategy's buffers " +
                  FormatByteCount(u.current_bytes) + " (" + std::to_string(u.num_allocations) +
                  " buffers). Lower the micro-batch (train.global_batch, train.grad_accum), turn "
                  "on model.activation_checkpointing, choose a strategy that shards or offloads "
                  "more, or raise memory.device_budget");
}

void Uncharge(const Header& header) {
  if (header.charged != nullptr) header.charged->UnchargeFramework(header.bytes);
}

void Delete(void* data) {
  char* base = static_cast<char*>(data) - kHeader;
  Uncharge(*reinterpret_cast<const Header*>(base));
  const size_t bytes = reinterpret_cast<const Header*>(base)->bytes;
  const uint64_t live = g_current.fetch_sub(bytes, std::memory_order_relaxed) - bytes;
  if (bytes >= kCacheMin) {
    Cache& cache = TheCache();
    std::lock_guard lock(cache.mutex);
    const uint64_t most = g_max.load(std::memory_order_relaxed);
    if (cache.enabled && live + cache.cached_bytes + bytes <= most + most / 4) {
      cache.free[bytes].push_back(base);
      cache.cached_bytes += bytes;
      return;
    }
  }
  Release(base);
}

// A cached block of the smallest class from `bytes` to `largest` (a larger one's pages are
// resident already, where a new block would fault in every page), or nullptr.
char* Reuse(size_t bytes, size_t largest) {
  Cache& cache = TheCache();
  std::lock_guard lock(cache.mutex);
  for (auto it = cache.free.lower_bound(bytes); it != cache.free.end() && it->first <= largest;
       ++it) {
    if (it->second.empty()) continue;
    char* base = it->second.back();
    it->second.pop_back();
    cache.cached_bytes -= it->first;
    return base;
  }
  return nullptr;
}

class CountingAllocator final : public c10::Allocator {
 public:
  explicit CountingAllocator(c10::Allocator* inner) : inner_(inner) {}

  c10::DataPtr allocate(size_t bytes) const override {
    if (bytes == 0) return inner_->allocate(0);  // nothing to count; no memory behind it
    size_t counted = SizeClass(bytes);
    MemoryPool* pool = g_charged_pool.load(std::memory_order_acquire);
    char* base = nullptr;
    // Without a DEVICE budget a request may take a cached block of a larger class, which then
    // counts at its own class (what its free subtracts). Under one it takes only its own class,
    // so that the budget holds what it held before the cache.
    // The budget is read (under the pool's lock) only for a block the cache may serve.
    if (counted >= kCacheMin &&
        (pool == nullptr || pool->Usage(CAI_MEM_DEVICE).budget_bytes == 0) &&
        (base = Reuse(counted, 2 * counted)) != nullptr) {
      counted = reinterpret_cast<const Header*>(base)->bytes;
    }
    // Charged before any memory is taken, so a request over the budget takes none.
    if (pool != nullptr && !pool->TryChargeFramework(counted)) {
      if (base != nullptr) Release(base);  // a budget set since the check above
      ThrowOverBudget(*pool, counted);
    }
    if (base == nullptr && counted >= kCacheMin) base = Reuse(counted, counted);
    try {
      if (base == nullptr) base = Fresh(counted);
    } catch (...) {
      if (pool != nullptr) pool->UnchargeFramework(counted);
      throw;
    }
    reinterpret_cast<Header*>(base)->charged = pool;  // the free uncharges the same pool
    Count(counted);
    char* data = base + kHeader;
    return {data, data, &Delete, c10::Device(c10::DeviceType::CPU)};
  }

  c10::DeleterFnPtr raw_deleter() const override { return &Delete; }

 private:
  char* Fresh(size_t bytes) const {
    if (bytes >= kCacheMin) return Map(bytes);
    c10::DataPtr block;
    try {
      block = inner_->allocate(bytes + kHeader);
    } catch (const c10::Error&) {
      // What the cache keeps may be what is missing: give it back and try once more.
      if (EmptyFrameworkCache() == 0) throw;
      block = inner_->allocate(bytes + kHeader);
    }
    char* base = static_cast<char*>(block.get());
    const c10::DeleterFnPtr inner_deleter = block.get_deleter();
    void* inner_context = block.release_context();  // the header owns it from here
    new (base) Header{inner_context, inner_deleter, bytes, nullptr};
    return base;
  }

  // A cacheable block straight from the kernel, so that one freed past the cache's bound goes
  // back to it. From glibc's heap (with the trainer's raised trim threshold) freed blocks
  // stayed resident between live ones: gigabytes of RSS at a billion parameters that no
  // count saw.
  static char* Map(size_t bytes) {
    void* p = MapHostPages(bytes + kHeader);
    // What the cache keeps may be what is missing: give it back and try once more.
    if (p == nullptr && EmptyFrameworkCache() != 0) p = MapHostPages(bytes + kHeader);
    TORCH_CHECK(p != nullptr, "cannot allocate ", bytes, " bytes of CPU memory for a tensor");
    char* base = static_cast<char*>(p);
    new (base) Header{nullptr, nullptr, bytes, nullptr};
    return base;
  }

  c10::Allocator* inner_;
};

}  // namespace

void InstallFrameworkAllocator() {
  static std::once_flag once;
  std::call_once(once, [] {
    static CountingAllocator counting(c10::GetCPUAllocator());
    // Priority 1 beats the default allocator's registration (0), so a static initialiser that
    // registers again at the default priority cannot put the uncounted one back.
    c10::SetCPUAllocator(&counting, /*priority=*/1);
    g_installed = true;
  });
}

bool FrameworkAllocatorInstalled() { return g_installed; }

void SetFrameworkCaching(bool enabled) {
  {
    std::lock_guard lock(TheCache().mutex);
    TheCache().enabled = enabled;
  }
  if (!enabled) EmptyFrameworkCache();
}

uint64_t TrimFrameworkCache(uint64_t bytes) {
  std::vector<char*> released;
  uint64_t freed = 0;
  {
    Cache& cache = TheCache();
    std::lock_guard lock(cache.mutex);
    // The smallest block that covers the request alone: giving back the largest first, FSDP's
    // 3.5 MiB gather buffers took the 208 MiB softmax, which the next step faulted in again.
    for (auto it = cache.free.lower_bound(bytes); it != cache.free.end(); ++it) {
      if (it->second.empty()) continue;
      released.push_back(it->second.back());
      it->second.pop_back();
      freed = it->first;
      break;
    }
    for (auto it = cache.free.rbegin(); it != cache.free.rend() && freed < bytes; ++it) {
      auto& bases = it->second;
      while (!bases.empty() && freed < bytes) {
        released.push_back(bases.back());
        bases.pop_back();
        freed += it->first;
      }
    }
    cache.cached_bytes -= freed;
  }
  for (char* base : released) Release(base);
  return freed;
}

uint64_t EmptyFrameworkCache() { return TrimFrameworkCache(UINT64_MAX); }

void ChargeFrameworkTo(MemoryPool* pool) { g_charged_pool.store(pool, std::memory_order_release); }

bool ChargeExistingBlock(void* data, void (*deleter)(void*)) {
  MemoryPool* pool = g_charged_pool.load(std::memory_order_acquire);
  if (pool == nullptr || data == nullptr || deleter != &Delete) return false;
  auto* header = reinterpret_cast<Header*>(static_cast<char*>(data) - kHeader);
  if (header->charged != nullptr) return false;
  if (!pool->TryChargeFramework(header->bytes)) ThrowOverBudget(*pool, header->bytes);
  header->charged = pool;
  return true;
}

AllocationSite::AllocationSite(const char* phase, int32_t unit, const std::string* unit_name)
    : saved_phase_(t_site.phase), saved_unit_(t_site.unit), saved_name_(t_site.unit_name) {
  Set(phase, unit, unit_name);
}

AllocationSite::~AllocationSite() { t_site = {saved_phase_, saved_unit_, saved_name_}; }

void AllocationSite::Set(const char* phase, int32_t unit, const std::string* unit_name) {
  t_site = {phase, unit, unit_name};
}

FrameworkMemory FrameworkMemoryUsage() {
  uint64_t cached = 0;
  {
    std::lock_guard lock(TheCache().mutex);
    cached = TheCache().cached_bytes;
  }
  return {g_current.load(std::memory_order_relaxed), g_peak.load(std::memory_order_relaxed), cached,
          g_max.load(std::memory_order_relaxed)};
}

void ResetFrameworkPeak() { g_peak = g_current.load(std::memory_order_relaxed); }

}  // namespace cai
