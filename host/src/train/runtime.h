// Process-wide compute settings that need LibTorch, kept in one small translation unit.
#pragma once

#include <string>

namespace cai {

// Intra-op threads for LibTorch and OpenMP (the fused optimizer and memory kernels).
void SetComputeThreads(int threads);
int ComputeThreads();

// The BLAS library LibTorch resolved libblas.so.3 to in this process (benchmarks report it).
std::string LoadedBlas();

}  // namespace cai
