#include "mem/parallel.h"

#include <omp.h>

#include <algorithm>

namespace cai {

int ParallelThreads(size_t n) {
  if (n < kParallelMinElements || omp_in_parallel()) return 1;
  const size_t by_size = n / kParallelMinElements;
  return static_cast<int>(std::min<size_t>(by_size, static_cast<size_t>(omp_get_max_threads())));
}

void ParallelForRanges(size_t n, size_t align, void (*fn)(void* ctx, size_t begin, size_t end),
                       void* ctx) {
  const int threads = ParallelThreads(n);
  if (threads <= 1) {
    if (n > 0) fn(ctx, 0, n);
    return;
  }
  const size_t units = (n + align - 1) / align;
#pragma omp parallel num_threads(threads)
  {
    // The runtime may grant fewer threads than asked; split by what it granted.
    const size_t parts = static_cast<size_t>(omp_get_num_threads());
    const size_t part = static_cast<size_t>(omp_get_thread_num());
    const size_t begin = std::min(n, units * part / parts * align);
    const size_t end = std::min(n, units * (part + 1) / parts * align);
    if (begin < end) fn(ctx, begin, end);
  }
}

}  // namespace cai
