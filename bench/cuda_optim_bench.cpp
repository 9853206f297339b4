// The fused CUDA AdamW of libcai_cuda against the device's memory bandwidth, measured in the
// same run: an fp32 Adam step moves 28 bytes per element (reads p, g, m, v; writes p, m, v),
// so its ceiling is bandwidth / 28. The bandwidth is a device-to-device cudaMemcpy (2 bytes
// moved per byte copied), timed in alternation with the update; medians over repetitions.
// Without a CUDA device it says so and exits 0, so scripts/gpu-check.sh dry-runs anywhere.
//
// Usage: cuda_optim_bench [numel] [repetitions]   (defaults 268435456 and 20)
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <vector>

#include "cuda/cuda_module.h"
#include "optim/optimizer.h"

namespace {

void Check(cudaError_t e, const char* what) {
  if (e != cudaSuccess) {
    std::fprintf(stderr, "cuda_optim_bench: %s: %s\n", what, cudaGetErrorString(e));
    std::exit(1);
  }
}

// Median milliseconds of each function over `reps` rounds that run every function once, in
// turn, after one untimed round.
std::vector<float> AlternatingMedians(int reps, const std::vector<std::function<void()>>& fns) {
  cudaEvent_t start, stop;
  Check(cudaEventCreate(&start), "cudaEventCreate");
  Check(cudaEventCreate(&stop), "cudaEventCreate");
  std::vector<std::vector<float>> ms(fns.size());
  for (int r = 0; r <= reps; ++r) {
    for (size_t i = 0; i < fns.size(); ++i) {
      Check(cudaEventRecord(start), "cudaEventRecord");
      fns[i]();
      Check(cudaEventRecord(stop), "cudaEventRecord");
      Check(cudaEventSynchronize(stop), "cudaEventSynchronize");
      float t = 0;
      Check(cudaEventElapsedTime(&t, start, stop), "cudaEventElapsedTime");
      if (r > 0) ms[i].push_back(t);
    }
  }
  std::vector<float> medians;
  for (auto& t : ms) {
    std::sort(t.begin(), t.end());
    medians.push_back(t[t.size() / 2]);
  }
  return medians;
}

}  // namespace

int main(int argc, char** argv) {
  const size_t n = argc > 1 ? std::strtoull(argv[1], nullptr, 10) : size_t{1} << 28;
  const int reps = argc > 2 ? std::atoi(argv[2]) : 20;
  cai::cuda::Module& module = cai::cuda::Load();
  std::printf("%s\n", module.Describe().c_str());
  if (module.DeviceCount() == 0) {
    std::printf("no CUDA device: nothing to measure\n");
    return 0;
  }
  cudaDeviceProp prop{};
  Check(cudaGetDeviceProperties(&prop, 0), "cudaGetDeviceProperties");
  std::printf("device 0: %s, %.1f GiB\n", prop.name,
              static_cast<double>(prop.totalGlobalMem) / (1 << 30));
  float* buf[5];
  for (float*& b : buf) {
    Check(cudaMalloc(&b, n * sizeof(float)), "cudaMalloc");
    Check(cudaMemset(b, 0, n * sizeof(float)), "cudaMemset");
  }
  cai::GroupHyper h;
  h.lr = 1e-3;
  h.weight_decay = 0.01;
  cai::FusedUpdate u;
  u.param = buf[0];
  u.grad = buf[1];
  u.state[0] = buf[2];
  u.state[1] = buf[3];
  u.numel = n;
  u.lr = h.lr;
  u.cuda_device = 0;
  const std::vector<float> ms = AlternatingMedians(
      reps, {[&] {
               Check(cudaMemcpy(buf[4], buf[1], n * sizeof(float), cudaMemcpyDeviceToDevice),
                     "cudaMemcpy");
             },
             [&] {
               module.Adam(u, h, /*decoupled=*/true, 0, nullptr);
               ++u.step;
             }});
  const double copy_gbs = 2.0 * 4 * static_cast<double>(n) / (ms[0] * 1e-3) / 1e9;
  const double adam_gbs = 28.0 * static_cast<double>(n) / (ms[1] * 1e-3) / 1e9;
  std::printf(
      "numel %zu, median of %d: device copy %.1f GB/s, fused AdamW %.1f GB/s "
      "(%.1f Gelem/s) = %.0f%% of the copy's bandwidth\n",
      n, reps, copy_gbs, adam_gbs, adam_gbs / 28, 100 * adam_gbs / copy_gbs);
  for (float* b : buf) cudaFree(b);
  return 0;
}
