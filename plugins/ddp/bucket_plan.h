// Gradient bucket assignment of libcai_ddp, as PyTorch DDP's compute_bucket_assignment_by_size
// (torch/csrc/distributed/c10d/reducer.cpp): gradients are taken in the order backward is
// expected to produce them (reverse registration order) and packed into buckets; a bucket is
// closed as soon as it holds at least its byte limit, so one larger gradient gets a bucket of
// its own. The first bucket's limit is small (PyTorch's _DEFAULT_FIRST_BUCKET_BYTES, 1 MiB) so
// that the first all-reduce starts early in backward; later buckets use bucket_cap_mb.
// Torch- and ABI-free so the rule is tested on its own.
#pragma once

#include <cstddef>
#include <span>
#include <utility>
#include <vector>

namespace cai::ddp {

inline constexpr size_t kFirstBucketBytes = size_t{1} << 20;

// `bytes[i]` is the size of the i-th gradient in ready order. Returns each bucket as a
// half-open range [first, last) of indices into `bytes`, in launch order; every index lies in
// exactly one bucket and no bucket is empty.
std::vector<std::pair<size_t, size_t>> PlanBuckets(std::span<const size_t> bytes, size_t cap_bytes,
                                                   size_t first_cap_bytes = kFirstBucketBytes);

}  // namespace cai::ddp
