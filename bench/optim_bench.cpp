// Elements per second of cai's fused AdamW update against LibTorch's torch::optim::AdamW on an
// equal flat fp32 tensor, and against the memory-bandwidth limit measured in the same run.
//
// An fp32 Adam step streams 28 bytes per element (reads p, g, m, v; writes p, m, v in place),
// so its ceiling is bandwidth / 28 elements per second. The bandwidth is the highest of three
// kernels vectorised and threaded exactly as the update is, timed in alternation with it (one
// run of each kernel per repetition, medians over repetitions), so load drifting on a shared
// machine hits limit and update alike:
//   - STREAM's triad a = b + s*c, its bytes counted as STREAM counts them (12 per element);
//   - the same triad counting the write-allocate read of a (16 per element: what moves);
//   - the update's own access pattern with no arithmetic: p += g, m += g, v += g in one pass
//     (28 bytes per element). One core's bandwidth is bounded by the cache misses it keeps in
//     flight, and seven streams keep more in flight than the triad's three, so on this kind
//     of machine the triad alone understates what the update can get.
// No update can move its 28 bytes faster than the fastest of these, so cai/limit <= 100% up
// to the noise of the medians.
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

double Seconds(const std::function<void()>& fn) {
  const auto start = Clock::now();
  fn();
  return std::chrono::duration<double>(Clock::now() - start).count();
}

// Runs each function twice untimed (page faults, caches), then `reps` rounds that time each
// function once in turn; returns each one's median seconds.
std::vector<double> AlternatingMedians(int reps, const std::vector<std::function<void()>>& fns) {
  for (const auto& fn : fns) {
    fn();
    fn();
  }
  std::vector<std::vector<double>> times(fns.size());
  for (int r = 0; r < reps; ++r) {
    for (size_t i = 0; i < fns.size(); ++i) times[i].push_back(Seconds(fns[i]));
  }
  std::vector<double> medians;
  for (auto& t : times) {
    std::sort(t.begin(), t.end());
    medians.push_back(t[t.size() / 2]);
  }
  return medians;
}

CAI_VECTOR_CLONES void Triad(float* __restrict a, const float* __restrict b,
                             const float* __restrict c, size_t n) {
  for (size_t i = 0; i < n; ++i) a[i] = b[i] + 3.0f * c[i];
}

// The update's memory traffic without its arithmetic.
CAI_VECTOR_CLONES void AdamPattern(float* __restrict p, const float* __restrict g,
                                   float* __restrict m, float* __restrict v, size_t n) {
  for (size_t i = 0; i < n; ++i) {
    p[i] += g[i];
    m[i] += g[i];
    v[i] += g[i];
  }
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
  double stream_gbs;   // triad, STREAM's 12 bytes per element
  double triad_gbs;    // triad, 16 bytes per element
  double pattern_gbs;  // the update's pattern, 28 bytes per element
  double ours_eps;
  double torch_eps;
  double limit_eps() const { return std::max({stream_gbs, triad_gbs, pattern_gbs}) * 1e9 / 28; }
};

Result Measure(size_t n, int reps, int threads) {
  omp_set_num_threads(threads);
  torch::set_num_threads(threads);

  std::vector<float> a(n), b(n, 1.0f), c(n, 2.0f);
  std::vector<float> p(n, 0.5f), g(n, 0.01f), m(n, 0.0f), v(n, 0.0f);
  cai::GroupHyper h;
  h.lr = 1e-3;
  h.weight_decay = 0.01;
  const cai::Optimizer opt(CAI_OPTIM_ADAMW, {h});
  cai::FusedUpdate u;
  u.param = p.data();
  u.grad = g.data();
  u.state[0] = m.data();
  u.state[1] = v.data();
  u.numel = n;
  u.lr = h.lr;
  torch::Tensor tp = torch::full({static_cast<int64_t>(n)}, 0.5f).requires_grad_(true);
  tp.mutable_grad() = torch::full({static_cast<int64_t>(n)}, 0.01f);
  torch::optim::AdamW torch_opt({tp},
                                torch::optim::AdamWOptions(h.lr).weight_decay(h.weight_decay));

  const std::vector<double> t = AlternatingMedians(
      reps, {[&] {
               cai::ParallelFor(n, 1024, [&](size_t begin, size_t end) {
                 Triad(a.data() + begin, b.data() + begin, c.data() + begin, end - begin);
               });
             },
             [&] {
               // Fresh arrays would fault; these grow by g each run, harmlessly.
               cai::ParallelFor(n, 1024, [&](size_t begin, size_t end) {
                 AdamPattern(a.data() + begin, g.data() + begin, b.data() + begin, c.data() + begin,
                             end - begin);
               });
             },
             [&] {
               opt.Update(0, u);
               ++u.step;
             },
             [&] { torch_opt.step(); }});
  Result r{};
  r.torch_threads = torch::get_num_threads();
  const double elems = static_cast<double>(n);
  r.stream_gbs = 12 * elems / t[0] / 1e9;
  r.triad_gbs = 16 * elems / t[0] / 1e9;
  r.pattern_gbs = 28 * elems / t[1] / 1e9;
  r.ours_eps = elems / t[2];
  r.torch_eps = elems / t[3];
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
  std::printf("%-7s %5s %11s %11s %13s %13s %12s %13s %9s %9s\n", "threads", "torch", "STREAM GB/s",
              "triad16 GB/s", "pattern GB/s", "limit Melem/s", "cai Melem/s", "torch Melem/s",
              "cai/torch", "cai/limit");
  for (int threads : std::set<int>{1, all}) {
    const Result r = Measure(n, reps, threads);
    const double limit = r.limit_eps();
    std::printf("%-7d %5d %11.2f %12.2f %13.2f %13.1f %12.1f %13.1f %8.2fx %8.0f%%\n", threads,
                r.torch_threads, r.stream_gbs, r.triad_gbs, r.pattern_gbs, limit / 1e6,
                r.ours_eps / 1e6, r.torch_eps / 1e6, r.ours_eps / r.torch_eps,
                100 * r.ours_eps / limit);
  }
  return 0;
}
