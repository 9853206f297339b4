// MemoryPool: budgets, accounting, reuse, the NVMe tier, concurrency. Each test uses its own
// pool so that tests do not see each other's usage.
#include "mem/pool.h"

#include <dirent.h>
#include <gtest/gtest.h>
#include <malloc.h>
#include <stdlib.h>
#include <unistd.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <fstream>
#include <future>
#include <string>
#include <thread>
#include <vector>

#include "core/status.h"
#include "util/resident.h"

namespace cai {
namespace {

using cai::testing::ResidentBytes;

constexpr cai_mem_tier kAllTiers[] = {CAI_MEM_DEVICE, CAI_MEM_PINNED_HOST, CAI_MEM_HOST,
                                      CAI_MEM_NVME};

// A fresh directory under $TMPDIR (or /tmp), removed at the end of the test.
class TempDir {
 public:
  TempDir() {
    const char* tmp = getenv("TMPDIR");
    std::string pattern = std::string(tmp && *tmp ? tmp : "/tmp") + "/cai-pool-test-XXXXXX";
    path_ = mkdtemp(pattern.data());
  }
  ~TempDir() { rmdir(path_.c_str()); }
  const std::string& path() const { return path_; }
  std::vector<std::string> Entries() const {
    std::vector<std::string> names;
    DIR* dir = opendir(path_.c_str());
    while (dirent* e = readdir(dir)) {
      if (std::strcmp(e->d_name, ".") != 0 && std::strcmp(e->d_name, "..") != 0) {
        names.push_back(e->d_name);
      }
    }
    closedir(dir);
    return names;
  }

 private:
  std::string path_;
};

TEST(MemPool, OverBudget_FailsNamingTierRequestBudgetAndUse) {
  MemoryPool pool;
  pool.SetBudget(CAI_MEM_DEVICE, 1 << 20);
  cai_buffer* held = pool.Allocate(CAI_MEM_DEVICE, 768 << 10, 0, "zero.master");
  try {
    pool.Allocate(CAI_MEM_DEVICE, 512 << 10, 0, "ddp.bucket");
    FAIL() << "allocation over budget succeeded";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), CAI_RESOURCE_EXHAUSTED);
    const std::string msg = e.what();
    EXPECT_NE(msg.find("DEVICE"), std::string::npos) << msg;
    EXPECT_NE(msg.find("524288 bytes"), std::string::npos) << msg;   // the request
    EXPECT_NE(msg.find("1048576 bytes"), std::string::npos) << msg;  // the budget
    EXPECT_NE(msg.find("786432 bytes"), std::string::npos) << msg;   // in use
    EXPECT_NE(msg.find("ddp.bucket"), std::string::npos) << msg;
    EXPECT_NE(msg.find("offload"), std::string::npos) << msg;
  }
  EXPECT_EQ(pool.Usage(CAI_MEM_DEVICE).current_bytes, 768u << 10);
  // Exactly filling the budget is allowed; other tiers are unaffected.
  cai_buffer* rest = pool.Allocate(CAI_MEM_DEVICE, 256 << 10);
  cai_buffer* host = pool.Allocate(CAI_MEM_HOST, 4 << 20);
  pool.Free(held);
  pool.Free(rest);
  pool.Free(host);
}

TEST(MemPool, BudgetBelowCurrentUse_FailsWithFailedPrecondition) {
  MemoryPool pool;
  cai_buffer* b = pool.Allocate(CAI_MEM_HOST, 4096);
  try {
    pool.SetBudget(CAI_MEM_HOST, 1024);
    FAIL();
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), CAI_FAILED_PRECONDITION);
    EXPECT_NE(std::string(e.what()).find("HOST"), std::string::npos);
  }
  EXPECT_EQ(pool.Usage(CAI_MEM_HOST).budget_bytes, 0u);
  pool.Free(b);
}

TEST(MemPool, AllocateAndFreeOnEveryTier_UsageReturnsToZero) {
  TempDir dir;
  MemoryPool pool;
  pool.SetNvmeDirectory(dir.path());
  for (cai_mem_tier tier : kAllTiers) {
    std::vector<cai_buffer*> buffers;
    for (size_t bytes : {1ul, 100ul, 4096ul, 1000000ul})
      buffers.push_back(pool.Allocate(tier, bytes));
    TierUsage u = pool.Usage(tier);
    EXPECT_EQ(u.current_bytes, 1u + 100 + 4096 + 1000000) << TierName(tier);
    EXPECT_EQ(u.peak_bytes, u.current_bytes);
    EXPECT_EQ(u.num_allocations, 4u);
    for (cai_buffer* b : buffers) pool.Free(b);
    u = pool.Usage(tier);
    EXPECT_EQ(u.current_bytes, 0u) << TierName(tier);
    EXPECT_EQ(u.num_allocations, 0u);
    EXPECT_EQ(u.peak_bytes, 1u + 100 + 4096 + 1000000);
    EXPECT_GE(u.cached_bytes, u.peak_bytes);
    pool.ReleaseCached(tier);
    EXPECT_EQ(pool.Usage(tier).cached_bytes, 0u);
  }
}

TEST(MemPool, FreedBlock_IsReusedForSameSizeClass) {
  MemoryPool pool;
  cai_buffer* a = pool.Allocate(CAI_MEM_HOST, 1000);
  void* address = a->data;
  pool.Free(a);
  EXPECT_EQ(pool.Usage(CAI_MEM_HOST).cached_bytes, 1024u);
  cai_buffer* b = pool.Allocate(CAI_MEM_HOST, 1020);  // same 1 KiB class
  EXPECT_EQ(b->data, address);
  EXPECT_EQ(b->bytes, 1020u);
  EXPECT_EQ(pool.Usage(CAI_MEM_HOST).cached_bytes, 0u);
  EXPECT_EQ(pool.Usage(CAI_MEM_HOST).current_bytes, 1020u);
  cai_buffer* c = pool.Allocate(CAI_MEM_HOST, 5000);  // another class: fresh memory
  EXPECT_NE(c->data, address);
  pool.Free(b);
  pool.Free(c);
}

// The cache never makes a tier hold more than the most it had in use: a freed block of a
// class the cache cannot spare room for goes back to the system.
TEST(MemPool, FreedBlocks_AreCachedOnlyWithinTheTiersPeak) {
  MemoryPool pool;
  cai_buffer* a = pool.Allocate(CAI_MEM_HOST, 1 << 20);
  cai_buffer* b = pool.Allocate(CAI_MEM_HOST, 1 << 20);
  pool.Free(a);
  pool.Free(b);
  EXPECT_EQ(pool.Usage(CAI_MEM_HOST).cached_bytes, 2u << 20);  // both: the peak was 2 MiB
  // 3 MiB in use (the 2 MiB cached are not reusable for this class): the peak becomes 3 MiB,
  // and with 2 MiB cached, caching this block would hold 5.
  pool.Free(pool.Allocate(CAI_MEM_HOST, 3 << 20));
  EXPECT_EQ(pool.Usage(CAI_MEM_HOST).cached_bytes, 2u << 20);
  // Three 1 MiB blocks in use at once make that peak again: all three may be cached.
  cai_buffer* c = pool.Allocate(CAI_MEM_HOST, 1 << 20);  // a cached one
  cai_buffer* d = pool.Allocate(CAI_MEM_HOST, 1 << 20);  // the other
  cai_buffer* e = pool.Allocate(CAI_MEM_HOST, 1 << 20);  // fresh: 3 MiB in use
  pool.Free(c);
  pool.Free(d);
  pool.Free(e);
  EXPECT_EQ(pool.Usage(CAI_MEM_HOST).cached_bytes, 3u << 20);
  pool.ReleaseCached(CAI_MEM_HOST);
}

// FSDP's units differ in size: a request whose class is not cached takes a cached block up to
// twice it, already paged in, instead of faulting in a new one.
TEST(MemPool, RequestWithoutItsClassCached_TakesACachedBlockUpToTwiceIt) {
  MemoryPool pool;
  cai_buffer* a = pool.Allocate(CAI_MEM_HOST, 3 << 20);
  void* address = a->data;
  pool.Free(a);
  cai_buffer* b = pool.Allocate(CAI_MEM_HOST, 2 << 20);  // 3 MiB <= 2 x 2 MiB
  EXPECT_EQ(b->data, address);
  EXPECT_EQ(b->capacity, size_t{3} << 20);
  EXPECT_EQ(b->bytes, size_t{2} << 20);
  EXPECT_EQ(pool.Usage(CAI_MEM_HOST).cached_bytes, 0u);
  pool.Free(b);
  EXPECT_EQ(pool.Usage(CAI_MEM_HOST).cached_bytes, 3u << 20);
  cai_buffer* c = pool.Allocate(CAI_MEM_HOST, 1 << 20);  // 3 MiB > 2 x 1 MiB: fresh memory
  EXPECT_NE(c->data, address);
  EXPECT_EQ(pool.Usage(CAI_MEM_HOST).cached_bytes, 3u << 20);
  pool.Free(c);
  pool.ReleaseCached(CAI_MEM_HOST);
}

// Room of an eighth above the peak for blocks of other classes, and no more.
TEST(MemPool, FreedBlocks_AreCachedWithinAnEighthAboveTheTiersPeak) {
  MemoryPool pool;
  pool.Free(pool.Allocate(CAI_MEM_HOST, 8 << 20));  // the peak: 8 MiB
  EXPECT_EQ(pool.Usage(CAI_MEM_HOST).cached_bytes, 8u << 20);
  pool.Free(pool.Allocate(CAI_MEM_HOST, 1 << 20));  // 8 + 1 <= 8 + 8/8: kept
  EXPECT_EQ(pool.Usage(CAI_MEM_HOST).cached_bytes, 9u << 20);
  pool.Free(pool.Allocate(CAI_MEM_HOST, 2 << 20));  // 9 + 2 > 9: given back
  EXPECT_EQ(pool.Usage(CAI_MEM_HOST).cached_bytes, 9u << 20);
  pool.ReleaseCached(CAI_MEM_HOST);
}

// A freed block is not kept where it would take what the tier holds, LibTorch's tensors
// included, past its budget: here its size class holds more than the bytes it was charged.
TEST(MemPool, FreedBlock_IsNotCachedPastTheBudget) {
  MemoryPool pool;
  constexpr uint64_t kMiB = 1 << 20;
  pool.SetBudget(CAI_MEM_DEVICE, 10 * kMiB);
  cai_buffer* a = pool.Allocate(CAI_MEM_DEVICE, kMiB + 1);  // a class of 1.125 MiB
  ASSERT_EQ(a->capacity, kMiB + kMiB / 8);
  ASSERT_TRUE(pool.TryChargeFramework(9 * kMiB - 1));  // the budget, to the byte
  pool.Free(a);
  EXPECT_EQ(pool.Usage(CAI_MEM_DEVICE).cached_bytes, 0u);
  pool.UnchargeFramework(9 * kMiB - 1);
  pool.Free(pool.Allocate(CAI_MEM_DEVICE, kMiB + 1));  // with room, kept
  EXPECT_EQ(pool.Usage(CAI_MEM_DEVICE).cached_bytes, kMiB + kMiB / 8);
  pool.ReleaseCached(CAI_MEM_DEVICE);
}

// The reclaimer (LibTorch's cache gives back memory) runs only for blocks the pool maps from
// the kernel, not for the small ones glibc's heap serves, and not for a block served cached.
uint64_t g_reclaimed = 0;
int g_reclaims = 0;
TEST(MemPool, HostReclaimer_RunsOnlyBeforeMappingALargeBlock) {
  MemoryPool::SetHostReclaimer([](uint64_t bytes) {
    ++g_reclaims;
    g_reclaimed += bytes;
    return uint64_t{0};
  });
  MemoryPool pool;
  pool.Free(pool.Allocate(CAI_MEM_HOST, 640));
  EXPECT_EQ(g_reclaims, 0);
  pool.Free(pool.Allocate(CAI_MEM_HOST, 2 << 20));
  EXPECT_EQ(g_reclaims, 1);
  EXPECT_EQ(g_reclaimed, 2u << 20);
  pool.Free(pool.Allocate(CAI_MEM_HOST, 2 << 20));  // the cached block
  EXPECT_EQ(g_reclaims, 1);
  MemoryPool::SetHostReclaimer(nullptr);
  pool.ReleaseCached(CAI_MEM_HOST);
}

TEST(MemPool, CachedBlocks_AreReleasedRatherThanExceedBudget) {
  MemoryPool pool;
  pool.SetBudget(CAI_MEM_DEVICE, 4 << 20);
  pool.Free(pool.Allocate(CAI_MEM_DEVICE, 3 << 20));
  EXPECT_EQ(pool.Usage(CAI_MEM_DEVICE).cached_bytes, 3u << 20);
  // A different class that fits the budget only if the cached 3 MiB go back to the system.
  cai_buffer* b = pool.Allocate(CAI_MEM_DEVICE, 2 << 20);
  EXPECT_EQ(pool.Usage(CAI_MEM_DEVICE).cached_bytes, 0u);
  pool.Free(b);
}

TEST(MemPool, ResetPeak_RestartsAtCurrentUse) {
  MemoryPool pool;
  cai_buffer* a = pool.Allocate(CAI_MEM_PINNED_HOST, 1 << 20);
  cai_buffer* b = pool.Allocate(CAI_MEM_PINNED_HOST, 2 << 20);
  pool.Free(b);
  EXPECT_EQ(pool.Usage(CAI_MEM_PINNED_HOST).peak_bytes, 3u << 20);
  pool.ResetPeak(CAI_MEM_PINNED_HOST);
  EXPECT_EQ(pool.Usage(CAI_MEM_PINNED_HOST).peak_bytes, 1u << 20);
  pool.Free(a);
}

TEST(MemPool, Alignment_IsHonouredAndValidated) {
  MemoryPool pool;
  for (size_t align : {0ul, 16ul, 64ul, 256ul, 4096ul, 1ul << 16}) {
    cai_buffer* b = pool.Allocate(CAI_MEM_HOST, 100, align);
    EXPECT_EQ(reinterpret_cast<uintptr_t>(b->data) % std::max<size_t>(align, 64), 0u) << align;
    pool.Free(b);
  }
  EXPECT_THROW(pool.Allocate(CAI_MEM_HOST, 100, 48), Error);
  try {
    pool.Allocate(CAI_MEM_NVME, 100, size_t{1} << 20);
    FAIL();
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), CAI_INVALID_ARGUMENT);
    EXPECT_NE(std::string(e.what()).find("page size"), std::string::npos);
  }
}

TEST(MemPool, BadTierOrZeroBytes_AreInvalidArguments) {
  MemoryPool pool;
  try {
    pool.Allocate(7, 10);
    FAIL();
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), CAI_INVALID_ARGUMENT);
    EXPECT_NE(std::string(e.what()).find("tier 7"), std::string::npos);
  }
  EXPECT_THROW(pool.Allocate(CAI_MEM_HOST, 0), Error);
  EXPECT_THROW(pool.Usage(-1), Error);
}

TEST(MemPool, ZeroFill_ClearsReusedBlock) {
  MemoryPool pool;
  cai_buffer* a = pool.Allocate(CAI_MEM_HOST, 4096);
  std::memset(a->data, 0xab, 4096);
  pool.Free(a);
  cai_buffer* b = pool.Allocate(CAI_MEM_HOST, 4096, 0, {}, /*zero_fill=*/true);
  ASSERT_EQ(b->data, a->data);
  const auto* bytes = static_cast<const uint8_t*>(b->data);
  for (size_t i = 0; i < 4096; ++i) ASSERT_EQ(bytes[i], 0) << i;
  pool.Free(b);
}

TEST(MemPool, NvmeTier_RoundTripsDataThroughUnlinkedFile) {
  TempDir dir;
  MemoryPool pool;
  pool.SetNvmeDirectory(dir.path());
  EXPECT_EQ(pool.NvmeDirectory(), dir.path());
  const size_t n = (8 << 20) / sizeof(uint32_t);
  cai_buffer* b = pool.Allocate(CAI_MEM_NVME, n * sizeof(uint32_t), 0, "gemini.offload");
  EXPECT_TRUE(dir.Entries().empty()) << "backing file left visible: " << dir.Entries()[0];
  auto* words = static_cast<uint32_t*>(b->data);
  for (size_t i = 0; i < n; ++i) words[i] = static_cast<uint32_t>(i * 2654435761u);
  for (size_t i = 0; i < n; ++i) ASSERT_EQ(words[i], static_cast<uint32_t>(i * 2654435761u));
  // The mapping is the deleted file in that directory, not anonymous memory.
  std::ifstream maps("/proc/self/maps");
  std::string line;
  bool mapped = false;
  while (std::getline(maps, line)) {
    mapped |= line.find(dir.path() + "/cai-nvme-") != std::string::npos &&
              line.find("(deleted)") != std::string::npos;
  }
  EXPECT_TRUE(mapped);
  pool.Free(b);
  pool.ReleaseCached(CAI_MEM_NVME);
  EXPECT_TRUE(dir.Entries().empty());
}

// Unaligned ranges of every shape land where they were written: heads and tails of blocks,
// ranges beyond the staging buffer, and aligned ones straight from the caller's memory.
TEST(MemPool, UnmappedNvme_KeepsEveryRangeWrittenAndNothingElse) {
  TempDir dir;
  MemoryPool pool;
  pool.SetNvmeDirectory(dir.path());
  const size_t n = (10 << 20) + 123;
  cai_buffer* b = pool.Allocate(CAI_MEM_NVME, n, 0, "gemini.optim", false, /*unmapped=*/true);
  EXPECT_EQ(b->data, nullptr);
  EXPECT_GE(b->fd, 0);
  EXPECT_TRUE(dir.Entries().empty());
  std::vector<uint8_t> expected(n, 0), got(n, 0xff);
  MemoryPool::Read(b, 0, got.data(), n);
  EXPECT_EQ(got, expected);  // a new buffer reads as zeros

  uint32_t state = 12345;
  auto next = [&] { return state = state * 1664525u + 1013904223u; };
  std::vector<uint8_t> source(6 << 20);
  for (uint8_t& v : source) v = static_cast<uint8_t>(next() >> 24);
  const std::pair<size_t, size_t> ranges[] = {
      {0, 1},       {4095, 2},       {4096, 4096},         {5000, 100}, {123, (5 << 20) + 7},
      {n - 10, 10}, {8192, 4 << 20}, {(6 << 20) + 1, 8191}};
  for (auto [offset, bytes] : ranges) {
    MemoryPool::Write(b, offset, source.data() + (offset % 1000), bytes);
    std::memcpy(expected.data() + offset, source.data() + (offset % 1000), bytes);
  }
  // Aligned offset, length and memory: straight to the file.
  void* aligned = nullptr;
  ASSERT_EQ(posix_memalign(&aligned, 4096, 1 << 20), 0);
  std::memset(aligned, 0x5a, 1 << 20);
  MemoryPool::Write(b, 2 << 20, aligned, 1 << 20);
  std::memset(expected.data() + (2 << 20), 0x5a, 1 << 20);
  MemoryPool::Read(b, 0, got.data(), n);
  EXPECT_EQ(got, expected);
  std::vector<uint8_t> part(777);
  MemoryPool::Read(b, 4093, part.data(), part.size());
  EXPECT_TRUE(std::equal(part.begin(), part.end(), expected.begin() + 4093));
  MemoryPool::Read(b, 2 << 20, aligned, 1 << 20);
  EXPECT_EQ(std::memcmp(aligned, expected.data() + (2 << 20), 1 << 20), 0);
  std::free(aligned);

  try {
    MemoryPool::Write(b, n - 5, source.data(), 6);
    FAIL() << "a write past the end succeeded";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), CAI_INVALID_ARGUMENT);
    EXPECT_NE(std::string(e.what()).find("\"gemini.optim\""), std::string::npos) << e.what();
  }
  EXPECT_EQ(pool.Usage(CAI_MEM_NVME).current_bytes, n);
  pool.Free(b);
  EXPECT_EQ(pool.Usage(CAI_MEM_NVME).current_bytes, 0u);
  EXPECT_EQ(pool.Usage(CAI_MEM_NVME).cached_bytes, 0u);  // not cached: the file is gone
  EXPECT_THROW(pool.Allocate(CAI_MEM_HOST, 100, 0, {}, false, true), Error);
}

// What an unmapped buffer holds stays out of the process: writing 256 MiB through one leaves
// the resident memory where it was, while a mapped NVMe buffer's pages count once touched.
TEST(MemPool, UnmappedNvme_LeavesTheProcessResidentMemoryWhereMappedDoesNot) {
  TempDir dir;
  MemoryPool pool;
  pool.SetNvmeDirectory(dir.path());
  constexpr size_t kBytes = size_t{256} << 20, kChunk = size_t{8} << 20;
  void* chunk = nullptr;
  ASSERT_EQ(posix_memalign(&chunk, 4096, kChunk), 0);
  std::memset(chunk, 0x42, kChunk);
  const uint64_t before = ResidentBytes();
  cai_buffer* unmapped = pool.Allocate(CAI_MEM_NVME, kBytes, 0, "offload", false, true);
  for (size_t offset = 0; offset < kBytes; offset += kChunk) {
    MemoryPool::Write(unmapped, offset, chunk, kChunk);
  }
  const uint64_t after_unmapped = ResidentBytes();
  EXPECT_LT(after_unmapped, before + (size_t{32} << 20))
      << "unmapped: " << before << " -> " << after_unmapped << " bytes resident";
  if (!unmapped->direct_io) {
    GTEST_LOG_(INFO) << dir.path() << " does not take O_DIRECT: the bytes sit in the page cache";
  }
  pool.Free(unmapped);

  cai_buffer* mapped = pool.Allocate(CAI_MEM_NVME, kBytes, 0, "offload");
  for (size_t offset = 0; offset < kBytes; offset += kChunk) {
    std::memcpy(static_cast<char*>(mapped->data) + offset, chunk, kChunk);
  }
  const uint64_t after_mapped = ResidentBytes();
  EXPECT_GE(after_mapped, after_unmapped + (size_t{200} << 20))
      << "mapped: " << after_unmapped << " -> " << after_mapped << " bytes resident";
  pool.Free(mapped);
  pool.ReleaseCached(CAI_MEM_NVME);
  std::free(chunk);
}

// A host block freed past the pool's cache goes back to the kernel, whatever glibc keeps: with
// its mmap and trim thresholds raised (as a process may set them to keep its heap warm), a
// block taken from the heap and freed between live allocations stayed resident.
TEST(MemPool, HostBlockFreedPastTheCache_LeavesTheProcessResidentMemory) {
  mallopt(M_MMAP_THRESHOLD, 256 << 20);
  mallopt(M_TRIM_THRESHOLD, 512 << 20);
  MemoryPool pool;
  constexpr size_t kBytes = size_t{64} << 20;
  void* below = std::malloc(4096);
  const uint64_t before = ResidentBytes();
  cai_buffer* block = pool.Allocate(CAI_MEM_HOST, kBytes, 0, "block");
  void* above = std::malloc(4096);  // would pin the block's heap space below the heap's top
  std::memset(block->data, 0x42, kBytes);
  const uint64_t touched = ResidentBytes();
  EXPECT_GE(touched, before + kBytes - (size_t{4} << 20));
  pool.Free(block);
  pool.ReleaseCached(CAI_MEM_HOST);
  const uint64_t after = ResidentBytes();
  EXPECT_LT(after, touched - kBytes + (size_t{8} << 20))
      << "resident: " << before << " before, " << touched << " touched, " << after << " freed";
  std::free(above);
  std::free(below);
}

// Copies submitted to the pool run on its one copy thread, in order, and report their errors.
TEST(MemPool, SubmittedCopies_RunInOrderOffTheCallingThreadAndCarryTheirErrors) {
  MemoryPool pool;
  std::vector<int> order;
  const std::thread::id caller = std::this_thread::get_id();
  std::vector<std::future<void>> done;
  for (int i = 0; i < 50; ++i) {
    done.push_back(pool.Submit([&order, i, caller] {
      EXPECT_NE(std::this_thread::get_id(), caller);
      order.push_back(i);
    }));
  }
  done.push_back(pool.Submit([] { throw Error(CAI_INTERNAL, "disk gone"); }));
  for (int i = 0; i < 50; ++i) done[i].get();
  EXPECT_THROW(done.back().get(), Error);
  ASSERT_EQ(order.size(), 50u);
  for (int i = 0; i < 50; ++i) EXPECT_EQ(order[i], i);
}

TEST(MemPool, NvmeDirectoryNotWritable_IsRefused) {
  MemoryPool pool;
  try {
    pool.SetNvmeDirectory("/nonexistent/cai");
    FAIL();
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), CAI_INVALID_ARGUMENT);
    EXPECT_NE(std::string(e.what()).find("/nonexistent/cai"), std::string::npos);
  }
}

TEST(MemPool, ConcurrentAllocateAndFree_KeepsAccountingExact) {
  MemoryPool pool;
  std::vector<std::thread> threads;
  for (int t = 0; t < 8; ++t) {
    threads.emplace_back([&pool, t] {
      for (int i = 0; i < 2000; ++i) {
        cai_buffer* b = pool.Allocate(CAI_MEM_HOST, static_cast<size_t>(64 + (i + t) % 5000));
        static_cast<char*>(b->data)[0] = 1;
        pool.Free(b);
      }
    });
  }
  for (auto& th : threads) th.join();
  const TierUsage u = pool.Usage(CAI_MEM_HOST);
  EXPECT_EQ(u.current_bytes, 0u);
  EXPECT_EQ(u.num_allocations, 0u);
  EXPECT_LE(u.peak_bytes, 8u * 5064);
}

}  // namespace
}  // namespace cai
