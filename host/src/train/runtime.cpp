#include "train/runtime.h"

#include <omp.h>
#include <torch/torch.h>

#include <fstream>

namespace cai {

void SetComputeThreads(int threads) {
  at::set_num_threads(threads);
  omp_set_num_threads(threads);
}

int ComputeThreads() { return at::get_num_threads(); }

std::string LoadedBlas() {
  // A tiny matmul makes LibTorch load its BLAS if nothing has yet.
  (void)torch::mm(torch::ones({2, 2}), torch::ones({2, 2}));
  std::ifstream maps("/proc/self/maps");
  std::string line;
  while (std::getline(maps, line)) {
    size_t slash = line.find('/');
    if (slash == std::string::npos) continue;
    std::string path = line.substr(slash);
    if (path.find("blas") != std::string::npos || path.find("mkl_core") != std::string::npos) {
      return path;
    }
  }
  return "unknown";
}

}  // namespace cai
