// Bytes LibTorch allocates on the CPU for itself: activations, temporaries, autograd's saved
// tensors, and parameters and gradients while the model owns them. The memory pool
// (mem/pool.h) accounts for what strategies allocate through cai_mem_api; this accounts for the
// rest, which is most of a step's peak. Counted by a wrapper in front of c10's CPU allocator
// (framework_allocator.cpp, the one file that touches c10's allocator interface).
//
// Only allocations made after InstallFrameworkAllocator are counted, and only their frees
// subtracted. Host-side only: the ABI does not carry these figures (yet). Thread-safe.
//
// Freed blocks of 1 MiB or more are cached for reuse (rounded up to one of eight size classes
// per power of two), as PyTorch caches device memory, so a step does not page-fault in again
// the activation buffers the last step freed; without a DEVICE budget a request may take a
// cached block of up to twice its class. The cache never makes the live and cached bytes together
// exceed the most that was ever live by more than a quarter, and is emptied before an allocation
// fails. These blocks come from the kernel, not from glibc's heap, so a block the cache does not
// keep goes back to it.
//
// Charged to a memory pool (ChargeFrameworkTo), these bytes count against its DEVICE tier's
// budget with the pool's own buffers, and an allocation beyond the budget fails like a device
// out-of-memory: cai::Error RESOURCE_EXHAUSTED naming the allocation site of the thread
// (AllocationSite), what the budget is and what holds it.
#pragma once

#include <cstdint>
#include <string>

namespace cai {

class MemoryPool;

struct FrameworkMemory {
  uint64_t current_bytes = 0;  // live bytes allocated through the counting allocator
  uint64_t peak_bytes = 0;     // the most live at once since install or ResetFrameworkPeak
  uint64_t cached_bytes = 0;   // freed, kept for reuse (not in current_bytes)
  uint64_t max_bytes = 0;      // the most live at once since install (the cache's limit
                               // is a quarter above it)
};

// Puts the counting allocator in front of LibTorch's CPU allocator, once per process (later
// calls do nothing). Call before the process starts threads that allocate tensors: c10 does not
// synchronise the switch.
void InstallFrameworkAllocator();
bool FrameworkAllocatorInstalled();

// On by default; off empties the cache, and freed blocks go back to LibTorch's allocator.
void SetFrameworkCaching(bool enabled);
// Returns the cached blocks to LibTorch's allocator; the bytes given back.
uint64_t EmptyFrameworkCache();
// Returns the smallest cached block of at least `bytes`; with none that large, cached blocks,
// largest first, until at least `bytes` are given back or none are left. Returns the bytes
// given back. For the memory pool, before it takes memory of its own.
uint64_t TrimFrameworkCache(uint64_t bytes);

// From now on, allocations are charged to `pool`'s DEVICE tier (nullptr: to none). Blocks
// allocated before are never charged, so their frees are not subtracted either.
void ChargeFrameworkTo(MemoryPool* pool);

// Charges the live block whose data pointer is `data` (a storage's, with `deleter` its
// DataPtr's deleter) to the pool charged now, as if it were allocated now: a tensor built in
// host memory moving to the device. Returns false, charging nothing, for memory the counting
// allocator did not hand out or that is charged already; fails like an allocation over the
// budget.
bool ChargeExistingBlock(void* data, void (*deleter)(void*));

// What LibTorch allocates for on this thread while the object lives ("forward", unit 3 named
// "h.2"), for the message of a budget failure. Nested sites restore the enclosing one.
// `phase` and `unit_name` must outlive the site.
class AllocationSite {
 public:
  explicit AllocationSite(const char* phase, int32_t unit = -1,
                          const std::string* unit_name = nullptr);
  ~AllocationSite();
  AllocationSite(const AllocationSite&) = delete;
  AllocationSite& operator=(const AllocationSite&) = delete;
  // Moves the thread's current site on (backward reaching the next unit) without nesting: the
  // innermost AllocationSite restores what was before it.
  static void Set(const char* phase, int32_t unit = -1, const std::string* unit_name = nullptr);

 private:
  const char* saved_phase_;
  int32_t saved_unit_;
  const std::string* saved_name_;
};

FrameworkMemory FrameworkMemoryUsage();
// The peak restarts from what is live now.
void ResetFrameworkPeak();

}  // namespace cai
