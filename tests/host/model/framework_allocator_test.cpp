// The counting allocator in front of LibTorch's CPU allocator: what LibTorch allocates for
// itself is counted while it lives, and the peak outlives it.
#include "model/framework_allocator.h"

#include <c10/core/CPUAllocator.h>
#include <gtest/gtest.h>
#include <malloc.h>
#include <torch/torch.h>

#include <algorithm>
#include <cstdint>
#include <string>

#include "core/status.h"
#include "mem/pool.h"
#include "model/model.h"
#include "util/resident.h"

namespace cai {
namespace {

using cai::testing::ResidentBytes;

TEST(FrameworkAllocator, TensorOfNBytes_IsCountedWhileItLivesAndPeakStays) {
  InstallFrameworkAllocator();
  InstallFrameworkAllocator();  // once per process: a second call changes nothing
  ASSERT_TRUE(FrameworkAllocatorInstalled());
  constexpr int64_t kElements = 1 << 20;
  constexpr uint64_t kBytes = kElements * sizeof(float);
  ResetFrameworkPeak();
  const FrameworkMemory before = FrameworkMemoryUsage();
  EXPECT_EQ(before.peak_bytes, before.current_bytes);
  {
    torch::Tensor t = torch::empty({kElements}, torch::kFloat);
    const FrameworkMemory during = FrameworkMemoryUsage();
    EXPECT_GE(during.current_bytes, before.current_bytes + kBytes);
    EXPECT_GE(during.peak_bytes, during.current_bytes);
    // The memory is the tensor's to use, aligned as LibTorch's own allocator aligns it.
    t.fill_(2.0f);
    EXPECT_EQ(t.sum().item<double>(), 2.0 * kElements);
    EXPECT_EQ(reinterpret_cast<uintptr_t>(t.data_ptr()) % 64, 0u);
  }
  const FrameworkMemory after = FrameworkMemoryUsage();
  EXPECT_LT(after.current_bytes, before.current_bytes + kBytes);  // freed and subtracted
  EXPECT_GE(after.peak_bytes, before.current_bytes + kBytes);     // the peak stays

  // LibTorch's raw interface (raw_allocate asserts the data pointer is the context) works too.
  c10::Allocator* cpu = c10::GetCPUAllocator();
  void* raw = cpu->raw_allocate(1000);
  ASSERT_NE(raw, nullptr);
  EXPECT_GE(FrameworkMemoryUsage().current_bytes, after.current_bytes + 1000);
  cpu->raw_deallocate(raw);
  EXPECT_EQ(FrameworkMemoryUsage().current_bytes, after.current_bytes);
}

TEST(FrameworkAllocator, FreedLargeBlock_IsReusedBySameSizeClassWithinTheMostEverLive) {
  InstallFrameworkAllocator();
  SetFrameworkCaching(true);
  EmptyFrameworkCache();
  constexpr int64_t kElements = 3 << 20;  // 12 MiB: a size class of its own
  void* first = nullptr;
  {
    torch::Tensor t = torch::ones({kElements}, torch::kFloat);
    first = t.data_ptr();
  }
  const FrameworkMemory freed = FrameworkMemoryUsage();
  EXPECT_GE(freed.cached_bytes, uint64_t{kElements} * sizeof(float));
  {
    // A slightly smaller request of the same class gets the same memory back, already paged in.
    torch::Tensor t = torch::empty({kElements - 1000}, torch::kFloat);
    EXPECT_EQ(t.data_ptr(), first);
    EXPECT_EQ(FrameworkMemoryUsage().cached_bytes, freed.cached_bytes - 12 * (uint64_t{1} << 20));
    t.fill_(3.0f);
    EXPECT_EQ(t.sum().item<double>(), 3.0 * (kElements - 1000));
  }
  // Small blocks stay with glibc.
  { torch::Tensor small = torch::empty({1000}, torch::kFloat); }
  EXPECT_EQ(FrameworkMemoryUsage().cached_bytes, freed.cached_bytes);

  // Live and cached together never exceed the most ever live by more than a quarter: a freed
  // block is kept only if that holds, else given back.
  constexpr uint64_t kBig = 48 * (uint64_t{1} << 20);
  const FrameworkMemory before = FrameworkMemoryUsage();
  { torch::Tensor a = torch::empty({kElements * 4}, torch::kFloat); }  // 48 MiB
  const FrameworkMemory after = FrameworkMemoryUsage();
  const uint64_t most = std::max(before.max_bytes, before.current_bytes + kBig);
  EXPECT_EQ(after.max_bytes, most);
  const bool fits = before.current_bytes + before.cached_bytes + kBig <= most + most / 4;
  EXPECT_EQ(after.cached_bytes, before.cached_bytes + (fits ? kBig : 0));
  EXPECT_LE(after.current_bytes + after.cached_bytes, after.max_bytes + after.max_bytes / 4);
  if (fits) {
    // Once more with the 48 MiB cached: a second one raises the most ever live.
    torch::Tensor a = torch::empty({kElements * 4}, torch::kFloat);
    torch::Tensor b = torch::empty({kElements * 4}, torch::kFloat);
  }
  const FrameworkMemory two = FrameworkMemoryUsage();
  EXPECT_LE(two.current_bytes + two.cached_bytes, two.max_bytes + two.max_bytes / 4);

  // Trimming gives back the smallest block that covers the request; with none that large,
  // the largest first until what was asked for is given back.
  {
    torch::Tensor a = torch::empty({kElements}, torch::kFloat);      // 12 MiB
    torch::Tensor b = torch::empty({kElements / 4}, torch::kFloat);  // 3 MiB
  }
  const uint64_t before_trim = FrameworkMemoryUsage().cached_bytes;
  ASSERT_GE(before_trim, 15 * (uint64_t{1} << 20));
  EXPECT_EQ(TrimFrameworkCache(1), uint64_t{3} << 20);
  EXPECT_EQ(TrimFrameworkCache(uint64_t{4} << 20), uint64_t{12} << 20);
  EXPECT_EQ(FrameworkMemoryUsage().cached_bytes, before_trim - (uint64_t{15} << 20));
  const uint64_t cached = FrameworkMemoryUsage().cached_bytes;
  EXPECT_EQ(TrimFrameworkCache(cached + 1), cached);  // none covers it: all of them
  EXPECT_EQ(FrameworkMemoryUsage().cached_bytes, 0u);
  SetFrameworkCaching(false);
  { torch::Tensor t = torch::ones({kElements}, torch::kFloat); }
  EXPECT_EQ(FrameworkMemoryUsage().cached_bytes, 0u);
  SetFrameworkCaching(true);
}

// A request with no cached block of its class takes one of a larger class up to twice it,
// already paged in, rather than faulting in a new one; a smaller request does not.
TEST(FrameworkAllocator, RequestWithoutItsClassCached_TakesALargerCachedBlockUpToTwiceIt) {
  InstallFrameworkAllocator();
  SetFrameworkCaching(true);
  EmptyFrameworkCache();
  constexpr int64_t kMiBFloats = (1 << 20) / sizeof(float);
  void* eight = nullptr;
  {
    torch::Tensor t = torch::ones({8 * kMiBFloats}, torch::kFloat);
    eight = t.data_ptr();
  }
  ASSERT_GE(FrameworkMemoryUsage().cached_bytes, uint64_t{8} << 20);
  {
    torch::Tensor five = torch::empty({5 * kMiBFloats}, torch::kFloat);
    EXPECT_EQ(five.data_ptr(), eight);
    five.fill_(1.0f);
    EXPECT_EQ(five.sum().item<double>(), 5.0 * kMiBFloats);
  }
  {
    torch::Tensor three = torch::empty({3 * kMiBFloats}, torch::kFloat);
    EXPECT_NE(three.data_ptr(), eight);
  }
  EmptyFrameworkCache();
}

// A large block the cache gives back goes back to the kernel, whatever glibc keeps: with its
// mmap and trim thresholds raised (as a process may set them), a tensor's block taken from the
// heap stayed resident after the cache let it go.
TEST(FrameworkAllocator, LargeBlockTheCacheGivesBack_LeavesTheProcessResidentMemory) {
  InstallFrameworkAllocator();
  SetFrameworkCaching(true);
  mallopt(M_MMAP_THRESHOLD, 256 << 20);
  mallopt(M_TRIM_THRESHOLD, 512 << 20);
  constexpr int64_t kElements = 16 << 20;  // 64 MiB
  constexpr uint64_t kBytes = kElements * sizeof(float);
  EmptyFrameworkCache();
  const uint64_t before = ResidentBytes();
  uint64_t touched = 0;
  {
    torch::Tensor t = torch::ones({kElements}, torch::kFloat);
    touched = ResidentBytes();
  }
  EXPECT_GE(touched, before + kBytes - (uint64_t{4} << 20));
  EmptyFrameworkCache();
  const uint64_t after = ResidentBytes();
  EXPECT_LT(after, touched - kBytes + (uint64_t{8} << 20))
      << "resident: " << before << " before, " << touched << " touched, " << after << " freed";
}

constexpr uint64_t kMiB = uint64_t{1} << 20;

// Charged to a pool, LibTorch's live bytes count against its DEVICE budget with the pool's own
// buffers, each side failing when the other holds the room, and usage tells the two apart.
// Under a DEVICE budget a request takes only a cached block of its own class: a larger one
// would charge more than the request and could run out a budget the request fits (gemini's
// quarter-of-the-model budget did, with a 2 MiB block serving a smaller request).
TEST(FrameworkBudget, UnderABudget_ARequestTakesOnlyItsOwnClassFromTheCache) {
  InstallFrameworkAllocator();
  SetFrameworkCaching(true);
  EmptyFrameworkCache();
  MemoryPool pool;
  ChargeFrameworkTo(&pool);
  constexpr int64_t kMiBFloats = kMiB / sizeof(float);
  void* eight = nullptr;
  {
    torch::Tensor t = torch::ones({8 * kMiBFloats}, torch::kFloat);
    eight = t.data_ptr();
  }
  ASSERT_GE(FrameworkMemoryUsage().cached_bytes, 8 * kMiB);
  const uint64_t before = pool.Usage(CAI_MEM_DEVICE).framework_bytes;
  pool.SetBudget(CAI_MEM_DEVICE, before + 64 * kMiB);
  {
    torch::Tensor five = torch::empty({5 * kMiBFloats}, torch::kFloat);
    EXPECT_NE(five.data_ptr(), eight);
    EXPECT_EQ(pool.Usage(CAI_MEM_DEVICE).framework_bytes - before, 5 * kMiB);  // its own class
  }
  ChargeFrameworkTo(nullptr);
  EmptyFrameworkCache();
}

TEST(FrameworkBudget, PoolBuffersAndLibTorchShareTheDeviceBudget) {
  InstallFrameworkAllocator();
  MemoryPool pool;
  ChargeFrameworkTo(&pool);
  {
    torch::Tensor t = torch::empty({int64_t{1} << 20}, torch::kFloat);  // 4 MiB
    EXPECT_GE(pool.Usage(CAI_MEM_DEVICE).framework_bytes, 4 * kMiB);
  }
  const TierUsage idle = pool.Usage(CAI_MEM_DEVICE);
  EXPECT_LT(idle.framework_bytes, 4 * kMiB);  // freed: uncharged, cached or not
  EXPECT_GE(idle.framework_peak_bytes, 4 * kMiB);
  EXPECT_EQ(pool.Usage(CAI_MEM_HOST).framework_bytes, 0u);  // the device tier's alone

  pool.SetBudget(CAI_MEM_DEVICE, idle.framework_bytes + 8 * kMiB);
  cai_buffer* buffer = pool.Allocate(CAI_MEM_DEVICE, 6 * kMiB, 0, "zero.master");
  const std::string unit_name = "h.2";
  try {
    AllocationSite site("forward", 3, &unit_name);
    torch::Tensor t = torch::empty({int64_t{1} << 20}, torch::kFloat);
    ADD_FAILURE() << "4 MiB fitted beside 6 MiB of buffers in a budget of 8 MiB";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), CAI_RESOURCE_EXHAUSTED);
    for (const char* fragment :
         {"device out of memory: cannot allocate 4194304 bytes (4.00 MiB) for LibTorch's "
          "tensors in forward of unit 3 ('h.2') on memory tier DEVICE",
          "and the strategy's buffers 6291456 bytes (6.00 MiB) (1 buffers)",
          "raise memory.device_budget"}) {
      EXPECT_NE(std::string(e.what()).find(fragment), std::string::npos) << e.what();
    }
  }
  EXPECT_EQ(pool.Usage(CAI_MEM_DEVICE).framework_bytes, idle.framework_bytes);  // nothing kept
  pool.Free(buffer);
  {
    torch::Tensor t = torch::empty({int64_t{1} << 20}, torch::kFloat);  // fits now
    try {
      pool.Allocate(CAI_MEM_DEVICE, 6 * kMiB);
      ADD_FAILURE() << "6 MiB of buffers fitted beside 4 MiB of LibTorch's in 8 MiB";
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), CAI_RESOURCE_EXHAUSTED);
      EXPECT_NE(std::string(e.what()).find("by LibTorch's tensors"), std::string::npos) << e.what();
    }
    // A budget below what both hold is refused, naming LibTorch's part.
    EXPECT_THROW(pool.SetBudget(CAI_MEM_DEVICE, 2 * kMiB), Error);
  }
  const TierUsage end = pool.Usage(CAI_MEM_DEVICE);
  EXPECT_GE(end.total_peak_bytes, idle.framework_bytes + 6 * kMiB);
  EXPECT_LE(end.total_peak_bytes, end.budget_bytes);
  pool.ResetPeak(CAI_MEM_DEVICE);
  EXPECT_EQ(pool.Usage(CAI_MEM_DEVICE).total_peak_bytes, end.framework_bytes);

  // Blocks charged before charging stops are uncharged when freed; later ones never charged.
  torch::Tensor charged = torch::empty({int64_t{1} << 20}, torch::kFloat);
  ChargeFrameworkTo(nullptr);
  torch::Tensor uncharged = torch::empty({int64_t{1} << 20}, torch::kFloat);
  EXPECT_EQ(pool.Usage(CAI_MEM_DEVICE).framework_bytes, end.framework_bytes + 4 * kMiB);
  charged = torch::Tensor();
  uncharged = torch::Tensor();
  EXPECT_EQ(pool.Usage(CAI_MEM_DEVICE).framework_bytes, end.framework_bytes);
}

// A model's forward beyond the budget fails with the device out-of-memory error of the unit it
// was in, and the model trains again once the budget allows.
TEST(FrameworkBudget, ForwardBeyondTheBudget_FailsNamingTheUnit) {
  InstallFrameworkAllocator();
  ModelConfig c;
  c.vocab_size = 64;
  c.n_ctx = 16;
  c.n_layer = 2;
  c.n_head = 2;
  c.n_embd = 32;
  auto model = MakeZooModel(c, 1);
  std::vector<int64_t> tokens(2 * 16), targets(2 * 16);
  for (size_t i = 0; i < tokens.size(); ++i) {
    tokens[i] = static_cast<int64_t>(i * 7 % 64);
    targets[i] = static_cast<int64_t>((i + 1) * 7 % 64);
  }
  int64_t shape[2] = {2, 16}, strides[2] = {16, 1};
  const cai_dtype i64{CAI_DTYPE_INT, 64, 1};
  const cai_tensor tok{tokens.data(), {CAI_DEVICE_CPU, 0}, 2, i64, shape, strides, 0};
  const cai_tensor tgt{targets.data(), {CAI_DEVICE_CPU, 0}, 2, i64, shape, strides, 0};
  const double unbounded = model->ForwardBackward(tok, tgt, true, 1.0, 1.0);

  MemoryPool pool;
  ChargeFrameworkTo(&pool);
  // Room for the inputs' copies, not for the first unit's activations [2, 16, 32].
  pool.SetBudget(CAI_MEM_DEVICE, 2 * tokens.size() * sizeof(int64_t) + 64);
  try {
    model->ForwardBackward(tok, tgt, true, 1.0, 1.0);
    ADD_FAILURE() << "the forward fitted in " << pool.Usage(CAI_MEM_DEVICE).budget_bytes;
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), CAI_RESOURCE_EXHAUSTED) << e.what();
    EXPECT_NE(std::string(e.what()).find("for LibTorch's tensors in forward of unit 0 ('"),
              std::string::npos)
        << e.what();
  }
  pool.SetBudget(CAI_MEM_DEVICE, 0);
  model->ZeroGrad(true);
  EXPECT_EQ(model->ForwardBackward(tok, tgt, true, 1.0, 1.0), unbounded);
  ChargeFrameworkTo(nullptr);
}

}  // namespace
}  // namespace cai
