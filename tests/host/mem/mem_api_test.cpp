// The memory service through its ABI table, as a plugin sees it.
#include "mem/mem_api.h"

#include <gtest/gtest.h>

#include <cstring>
#include <limits>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "cai/mempool.h"
#include "core/status.h"
#include "mem/float16.h"

namespace cai {
namespace {

// The status's code and message; destroys it.
std::pair<cai_status_code, std::string> Take(cai_status* s) {
  std::pair<cai_status_code, std::string> r{StatusCode(s), StatusMessage(s)};
  DestroyStatus(s);
  return r;
}

cai_mem_alloc_args AllocArgs(cai_mem_tier tier, size_t bytes) {
  cai_mem_alloc_args a{};
  a.struct_size = CAI_MEM_ALLOC_ARGS_STRUCT_SIZE;
  a.tier = tier;
  a.bytes = bytes;
  return a;
}

cai_mem_usage UsageOf(cai_mem_tier tier) {
  cai_mem_usage u{};
  u.struct_size = CAI_MEM_USAGE_STRUCT_SIZE;
  EXPECT_EQ(MemApi()->usage(tier, &u), nullptr);
  return u;
}

// A contiguous 1-D descriptor over caller-owned memory.
struct Tensor {
  int64_t shape[1];
  int64_t stride[1] = {1};
  cai_tensor t{};
  Tensor(void* data, cai_dtype dtype, int64_t n) : shape{n} {
    t.data = data;
    t.device = {CAI_DEVICE_CPU, 0};
    t.ndim = 1;
    t.dtype = dtype;
    t.shape = shape;
    t.strides = stride;
  }
};

constexpr cai_dtype kF32{CAI_DTYPE_FLOAT, 32, 1};
constexpr cai_dtype kF16{CAI_DTYPE_FLOAT, 16, 1};
constexpr cai_dtype kBf16{CAI_DTYPE_BFLOAT, 16, 1};

cai_mem_kernel_args KernelArgs(cai_mem_kernel_op op, const cai_tensor* x, const cai_tensor* y,
                               double alpha = 0, double* result = nullptr) {
  cai_mem_kernel_args a{};
  a.struct_size = CAI_MEM_KERNEL_ARGS_STRUCT_SIZE;
  a.op = op;
  a.x = x;
  a.y = y;
  a.alpha = alpha;
  a.result = result;
  return a;
}

TEST(MemApi, Table_IsFullyFilled) {
  const cai_mem_api* api = MemApi();
  ASSERT_NE(api, nullptr);
  EXPECT_EQ(api->struct_size, CAI_MEM_API_STRUCT_SIZE);
  EXPECT_TRUE(api->alloc && api->free && api->view && api->data && api->size && api->tier &&
              api->set_budget && api->usage && api->reset_peak && api->copy && api->kernel);
}

TEST(MemApi, AllocViewFree_AccountsAndReturnsToZero) {
  const cai_mem_api* api = MemApi();
  const uint64_t before = UsageOf(CAI_MEM_HOST).current_bytes;
  cai_mem_alloc_args args = AllocArgs(CAI_MEM_HOST, 4000);
  args.zero_fill = true;
  args.tag = "test.buffer";
  cai_buffer* b = nullptr;
  ASSERT_EQ(api->alloc(&args, &b), nullptr);
  ASSERT_NE(b, nullptr);
  EXPECT_EQ(api->size(b), 4000u);
  EXPECT_EQ(api->tier(b), CAI_MEM_HOST);
  EXPECT_EQ(UsageOf(CAI_MEM_HOST).current_bytes, before + 4000);

  cai_tensor f32{}, f16{};
  ASSERT_EQ(api->view(b, kF32, &f32), nullptr);
  ASSERT_EQ(api->view(b, kF16, &f16), nullptr);
  // The first view stays valid after the second, with its own element count.
  EXPECT_EQ(f32.shape[0], 1000);
  EXPECT_EQ(f16.shape[0], 2000);
  EXPECT_EQ(f32.strides[0], 1);
  EXPECT_EQ(f32.data, api->data(b));
  EXPECT_EQ(f32.ndim, 1);
  EXPECT_EQ(f32.device.device_type, CAI_DEVICE_CPU);
  EXPECT_EQ(static_cast<float*>(f32.data)[999], 0.0f);

  api->free(b);
  api->free(nullptr);
  EXPECT_EQ(UsageOf(CAI_MEM_HOST).current_bytes, before);
}

TEST(MemApi, OverBudget_ReturnsResourceExhaustedAndLeavesOutUntouched) {
  const cai_mem_api* api = MemApi();
  ASSERT_EQ(api->set_budget(CAI_MEM_DEVICE, 1 << 20), nullptr);
  cai_mem_alloc_args args = AllocArgs(CAI_MEM_DEVICE, 2 << 20);
  cai_buffer* sentinel = reinterpret_cast<cai_buffer*>(0x1);
  cai_buffer* out = sentinel;
  auto [code, msg] = Take(api->alloc(&args, &out));
  EXPECT_EQ(code, CAI_RESOURCE_EXHAUSTED);
  EXPECT_NE(msg.find("DEVICE"), std::string::npos) << msg;
  EXPECT_NE(msg.find("2097152 bytes"), std::string::npos) << msg;
  EXPECT_NE(msg.find("1048576 bytes"), std::string::npos) << msg;
  EXPECT_EQ(out, sentinel);
  EXPECT_EQ(UsageOf(CAI_MEM_DEVICE).budget_bytes, 1u << 20);
  ASSERT_EQ(api->set_budget(CAI_MEM_DEVICE, 0), nullptr);
}

TEST(MemApi, StructSizeTooSmallOrNullArguments_AreInvalidArguments) {
  const cai_mem_api* api = MemApi();
  cai_buffer* out = nullptr;
  cai_mem_alloc_args args = AllocArgs(CAI_MEM_HOST, 64);
  args.struct_size = CAI_STRUCT_SIZE(cai_mem_alloc_args, zero_fill) - 1;  // short of ABI 1.0's
  auto [code, msg] = Take(api->alloc(&args, &out));
  EXPECT_EQ(code, CAI_INVALID_ARGUMENT);
  EXPECT_NE(msg.find("struct_size"), std::string::npos) << msg;
  EXPECT_EQ(Take(api->alloc(nullptr, &out)).first, CAI_INVALID_ARGUMENT);
  args.struct_size = CAI_MEM_ALLOC_ARGS_STRUCT_SIZE;
  EXPECT_EQ(Take(api->alloc(&args, nullptr)).first, CAI_INVALID_ARGUMENT);
  args.tier = CAI_MEM_NUM_TIERS;
  EXPECT_EQ(Take(api->alloc(&args, &out)).first, CAI_INVALID_ARGUMENT);
  args.tier = CAI_MEM_HOST;
  args.alignment = 3;
  EXPECT_EQ(Take(api->alloc(&args, &out)).first, CAI_INVALID_ARGUMENT);
  EXPECT_EQ(out, nullptr);

  cai_mem_usage usage{};
  usage.struct_size = 8;
  EXPECT_EQ(Take(api->usage(CAI_MEM_HOST, &usage)).first, CAI_INVALID_ARGUMENT);
  cai_mem_kernel_args k = KernelArgs(CAI_KERNEL_FILL, nullptr, nullptr);
  EXPECT_EQ(Take(api->kernel(&k)).first, CAI_INVALID_ARGUMENT);
  k.struct_size = 16;
  EXPECT_EQ(Take(api->kernel(&k)).first, CAI_INVALID_ARGUMENT);
  EXPECT_EQ(Take(api->kernel(nullptr)).first, CAI_INVALID_ARGUMENT);
  EXPECT_EQ(Take(api->copy(nullptr, &usage, 4, nullptr)).first, CAI_INVALID_ARGUMENT);
}

TEST(MemApi, Copy_BetweenTiers_CopiesBytes) {
  const cai_mem_api* api = MemApi();
  cai_mem_alloc_args a = AllocArgs(CAI_MEM_NVME, 1 << 20), b = AllocArgs(CAI_MEM_DEVICE, 1 << 20);
  cai_buffer *nvme = nullptr, *device = nullptr;
  ASSERT_EQ(api->alloc(&a, &nvme), nullptr);
  ASSERT_EQ(api->alloc(&b, &device), nullptr);
  auto* src = static_cast<uint8_t*>(api->data(device));
  for (size_t i = 0; i < (1 << 20); ++i) src[i] = static_cast<uint8_t>(i ^ (i >> 8));
  ASSERT_EQ(api->copy(api->data(nvme), src, 1 << 20, nullptr), nullptr);
  EXPECT_EQ(std::memcmp(api->data(nvme), src, 1 << 20), 0);
  // Overlapping ranges behave like memmove.
  ASSERT_EQ(api->copy(src + 1, src, 100, nullptr), nullptr);
  EXPECT_EQ(src[1], static_cast<const uint8_t*>(api->data(nvme))[0]);
  api->free(nvme);
  api->free(device);
}

cai_mem_transfer_args TransferArgs(cai_buffer* b, size_t offset, void* memory, size_t bytes,
                                   cai_mem_direction direction, bool async) {
  cai_mem_transfer_args t{};
  t.struct_size = CAI_MEM_TRANSFER_ARGS_STRUCT_SIZE;
  t.buffer = b;
  t.offset = offset;
  t.memory = memory;
  t.bytes = bytes;
  t.direction = direction;
  t.async = async;
  return t;
}

// An unmapped NVMe buffer has no address; its bytes move with transfer, synchronously or on the
// copy thread in submission order, and errors of an asynchronous one come from wait_transfer.
TEST(MemApi, UnmappedNvme_MovesBytesOnlyThroughTransferAndAsyncRunsInOrder) {
  const cai_mem_api* api = MemApi();
  cai_mem_alloc_args a = AllocArgs(CAI_MEM_NVME, 3 << 20);
  a.flags = CAI_MEM_ALLOC_UNMAPPED;
  a.tag = "gemini.optim";
  cai_buffer* nvme = nullptr;
  ASSERT_EQ(api->alloc(&a, &nvme), nullptr);
  EXPECT_EQ(api->data(nvme), nullptr);
  EXPECT_EQ(api->size(nvme), size_t{3} << 20);
  cai_tensor view{};
  auto [code, message] = Take(api->view(nvme, {CAI_DTYPE_FLOAT, 32, 1}, &view));
  EXPECT_EQ(code, CAI_FAILED_PRECONDITION);
  EXPECT_NE(message.find("gemini.optim"), std::string::npos) << message;

  std::vector<uint8_t> first(1 << 20), second(1 << 20), back(1 << 20);
  for (size_t i = 0; i < first.size(); ++i) {
    first[i] = static_cast<uint8_t>(i * 7);
    second[i] = static_cast<uint8_t>(i * 13 + 1);
  }
  cai_mem_transfer_args sync =
      TransferArgs(nvme, 100, first.data(), first.size(), CAI_MEM_INTO_BUFFER, false);
  cai_mem_transfer* none = reinterpret_cast<cai_mem_transfer*>(&sync);  // must be cleared
  ASSERT_EQ(api->transfer(&sync, &none), nullptr);
  EXPECT_EQ(none, nullptr);
  // Queued: write `second` over it, then read it back; the read sees the write.
  cai_mem_transfer *write = nullptr, *read = nullptr;
  cai_mem_transfer_args w =
      TransferArgs(nvme, 100, second.data(), second.size(), CAI_MEM_INTO_BUFFER, true);
  cai_mem_transfer_args r =
      TransferArgs(nvme, 100, back.data(), back.size(), CAI_MEM_OUT_OF_BUFFER, true);
  ASSERT_EQ(api->transfer(&w, &write), nullptr);
  ASSERT_EQ(api->transfer(&r, &read), nullptr);
  ASSERT_NE(write, nullptr);
  ASSERT_NE(read, nullptr);
  EXPECT_EQ(api->wait_transfer(write), nullptr);
  EXPECT_EQ(api->wait_transfer(read), nullptr);
  EXPECT_EQ(back, second);
  // Past the end: refused at once when synchronous, from wait_transfer when not.
  cai_mem_transfer_args past =
      TransferArgs(nvme, (3 << 20) - 10, back.data(), 11, CAI_MEM_OUT_OF_BUFFER, false);
  std::tie(code, message) = Take(api->transfer(&past, nullptr));
  EXPECT_EQ(code, CAI_INVALID_ARGUMENT);
  EXPECT_NE(message.find("runs past the end of the 3145728-byte buffer \"gemini.optim\""),
            std::string::npos)
      << message;
  past.async = true;
  cai_mem_transfer* late = nullptr;
  ASSERT_EQ(api->transfer(&past, &late), nullptr);
  EXPECT_EQ(Take(api->wait_transfer(late)).first, CAI_INVALID_ARGUMENT);
  EXPECT_EQ(api->wait_transfer(nullptr), nullptr);
  EXPECT_EQ(Take(api->transfer(&past, nullptr)).first, CAI_INVALID_ARGUMENT);  // async, no out
  api->free(nvme);

  // Mapped buffers take transfers too; unmapped is NVMe's alone; unknown flags are refused.
  cai_mem_alloc_args h = AllocArgs(CAI_MEM_HOST, 4096);
  cai_buffer* host = nullptr;
  ASSERT_EQ(api->alloc(&h, &host), nullptr);
  cai_mem_transfer_args into =
      TransferArgs(host, 0, first.data(), 4096, CAI_MEM_INTO_BUFFER, false);
  ASSERT_EQ(api->transfer(&into, nullptr), nullptr);
  EXPECT_EQ(std::memcmp(api->data(host), first.data(), 4096), 0);
  api->free(host);
  h.flags = CAI_MEM_ALLOC_UNMAPPED;
  std::tie(code, message) = Take(api->alloc(&h, &host));
  EXPECT_EQ(code, CAI_INVALID_ARGUMENT);
  EXPECT_NE(message.find("only NVME blocks can be unmapped"), std::string::npos) << message;
  h.flags = 1u << 7;
  std::tie(code, message) = Take(api->alloc(&h, &host));
  EXPECT_EQ(code, CAI_INVALID_ARGUMENT);
  EXPECT_NE(message.find("unknown flags 0x80"), std::string::npos) << message;
}

TEST(MemApi, Kernels_ComputeThroughDescriptors) {
  const cai_mem_api* api = MemApi();
  std::vector<float> y = {1, -2, 3, 0.1f};
  std::vector<uint16_t> bf(4), half(4);
  Tensor ty(y.data(), kF32, 4), tbf(bf.data(), kBf16, 4), thalf(half.data(), kF16, 4);

  cai_mem_kernel_args k = KernelArgs(CAI_KERNEL_COPY, &ty.t, &tbf.t);
  ASSERT_EQ(api->kernel(&k), nullptr);
  EXPECT_EQ(bf[3], FloatToBf16(0.1f));
  k = KernelArgs(CAI_KERNEL_COPY, &tbf.t, &thalf.t);
  ASSERT_EQ(api->kernel(&k), nullptr);
  EXPECT_EQ(half[3], FloatToHalf(Bf16ToFloat(FloatToBf16(0.1f))));

  k = KernelArgs(CAI_KERNEL_AXPY, &tbf.t, &ty.t, 2.0);
  ASSERT_EQ(api->kernel(&k), nullptr);
  EXPECT_EQ(y[0], 3.0f);
  EXPECT_EQ(y[1], -6.0f);

  k = KernelArgs(CAI_KERNEL_SCALE, nullptr, &ty.t, 0.5);
  ASSERT_EQ(api->kernel(&k), nullptr);
  EXPECT_EQ(y[2], 4.5f);

  double result = -1;
  k = KernelArgs(CAI_KERNEL_SUM_SQUARES, nullptr, &ty.t, 0, &result);
  ASSERT_EQ(api->kernel(&k), nullptr);
  double want = 0;
  for (float v : y) want += static_cast<double>(v) * v;
  EXPECT_EQ(result, want);

  k = KernelArgs(CAI_KERNEL_ALL_FINITE, nullptr, &ty.t, 0, &result);
  ASSERT_EQ(api->kernel(&k), nullptr);
  EXPECT_EQ(result, 1.0);
  y[1] = std::numeric_limits<float>::quiet_NaN();
  ASSERT_EQ(api->kernel(&k), nullptr);
  EXPECT_EQ(result, 0.0);

  k = KernelArgs(CAI_KERNEL_FILL, nullptr, &thalf.t, -1.5);
  ASSERT_EQ(api->kernel(&k), nullptr);
  EXPECT_EQ(half[0], FloatToHalf(-1.5f));
}

TEST(MemApi, KernelDtypeOrShapeMismatch_IsInvalidArgumentNamingIt) {
  const cai_mem_api* api = MemApi();
  std::vector<float> y(4);
  std::vector<uint16_t> h(4);
  std::vector<int32_t> ints(4);
  Tensor ty(y.data(), kF32, 4), th(h.data(), kF16, 4), tshort(y.data(), kF32, 3),
      tint(ints.data(), cai_dtype{CAI_DTYPE_INT, 32, 1}, 4);

  cai_mem_kernel_args k = KernelArgs(CAI_KERNEL_AXPY, &ty.t, &th.t, 1.0);
  auto [code, msg] = Take(api->kernel(&k));
  EXPECT_EQ(code, CAI_INVALID_ARGUMENT);
  EXPECT_NE(msg.find("float32"), std::string::npos) << msg;

  k = KernelArgs(CAI_KERNEL_COPY, &ty.t, &tshort.t);
  std::tie(code, msg) = Take(api->kernel(&k));
  EXPECT_EQ(code, CAI_INVALID_ARGUMENT);
  EXPECT_NE(msg.find("elements"), std::string::npos) << msg;

  k = KernelArgs(CAI_KERNEL_COPY, &tint.t, &ty.t);
  std::tie(code, msg) = Take(api->kernel(&k));
  EXPECT_EQ(code, CAI_INVALID_ARGUMENT);
  EXPECT_NE(msg.find("int32"), std::string::npos) << msg;

  k = KernelArgs(CAI_KERNEL_SUM_SQUARES, nullptr, &ty.t);  // result NULL
  EXPECT_EQ(Take(api->kernel(&k)).first, CAI_INVALID_ARGUMENT);

  int64_t shape2[2] = {2, 2}, strides2[2] = {1, 2};  // column-major: not contiguous
  cai_tensor strided = ty.t;
  strided.ndim = 2;
  strided.shape = shape2;
  strided.strides = strides2;
  k = KernelArgs(CAI_KERNEL_FILL, nullptr, &strided, 1.0);
  std::tie(code, msg) = Take(api->kernel(&k));
  EXPECT_EQ(code, CAI_INVALID_ARGUMENT);
  EXPECT_NE(msg.find("contiguous"), std::string::npos) << msg;

  cai_tensor on_gpu = ty.t;
  on_gpu.device = {CAI_DEVICE_CUDA, 0};
  k = KernelArgs(CAI_KERNEL_FILL, nullptr, &on_gpu, 1.0);
  EXPECT_EQ(Take(api->kernel(&k)).first, CAI_INVALID_ARGUMENT);

  // Same-dtype copies of any dtype are plain byte copies.
  std::vector<int32_t> ints2 = {1, 2, 3, 4};
  Tensor tint2(ints2.data(), cai_dtype{CAI_DTYPE_INT, 32, 1}, 4);
  k = KernelArgs(CAI_KERNEL_COPY, &tint2.t, &tint.t);
  ASSERT_EQ(api->kernel(&k), nullptr);
  EXPECT_EQ(ints[3], 4);
}

TEST(MemApi, ByteOffsetAndContiguous2D_AreHonoured) {
  std::vector<float> y(8, 1.0f);
  int64_t shape[2] = {2, 3}, strides[2] = {3, 1};
  cai_tensor t{};
  t.data = y.data();
  t.device = {CAI_DEVICE_CPU, 0};
  t.ndim = 2;
  t.dtype = kF32;
  t.shape = shape;
  t.strides = strides;
  t.byte_offset = 2 * sizeof(float);
  cai_mem_kernel_args k = KernelArgs(CAI_KERNEL_FILL, nullptr, &t, 7.0);
  ASSERT_EQ(MemApi()->kernel(&k), nullptr);
  EXPECT_EQ(y, (std::vector<float>{1, 1, 7, 7, 7, 7, 7, 7}));
}

}  // namespace
}  // namespace cai
