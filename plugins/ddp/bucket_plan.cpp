#include "bucket_plan.h"

#include <algorithm>

namespace cai::ddp {

std::vector<std::pair<size_t, size_t>> PlanBuckets(std::span<const size_t> bytes, size_t cap_bytes,
                                                   size_t first_cap_bytes) {
  std::vector<std::pair<size_t, size_t>> buckets;
  size_t first = 0, filled = 0;
  for (size_t i = 0; i < bytes.size(); ++i) {
    filled += bytes[i];
    const size_t limit = buckets.empty() ? std::min(first_cap_bytes, cap_bytes) : cap_bytes;
    if (filled >= limit) {
      buckets.emplace_back(first, i + 1);
      first = i + 1;
      filled = 0;
    }
  }
  if (first < bytes.size()) buckets.emplace_back(first, bytes.size());
  return buckets;
}

}  // namespace cai::ddp
