// Elements per second of cai's fused AdamW update against LibTorch's torch::optim::AdamW on an
// equal flat fp32 tensor, and against the memory-bandwidth limit measured in the same run.
//
// An fp32 Adam step streams 28 bytes per element (reads p, g, m, v; writes p, m, v), so its
// ceiling is bandwidth / 28 elements per second. Bandwidth comes from a STREAM-style triad
// (a = b + s * c on fp32 arrays of the same length), vectorised and threaded exactly as the
// update is. Its bytes include the read that write-allocate caches do for the stored array
// (16 per element, not STREAM's 12), since the in-place update pays no such read: the limit
// is the memory's, not the convention's.
//
// Usage: optim_bench [numel] [repetitions]   (defaults 16777216 and 9)
#include <dlfcn.h>
#include <omp.h>
#include <torch/torch.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <functional>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "mem/parallel.h"
#include "mem/vectorize.h"
#include "optim/optimizer.h"

namespace {

using Clock = std::chrono::steady_clock;

// Median seconds of `reps` runs of fn, after two untimed ones (page faults, caches).
double MedianSeconds(int reps, const std::function<void()>& fn) {
  fn();
  fn();
  std::vector<double> times;
  for (int i = 0; i < reps; ++i) {
    const auto start = Clock::now();
    fn();
    times.push_back(std::chrono::duration<double>(Clock::now() - start).count());
  }
  std::sort(times.begin(), times.end());
  return times[times.size() / 2];
}

CAI_VECTOR_CLONES void Triad(float* __restrict a, const float* __restrict b,
                             const float* __restrict c, size_t n) {
  for (size_t i = 0; i < n; ++i) a[i] = b[i] + 3.0f * c[i];
}

// Which shared object provides BLAS in this process: libblas.so.3 is an alternatives symlink
// on Debian (reference BLAS, OpenBLAS pthread/openmp, BLIS, MKL), and LibTorch's speed depends
// on it.
void PrintBlas() {
  Dl_info info{};
  void* sgemm = dlsym(RTLD_DEFAULT, "sgemm_");
  if (sgemm && dladdr(sgemm, &info) && info.dli_fname) {
    std::printf("BLAS: sgemm_ resolves to %s\n", info.dli_fname);
  } else {
    std::printf("BLAS: sgemm_ not found in the process\n");
  }
  std::ifstream maps("/proc/self/maps");
  std::set<std::string> libs;
  for (std::string line; std::getline(maps, line);) {
    const size_t slash = line.find('/');
    if (slash != std::string::npos && line.find("blas", slash) != std::string::npos) {
      libs.insert(line.substr(slash));
    }
  }
  for (const std::string& lib : libs) std::printf("BLAS: mapped %s\n", lib.c_str());
  char resolved[4096];
  for (const char* link :
       {"/usr/lib/x86_64-linux-gnu/libblas.so.3", "/lib/x86_64-linux-gnu/libblas.so.3"}) {
    if (realpath(link, resolved)) {
      std::printf("BLAS: %s -> %s\n", link, resolved);
      break;
    }
  }
}

struct Result {
  int torch_threads;
  double triad_gbs;
  double ours_eps;
  double torch_eps;
};

Result Measure(size_t n, int reps, int threads) {
  omp_set_num_threads(threads);
  torch::set_num_threads(threads);

  Result r{};
  r.torch_threads = torch::get_num_threads();
  {
    std::vector<float> a(n), b(n, 1.0f), c(n, 2.0f);
    float* pa = a.data();
    const float* pb = b.data();
    const float* pc = c.data();
    const double t = MedianSeconds(reps, [&] {
      cai::ParallelFor(n, 1024, [&](size_t begin, size_t end) {
        Triad(pa + begin, pb + begin, pc + begin, end - begin);
      });
    });
    r.triad_gbs = 16.0 * static_cast<double>(n) / t / 1e9;
  }

  cai::GroupHyper h;
  h.lr = 1e-3;
  h.weight_decay = 0.01;
  {
    const cai::Optimizer opt(CAI_OPTIM_ADAMW, {h});
    std::vector<float> p(n, 0.5f), g(n, 0.01f), m(n, 0.0f), v(n, 0.0f);
    cai::FusedUpdate u;
    u.param = p.data();
    u.grad = g.data();
    u.state[0] = m.data();
    u.state[1] = v.data();
    u.numel = n;
    u.lr = h.lr;
    const double t = MedianSeconds(reps, [&] {
      opt.Update(0, u);
      ++u.step;
    });
    r.ours_eps = static_cast<double>(n) / t;
  }
  {
    torch::Tensor p = torch::full({static_cast<int64_t>(n)}, 0.5f).requires_grad_(true);
    p.mutable_grad() = torch::full({static_cast<int64_t>(n)}, 0.01f);
    torch::optim::AdamW opt({p}, torch::optim::AdamWOptions(h.lr).weight_decay(h.weight_decay));
    const double t = MedianSeconds(reps, [&] { opt.step(); });
    r.torch_eps = static_cast<double>(n) / t;
  }
  return r;
}

}  // namespace

int main(int argc, char** argv) {
  const size_t n = argc > 1 ? std::strtoull(argv[1], nullptr, 10) : size_t{1} << 24;
  const int reps = argc > 2 ? std::atoi(argv[2]) : 9;
  const int all = omp_get_max_threads();
  PrintBlas();
  std::printf("threads: OpenMP max %d, hardware %u\n", all, std::thread::hardware_concurrency());
  std::printf("numel %zu (%.0f MiB per fp32 array), median of %d repetitions\n\n", n,
              static_cast<double>(n) * 4 / (1 << 20), reps);
  std::printf("%-8s %6s %12s %14s %14s %14s %10s %10s\n", "threads", "torch", "triad GB/s",
              "limit Melem/s", "cai Melem/s", "torch Melem/s", "cai/torch", "cai/limit");
  for (int threads : std::set<int>{1, all}) {
    const Result r = Measure(n, reps, threads);
    const double limit = r.triad_gbs * 1e9 / 28;
    std::printf("%-8d %6d %12.2f %14.1f %14.1f %14.1f %9.2fx %9.0f%%\n", threads, r.torch_threads,
                r.triad_gbs, limit / 1e6, r.ours_eps / 1e6, r.torch_eps / 1e6,
                r.ours_eps / r.torch_eps, 100 * r.ours_eps / limit);
  }
  return 0;
}
