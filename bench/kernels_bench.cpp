// The zoo's optional kernels (host/src/model/kernels.h) against the composed ATen paths they
// replace, side by side: forward + backward time and memory, alternating the two in each of
// --pairs pairs, medians with their min-max.
//
// Memory is LibTorch's own, counted by the host's allocator wrapper (framework_allocator.h,
// with its cache of freed blocks on, as in training): "kept" is what the forward leaves alive
// for backward, its inputs and output included (the activation memory a model holds for the
// layer until its backward), "peak" the most alive at once during forward and backward,
// inputs included.
//
// Attention: GPT-2 124M's heads (batch 1, 12 heads of 64) at T = 512 ... 4096, causal, fp32.
// RMSNorm, bias + GELU, SwiGLU: batch 1 x T rows of GPT-2 124M's widths (768; MLP 3072).
//
// usage: kernels_bench [--pairs 5] [--threads 1] [--max-t 4096]
#include <ATen/Parallel.h>
#include <torch/torch.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <functional>
#include <limits>
#include <string>
#include <vector>

#include "model/framework_allocator.h"
#include "model/kernels.h"
#include "train/runtime.h"

namespace {

using Clock = std::chrono::steady_clock;

struct Sample {
  double seconds = 0;
  double kept = 0, peak = 0;  // bytes
};

// One forward + backward of fn over fresh inputs shaped like `shapes`.
Sample Measure(const std::vector<std::vector<int64_t>>& shapes,
               const std::function<torch::Tensor(const std::vector<torch::Tensor>&)>& fn) {
  std::vector<torch::Tensor> in;
  double input_bytes = 0;
  for (const auto& s : shapes) {
    in.push_back(torch::randn(s).requires_grad_(true));
    input_bytes += double(in.back().numel()) * in.back().element_size();
  }
  const uint64_t base = cai::FrameworkMemoryUsage().current_bytes;
  cai::ResetFrameworkPeak();
  const Clock::time_point start = Clock::now();
  torch::Tensor y = fn(in);
  // In a model the inputs are activations the graph keeps (both paths save them).
  const double kept = double(cai::FrameworkMemoryUsage().current_bytes - base) + input_bytes;
  y.backward(torch::ones_like(y));
  Sample s;
  s.seconds = std::chrono::duration<double>(Clock::now() - start).count();
  s.kept = kept;
  s.peak = double(cai::FrameworkMemoryUsage().peak_bytes - base) + input_bytes;
  return s;
}

struct Stat {
  double median, min, max;
};
Stat Summarise(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return {v[v.size() / 2], v.front(), v.back()};
}

void Compare(const std::string& what, int pairs, const std::vector<std::vector<int64_t>>& shapes,
             const std::function<torch::Tensor(const std::vector<torch::Tensor>&)>& unfused,
             const std::function<torch::Tensor(const std::vector<torch::Tensor>&)>& fused) {
  std::vector<double> speedup, kept_ratio, peak_ratio, t_unfused, t_fused;
  Sample last_u, last_f;
  Measure(shapes, unfused);  // warm-up
  Measure(shapes, fused);
  for (int p = 0; p < pairs; ++p) {
    Sample u, f;
    if (p % 2 == 0) {
      u = Measure(shapes, unfused);
      f = Measure(shapes, fused);
    } else {
      f = Measure(shapes, fused);
      u = Measure(shapes, unfused);
    }
    speedup.push_back(u.seconds / f.seconds);
    kept_ratio.push_back(u.kept / std::max(1.0, f.kept));
    peak_ratio.push_back(u.peak / std::max(1.0, f.peak));
    t_unfused.push_back(u.seconds);
    t_fused.push_back(f.seconds);
    last_u = u;
    last_f = f;
  }
  const Stat s = Summarise(speedup), k = Summarise(kept_ratio), pk = Summarise(peak_ratio);
  const Stat tu = Summarise(t_unfused), tf = Summarise(t_fused);
  std::printf(
      "| %s | %.1f / %.1f | %.2fx (%.2f-%.2f) | %.1f / %.1f | %.2fx (%.2f-%.2f) | %.1f / %.1f | "
      "%.2fx (%.2f-%.2f) |\n",
      what.c_str(), tu.median * 1e3, tf.median * 1e3, s.median, s.min, s.max, last_u.kept / 1048576,
      last_f.kept / 1048576, k.median, k.min, k.max, last_u.peak / 1048576, last_f.peak / 1048576,
      pk.median, pk.min, pk.max);
  std::fflush(stdout);
}

}  // namespace

int main(int argc, char** argv) {
  int pairs = 5, threads = 1;
  int64_t max_t = 4096;
  for (int i = 1; i + 1 < argc; i += 2) {
    if (!std::strcmp(argv[i], "--pairs")) pairs = std::atoi(argv[i + 1]);
    if (!std::strcmp(argv[i], "--threads")) threads = std::atoi(argv[i + 1]);
    if (!std::strcmp(argv[i], "--max-t")) max_t = std::atoll(argv[i + 1]);
  }
  cai::InstallFrameworkAllocator();
  at::set_num_threads(threads);
  torch::manual_seed(1);
  std::printf(
      "%d pairs, %d thread(s); time forward + backward (ms); kept = memory the forward leaves "
      "for backward, inputs and output included; peak = most alive during both, inputs "
      "included (MiB); ratios unfused / fused, median (min-max)\n\n",
      pairs, threads);
  std::printf(
      "| kernel, shape | time ms unfused / fused | speed-up | kept MiB unfused / fused | kept "
      "ratio | peak MiB unfused / fused | peak ratio |\n|---|---|---|---|---|---|---|\n");
  for (int64_t t = 512; t <= max_t; t *= 2) {
    const std::vector<int64_t> s = {1, 12, t, 64};
    Compare(
        "attention T=" + std::to_string(t) + " (1x12 heads of 64)", pairs, {s, s, s},
        [](const auto& x) { return cai::kernels::MathAttention(x[0], x[1], x[2]); },
        [](const auto& x) { return cai::kernels::MemoryEfficientAttention(x[0], x[1], x[2]); });
  }
  for (int64_t t = 512; t <= max_t; t *= 2) {
    const std::string rows = " T=" + std::to_string(t);
    Compare(
        "RMSNorm" + rows + " x 768", pairs, {{1, t, 768}, {768}},
        [](const auto& x) {
          const torch::Tensor xf = x[0];
          return (xf * torch::rsqrt(xf.pow(2).mean(-1, true) + 1e-5)) * x[1];
        },
        [](const auto& x) { return cai::kernels::FusedRmsNorm(x[0], x[1], 1e-5); });
    Compare(
        "bias + GELU" + rows + " x 3072", pairs, {{1, t, 3072}, {3072}},
        [](const auto& x) { return torch::gelu(x[0] + x[1], "tanh"); },
        [](const auto& x) { return cai::kernels::FusedBiasGelu(x[0], x[1]); });
    Compare(
        "SwiGLU" + rows + " x 3072", pairs, {{1, t, 3072}, {1, t, 3072}},
        [](const auto& x) { return torch::silu(x[0]) * x[1]; },
        [](const auto& x) { return cai::kernels::FusedSwiGlu(x[0], x[1]); });
  }
  std::printf("\nBLAS: %s\n", cai::LoadedBlas().c_str());
  return 0;
}
