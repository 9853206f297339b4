// Splitting element-wise work over OpenMP threads; shared by the memory kernels and the fused
// optimizer update so that every kernel threads the same way.
#pragma once

#include <cstddef>
#include <type_traits>

namespace cai {

// Below this many elements a kernel runs on the calling thread: starting a parallel region
// costs a few microseconds, about what one core needs to stream 128 KiB.
inline constexpr size_t kParallelMinElements = size_t{1} << 15;

// Runs fn(ctx, begin, end) over [0, n) split into one contiguous range per OpenMP thread
// (at most omp_get_max_threads(), fewer for small n). Range boundaries are multiples of
// `align` elements (> 0), so threads never share a cache line or a reduction block. Runs on
// the calling thread alone below kParallelMinElements, with one thread configured, or when
// called from inside a parallel region.
void ParallelForRanges(size_t n, size_t align, void (*fn)(void* ctx, size_t begin, size_t end),
                       void* ctx);

template <class F>
void ParallelFor(size_t n, size_t align, F&& fn) {
  using Fn = std::remove_reference_t<F>;
  ParallelForRanges(
      n, align, [](void* ctx, size_t begin, size_t end) { (*static_cast<Fn*>(ctx))(begin, end); },
      &fn);
}

// Number of threads ParallelForRanges would use for n elements.
int ParallelThreads(size_t n);

}  // namespace cai
