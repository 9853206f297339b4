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
// the activation buffers the last step freed. The cache never makes the live and cached bytes
// together exceed the most that was ever live, and is emptied before an allocation fails.
#pragma once

#include <cstdint>

namespace cai {

struct FrameworkMemory {
  uint64_t current_bytes = 0;  // live bytes allocated through the counting allocator
  uint64_t peak_bytes = 0;     // the most live at once since install or ResetFrameworkPeak
  uint64_t cached_bytes = 0;   // freed, kept for reuse (not in current_bytes)
  uint64_t max_bytes = 0;      // the most live at once since install (the cache's limit)
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
// Returns cached blocks, largest first, until at least `bytes` are given back or none are
// left; the bytes given back. For the memory pool, before it takes memory of its own.
uint64_t TrimFrameworkCache(uint64_t bytes);

FrameworkMemory FrameworkMemoryUsage();
// The peak restarts from what is live now.
void ResetFrameworkPeak();

}  // namespace cai
