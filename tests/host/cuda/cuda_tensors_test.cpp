// CUDA tensors through the communicator and the optimizer service. Without a GPU (as in CI)
// this proves that the dispatch reaches libcai_cuda.so and that every layer answers with an
// error that says what is missing; with a GPU it checks results against the CPU.
#include <cmath>
#include <cstring>
#include <string>
#include <vector>

#include "comm_test_util.h"
#include "cuda/cuda_module.h"
#include "optim/fused_update.h"
#include "optim/optimizer.h"
#include "util/subprocess.h"

#ifdef CAI_TEST_CUDA_RUNTIME
#include <cuda_runtime.h>
#endif

namespace cai::test {
namespace {

using std::chrono::milliseconds;

int Devices() {
#ifdef CAI_TEST_CUDA_RUNTIME
  return cuda::Load().DeviceCount();
#else
  return 0;
#endif
}

// What a CUDA tensor must be answered with on a machine that cannot run it.
void ExpectWhyNot(cai_status_code code, const std::string& message, const std::string& what) {
#ifdef CAI_TEST_CUDA_RUNTIME
  EXPECT_EQ(code, CAI_FAILED_PRECONDITION) << message;
  CAI_EXPECT_CONTAINS(message, what + " is on CUDA device 0 but this process sees 0 CUDA device");
  CAI_EXPECT_CONTAINS(message, "CUDA_VISIBLE_DEVICES");
#else
  (void)what;
  EXPECT_EQ(code, CAI_UNAVAILABLE) << message;
  CAI_EXPECT_CONTAINS(message, "this cai was built without CUDA");
#endif
}

#ifdef CAI_TEST_CUDA_RUNTIME
// Device memory holding a copy of `host`.
template <class T>
struct DeviceArray {
  explicit DeviceArray(const std::vector<T>& host) : n(host.size()) {
    EXPECT_EQ(cudaMalloc(&ptr, n * sizeof(T)), cudaSuccess);
    cudaMemcpy(ptr, host.data(), n * sizeof(T), cudaMemcpyHostToDevice);
  }
  ~DeviceArray() { cudaFree(ptr); }
  std::vector<T> Read() const {
    std::vector<T> host(n);
    cudaDeviceSynchronize();
    cudaMemcpy(host.data(), ptr, n * sizeof(T), cudaMemcpyDeviceToHost);
    return host;
  }
  T* ptr = nullptr;
  size_t n;
};
#endif

TEST(CudaTensors, Comm_AllReduceOfACudaTensor_RunsOnNcclOrSaysWhyNot) {
  RunRanks(1, [](const RankContext& ctx) {
    InitRank(ctx, milliseconds(20000));
    HostTensor<float> x(1000, kF32);
    for (size_t i = 0; i < x.data.size(); ++i) x.data[i] = static_cast<float>(i % 7);
    x.t.device = {CAI_DEVICE_CUDA, 0};
    if (Devices() == 0) {
      cai_comm_args args = Args(CAI_COMM_ALL_REDUCE, nullptr, &x.t);
      const Outcome o = Take(CommApi()->run(&args, nullptr));
      CAI_EXPECT_CONTAINS(o.message, "all_reduce on group 'world' (rank 0) with CUDA tensors: ");
      ExpectWhyNot(o.code, o.message, "NCCL communicator for group 'group-0-device-0'");
      return;
    }
#ifdef CAI_TEST_CUDA_RUNTIME
    DeviceArray<float> device(x.data);
    x.t.data = device.ptr;
    cai_comm_args args = Args(CAI_COMM_ALL_REDUCE, nullptr, &x.t);
    RunOp(args);
    EXPECT_EQ(device.Read(), x.data);
    cai_comm_counters counters{};
    counters.struct_size = sizeof(counters);
    Take(CommApi()->counters(nullptr, &counters));
    EXPECT_EQ(counters.bytes[CAI_COMM_ALL_REDUCE], 4000u);
    // NCCL's traffic never crosses the host's sockets: not measured, and counted as such.
    const WireCounters wire = Communicator::Get()->WireBytes(nullptr);
    EXPECT_EQ(wire.bytes[CAI_COMM_ALL_REDUCE], 0u);
    EXPECT_EQ(wire.unmeasured_calls[CAI_COMM_ALL_REDUCE], 1u);
#endif
  });
}

TEST(CudaTensors, Comm_HostInputWithCudaOutput_IsRefused) {
  RunRanks(1, [](const RankContext& ctx) {
    InitRank(ctx, milliseconds(20000));
    HostTensor<float> in(8, kF32), out(8, kF32);
    out.t.device = {CAI_DEVICE_CUDA, 0};
    cai_comm_args args = Args(CAI_COMM_REDUCE_SCATTER, &in.t, &out.t);
    const Outcome o = Take(CommApi()->run(&args, nullptr));
    EXPECT_EQ(o.code, CAI_INVALID_ARGUMENT);
    CAI_EXPECT_CONTAINS(o.message,
                        "reduce_scatter on group 'world': input is in host memory but "
                        "output is in CUDA device 0");
  });
}

FusedUpdate RandomUpdate(std::vector<float>& p, std::vector<float>& g, std::vector<float>& m,
                         std::vector<float>& v) {
  uint32_t seed = 12345;
  auto next = [&] {
    seed = seed * 1664525u + 1013904223u;
    return static_cast<float>(seed >> 8) / 16777216.0f - 0.5f;
  };
  for (size_t i = 0; i < p.size(); ++i) {
    p[i] = next();
    g[i] = next() * 0.1f;
    m[i] = next() * 0.01f;
    v[i] = std::abs(next()) * 0.001f;
  }
  FusedUpdate u;
  u.param = p.data();
  u.grad = g.data();
  u.state[0] = m.data();
  u.state[1] = v.data();
  u.numel = p.size();
  u.step = 3;
  u.lr = 1e-3;
  u.grad_scale = 0.5;
  return u;
}

TEST(CudaTensors, Optim_AdamWUpdateOnACudaDevice_MatchesTheCpuOrSaysWhyNot) {
  GroupHyper hyper;
  hyper.weight_decay = 0.1;
  const Optimizer optimizer(CAI_OPTIM_ADAMW, {hyper});
  const size_t n = 100003;  // not a multiple of any block size
  std::vector<float> p(n), g(n), m(n), v(n);
  FusedUpdate u = RandomUpdate(p, g, m, v);
  if (Devices() == 0) {
    u.cuda_device = 0;
    try {
      optimizer.Update(0, u);
      ADD_FAILURE() << "a CUDA update ran without a CUDA device";
    } catch (const Error& e) {
      ExpectWhyNot(e.code(), e.what(), "the optimizer update");
    }
    return;
  }
#ifdef CAI_TEST_CUDA_RUNTIME
  DeviceArray<float> dp(p), dg(g), dm(m), dv(v);
  FusedUpdate d = u;
  d.param = dp.ptr;
  d.grad = dg.ptr;
  d.state[0] = dm.ptr;
  d.state[1] = dv.ptr;
  d.cuda_device = 0;
  optimizer.Update(0, d);
  optimizer.Update(0, u);
  const std::vector<float> dp_host = dp.Read(), dm_host = dm.Read(), dv_host = dv.Read();
  for (size_t i = 0; i < n; ++i) {
    ASSERT_NEAR(dp_host[i], p[i], 1e-6 * std::abs(p[i]) + 1e-12) << i;
    ASSERT_NEAR(dm_host[i], m[i], 1e-6 * std::abs(m[i]) + 1e-12) << i;
    ASSERT_NEAR(dv_host[i], v[i], 1e-6 * std::abs(v[i]) + 1e-12) << i;
  }
#endif
}

#ifdef CAI_TEST_CUDA_RUNTIME
TEST(CudaTensors, Module_LoadsAndDescribesItsCudaAndNccl) {
  const std::string description = cuda::Load().Describe();
  CAI_EXPECT_CONTAINS(description, "CUDA runtime ");
  CAI_EXPECT_CONTAINS(description, ", NCCL 2");
}
#endif

}  // namespace
}  // namespace cai::test
