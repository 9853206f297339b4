// The counting allocator in front of LibTorch's CPU allocator: what LibTorch allocates for
// itself is counted while it lives, and the peak outlives it.
#include "model/framework_allocator.h"

#include <c10/core/CPUAllocator.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

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

}  // namespace
}  // namespace cai
