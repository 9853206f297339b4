// The counting CPU allocator behind framework_allocator.h. Everything here depends on c10's
// allocator interface as LibTorch 1.13 and 2.x define it (c10/core/Allocator.h,
// c10/core/CPUAllocator.h); if a release changes it, this is the only file to touch.
//
// Each allocation asks the allocator it replaced for kHeader more bytes and keeps, in front of
// the data, the size it counted and that allocator's own context and deleter. The DataPtr it
// returns has the data pointer as its context, so the context carries the size (the deleter
// reads it from the header), and Allocator::raw_allocate, which asserts data == context, keeps
// working for the LibTorch code that uses it.
#include "model/framework_allocator.h"

#include <c10/core/Allocator.h>
#include <c10/core/CPUAllocator.h>
#include <c10/core/alignment.h>

#include <atomic>
#include <mutex>
#include <new>

namespace cai {
namespace {

std::atomic<uint64_t> g_current{0};
std::atomic<uint64_t> g_peak{0};
std::atomic<bool> g_installed{false};

struct Header {
  void* inner_context;
  c10::DeleterFnPtr inner_deleter;
  size_t bytes;
};
// LibTorch's CPU allocator aligns to gAlignment (64 bytes, for AVX-512): a header of that size
// keeps the data aligned as it would have been.
constexpr size_t kHeader = c10::gAlignment;
static_assert(sizeof(Header) <= kHeader);

void Count(uint64_t bytes) {
  const uint64_t now = g_current.fetch_add(bytes, std::memory_order_relaxed) + bytes;
  uint64_t peak = g_peak.load(std::memory_order_relaxed);
  while (now > peak && !g_peak.compare_exchange_weak(peak, now, std::memory_order_relaxed)) {
  }
}

void Delete(void* data) {
  char* base = static_cast<char*>(data) - kHeader;
  const Header header = *reinterpret_cast<const Header*>(base);
  g_current.fetch_sub(header.bytes, std::memory_order_relaxed);
  if (header.inner_deleter != nullptr) header.inner_deleter(header.inner_context);
}

class CountingAllocator final : public c10::Allocator {
 public:
  explicit CountingAllocator(c10::Allocator* inner) : inner_(inner) {}

  c10::DataPtr allocate(size_t bytes) const override {
    if (bytes == 0) return inner_->allocate(0);  // nothing to count; no memory behind it
    c10::DataPtr block = inner_->allocate(bytes + kHeader);
    char* base = static_cast<char*>(block.get());
    const c10::Device device = block.device();
    const c10::DeleterFnPtr inner_deleter = block.get_deleter();
    void* inner_context = block.release_context();  // the header owns it from here
    new (base) Header{inner_context, inner_deleter, bytes};
    Count(bytes);
    char* data = base + kHeader;
    return {data, data, &Delete, device};
  }

  c10::DeleterFnPtr raw_deleter() const override { return &Delete; }

 private:
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

FrameworkMemory FrameworkMemoryUsage() {
  return {g_current.load(std::memory_order_relaxed), g_peak.load(std::memory_order_relaxed)};
}

void ResetFrameworkPeak() { g_peak = g_current.load(std::memory_order_relaxed); }

}  // namespace cai
