// The host's memory pool: allocation by tier with per-tier budgets, current/peak accounting
// and reuse of freed blocks. One process-wide instance (MemoryPool::Global()) backs
// cai_mem_api; tests may make their own.
//
// Tiers on this CPU-only build: DEVICE is host memory with its own budget (so budgets and
// offload behave as on a GPU host), PINNED_HOST is plain host memory, HOST is pageable host
// memory, NVME is a file in the NVMe directory (unlinked as soon as it is created, so nothing
// is left behind even after a crash): a shared mapping of it, or, for an unmapped block, the
// file alone, whose bytes move with Read/Write (pread/pwrite with O_DIRECT where the
// filesystem allows), so they stay out of the process's memory and the page cache.
//
// Accounting: current_bytes counts the bytes callers asked for; a budget limits current_bytes.
// Freed blocks are cached by size class (rounded up by at most 1/8, and at most 2 MiB) and
// handed out again for requests of the same class or, with none cached, of a class up to half
// theirs; cached bytes are reported apart and are returned to the system when a tier with a
// budget would otherwise hold more than its budget. A freed block is cached only while the
// tier's blocks in use and cached together stay within an eighth above the most it ever had in
// use (else it goes back to the system at once), so the cache never makes a tier hold much
// more than its peak.
//
// The DEVICE tier's budget also covers what LibTorch allocates on the device for itself
// (activations, temporaries, the model's own tensors), charged through ChargeFramework by the
// counting allocator (model/framework_allocator.h): the budget bounds the two together, as a
// device's memory bounds PyTorch's tensors and a strategy's buffers alike. On a CPU host that
// is an accounting boundary, not a device: both are host memory.
#pragma once

#include <array>
#include <cstdint>
#include <functional>
#include <future>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>

#include "cai/mempool.h"

// The handle behind cai_buffer*: one block of one tier. Owned by the pool.
struct cai_buffer {
  void* data = nullptr;
  size_t bytes = 0;     // requested by the current owner
  size_t capacity = 0;  // size class actually mapped
  size_t alignment = 0;
  cai_mem_tier tier = CAI_MEM_HOST;
  std::string tag;
  // Element counts of this buffer viewed as 1-, 2-, 4- and 8-byte elements, and the unit
  // stride: cai_mem_api.view points its descriptor here, so views stay valid as long as the
  // buffer, whatever dtypes they were taken with.
  int64_t elements[4] = {};
  int64_t unit_stride = 1;
  // An unmapped NVMe block: data is nullptr, the bytes are in this file.
  int fd = -1;
  bool direct_io = false;  // the file is open with O_DIRECT
};

namespace cai {

// Anonymous memory straight from the kernel, for host blocks of a MiB or more that must go back to
// it when freed (glibc's heap keeps freed space resident): huge pages where the kernel allows
// them, so that a fresh block costs one fault per 2 MiB rather than per 4 KiB. nullptr when the
// kernel has no memory left; UnmapHostPages gives it back.
void* MapHostPages(size_t bytes);
void UnmapHostPages(void* data, size_t bytes);

struct TierUsage {
  uint64_t current_bytes = 0;
  uint64_t peak_bytes = 0;
  uint64_t budget_bytes = 0;  // 0 = unlimited
  uint64_t num_allocations = 0;
  uint64_t cached_bytes = 0;
  // DEVICE only (0 elsewhere): LibTorch's live bytes charged to the tier, their peak, and the
  // peak of current_bytes + framework_bytes together (what the budget bounds).
  uint64_t framework_bytes = 0;
  uint64_t framework_peak_bytes = 0;
  uint64_t total_peak_bytes = 0;
};

// "DEVICE", "PINNED_HOST", "HOST", "NVME"; "tier <n>" for anything else.
std::string TierName(cai_mem_tier tier);

// Thread-safe.
class MemoryPool {
 public:
  MemoryPool();
  // Returns cached blocks to the system. Buffers still allocated are not touched.
  ~MemoryPool();
  MemoryPool(const MemoryPool&) = delete;
  MemoryPool& operator=(const MemoryPool&) = delete;

  // The pool behind cai_mem_api. Never destroyed, so buffers a plugin frees during process
  // exit still find it.
  static MemoryPool& Global();

  // A block of `bytes` (> 0) on `tier`, aligned to `alignment` (a power of two; 0 means 64;
  // NVMe blocks are page-aligned and accept up to the page size). Throws cai::Error:
  // RESOURCE_EXHAUSTED over the tier's budget or when the system has no memory / disk left,
  // INVALID_ARGUMENT for a bad tier, size or alignment, FAILED_PRECONDITION when the NVMe
  // directory cannot hold the backing file.
  // `unmapped` (NVME only): a block without an address, read and written through Read/Write;
  // its bytes start as zeros. Unmapped blocks are not cached: Free gives the file's space back.
  cai_buffer* Allocate(cai_mem_tier tier, size_t bytes, size_t alignment = 0,
                       std::string_view tag = {}, bool zero_fill = false, bool unmapped = false);
  // Returns the block to its tier's cache. Accepts nullptr.
  void Free(cai_buffer* buffer);

  // 0 = unlimited. Throws FAILED_PRECONDITION when `bytes` is below current use.
  void SetBudget(cai_mem_tier tier, uint64_t bytes);
  TierUsage Usage(cai_mem_tier tier) const;
  // Starts peak accounting afresh at current use.
  void ResetPeak(cai_mem_tier tier);

  // Charges `bytes` LibTorch allocates on the device to the DEVICE tier: false, charging
  // nothing, when the budget would be exceeded (the caller fails the allocation, naming what
  // it was for; Usage says what holds the rest).
  bool TryChargeFramework(uint64_t bytes);
  void UnchargeFramework(uint64_t bytes);
  // Returns the tier's cached blocks to the system.
  void ReleaseCached(cai_mem_tier tier);

  // Copies `bytes` from `src` into the buffer at byte `offset`, or out of it into `dst`: any
  // tier, an unmapped NVMe block through its file. Throws INVALID_ARGUMENT for a range beyond
  // the buffer, RESOURCE_EXHAUSTED / INTERNAL for a failed disk read or write (naming it).
  static void Write(cai_buffer* buffer, size_t offset, const void* src, size_t bytes);
  static void Read(const cai_buffer* buffer, size_t offset, void* dst, size_t bytes);
  // Runs `copy` on the pool's copy thread (started on first use), in submission order; the
  // future carries its exception. Lets a strategy's prefetch and offload overlap compute.
  std::future<void> Submit(std::function<void()> copy);

  // Called with a block's size before host memory is taken from the system for it, so that
  // another cache in the process (LibTorch's freed blocks, model/framework_allocator.h) gives
  // back memory this pool can reuse rather than the process holding both. One per process.
  using HostReclaimer = uint64_t (*)(uint64_t bytes);
  static void SetHostReclaimer(HostReclaimer reclaimer);

  // Directory of the NVMe tier's backing files; defaults to $TMPDIR, else /tmp. Throws
  // INVALID_ARGUMENT when `dir` is not a writable directory. Affects later allocations only.
  void SetNvmeDirectory(const std::string& dir);
  std::string NvmeDirectory() const;

 private:
  struct Tier {
    mutable std::mutex mu;
    TierUsage usage;
    std::multimap<size_t, cai_buffer*> cached;  // by capacity
    uint64_t live_capacity = 0;                 // capacity of the blocks in use
    uint64_t max_live_capacity = 0;             // the most it ever was (reset_peak leaves it)
  };

  Tier& At(cai_mem_tier tier);
  const Tier& At(cai_mem_tier tier) const;
  // Takes the cached blocks out of `t` (whose lock the caller holds) for release outside it.
  static std::multimap<size_t, cai_buffer*> TakeCached(Tier& t);
  void* MapBlock(cai_mem_tier tier, size_t capacity, size_t alignment);
  static void UnmapBlock(const cai_buffer& block);

  // An unlinked, fully reserved file of `capacity` bytes in the NVMe directory; its fd.
  int CreateNvmeFile(size_t capacity) const;

  std::array<Tier, CAI_MEM_NUM_TIERS> tiers_;
  mutable std::mutex nvme_mu_;
  std::string nvme_dir_;

  struct CopyQueue;
  std::mutex copy_mu_;
  std::unique_ptr<CopyQueue> copies_;
};

}  // namespace cai
