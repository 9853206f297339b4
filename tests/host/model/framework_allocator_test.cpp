// The counting allocator in front of LibTorch's CPU allocator: what LibTorch allocates for
// itself is counted while it lives, and the peak outlives it.
#include "model/framework_allocator.h"

#include <c10/core/CPUAllocator.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <algorithm>
#include <cstdint>

namespace cai {
namespace {

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

  // Live and cached together never exceed the most ever live: a freed block is kept only if
  // that holds, else given back.
  constexpr uint64_t kBig = 48 * (uint64_t{1} << 20);
  const FrameworkMemory before = FrameworkMemoryUsage();
  { torch::Tensor a = torch::empty({kElements * 4}, torch::kFloat); }  // 48 MiB
  const FrameworkMemory after = FrameworkMemoryUsage();
  const uint64_t most = std::max(before.max_bytes, before.current_bytes + kBig);
  EXPECT_EQ(after.max_bytes, most);
  const bool fits = before.current_bytes + before.cached_bytes + kBig <= most;
  EXPECT_EQ(after.cached_bytes, before.cached_bytes + (fits ? kBig : 0));
  EXPECT_LE(after.current_bytes + after.cached_bytes, after.max_bytes);
  if (fits) {
    // Once more with the 48 MiB cached: a second one would exceed the most ever live.
    torch::Tensor a = torch::empty({kElements * 4}, torch::kFloat);
    torch::Tensor b = torch::empty({kElements * 4}, torch::kFloat);
  }
  EXPECT_LE(FrameworkMemoryUsage().current_bytes + FrameworkMemoryUsage().cached_bytes,
            FrameworkMemoryUsage().max_bytes);

  // Trimming gives back the largest blocks first, at least what was asked for.
  {
    torch::Tensor a = torch::empty({kElements}, torch::kFloat);      // 12 MiB
    torch::Tensor b = torch::empty({kElements / 4}, torch::kFloat);  // 3 MiB
  }
  const uint64_t before_trim = FrameworkMemoryUsage().cached_bytes;
  ASSERT_GE(before_trim, 15 * (uint64_t{1} << 20));
  EXPECT_GE(TrimFrameworkCache(1), uint64_t{12} << 20);
  EXPECT_LE(FrameworkMemoryUsage().cached_bytes, before_trim - (uint64_t{12} << 20));
  const uint64_t cached = FrameworkMemoryUsage().cached_bytes;
  EXPECT_EQ(EmptyFrameworkCache(), cached);
  EXPECT_EQ(FrameworkMemoryUsage().cached_bytes, 0u);
  SetFrameworkCaching(false);
  { torch::Tensor t = torch::ones({kElements}, torch::kFloat); }
  EXPECT_EQ(FrameworkMemoryUsage().cached_bytes, 0u);
  SetFrameworkCaching(true);
}

}  // namespace
}  // namespace cai
