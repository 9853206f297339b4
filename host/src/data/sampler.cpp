#include "data/sampler.h"

#include <cmath>
#include <limits>
#include <numeric>
#include <string>

#include "core/status.h"

namespace cai::data {
namespace {

// SplitMix64 (Steele, Lea, Flood: "Fast splittable pseudorandom number generators", 2014).
// Written out rather than std::mt19937 + std::uniform_int_distribution because the standard
// leaves the distributions' algorithms to the library, and the batches must be identical on
// every machine of a run and across toolchains (for resuming).
uint64_t SplitMix64(uint64_t& state) {
  uint64_t z = (state += 0x9e3779b97f4a7c15ull);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

// Uniform in [0, bound) without modulo bias (Lemire, "Fast random integer generation in an
// interval", 2019).
uint64_t Below(uint64_t& state, uint64_t bound) {
  __uint128_t product = static_cast<__uint128_t>(SplitMix64(state)) * bound;
  auto low = static_cast<uint64_t>(product);
  if (low < bound) {
    const uint64_t threshold = -bound % bound;
    while (low < threshold) {
      product = static_cast<__uint128_t>(SplitMix64(state)) * bound;
      low = static_cast<uint64_t>(product);
    }
  }
  return static_cast<uint64_t>(product >> 64);
}

}  // namespace

RankShare ShareOfRank(int64_t global_batch, int rank, int world_size) {
  if (world_size < 1 || rank < 0 || rank >= world_size) {
    throw Error(CAI_INVALID_ARGUMENT, "rank " + std::to_string(rank) + " is outside a world of " +
                                          std::to_string(world_size) + " ranks");
  }
  if (global_batch < world_size) {
    throw Error(CAI_INVALID_ARGUMENT, "train.global_batch (" + std::to_string(global_batch) +
                                          ") must be at least the number of ranks (" +
                                          std::to_string(world_size) +
                                          "): every rank needs at least one sequence per step");
  }
  const int64_t base = global_batch / world_size;
  const int64_t extra = global_batch % world_size;
  RankShare share;
  share.first = rank * base + std::min<int64_t>(rank, extra);
  share.count = base + (rank < extra ? 1 : 0);
  share.weight = static_cast<double>(share.count) / static_cast<double>(global_batch);
  return share;
}

TokenSplit SplitTokens(std::span<const Token> tokens, double eval_fraction) {
  if (!(eval_fraction >= 0 && eval_fraction < 1)) {
    throw Error(CAI_INVALID_ARGUMENT,
                "data.eval_fraction must be in [0, 1), got " + std::to_string(eval_fraction));
  }
  const auto eval =
      static_cast<size_t>(std::ceil(static_cast<double>(tokens.size()) * eval_fraction));
  return {tokens.first(tokens.size() - eval), tokens.last(eval)};
}

WindowSampler::WindowSampler(std::span<const Token> tokens, const SamplerOptions& options)
    : tokens_(tokens), options_(options) {
  if (options.seq_len < 1 || options.global_batch < 1) {
    throw Error(CAI_INVALID_ARGUMENT,
                "seq_len (" + std::to_string(options.seq_len) + ") and global_batch (" +
                    std::to_string(options.global_batch) + ") must be at least 1");
  }
  if (static_cast<int64_t>(tokens.size()) < options.seq_len + 1) {
    throw Error(CAI_INVALID_ARGUMENT,
                "the token stream has " + std::to_string(tokens.size()) +
                    " tokens; a sequence of seq_len " + std::to_string(options.seq_len) +
                    " needs " + std::to_string(options.seq_len + 1) +
                    " (use more data, a smaller eval fraction or a shorter seq_len)");
  }
  window_count_ = (static_cast<int64_t>(tokens.size()) - 1) / options.seq_len;
  if (window_count_ > std::numeric_limits<uint32_t>::max()) {
    throw Error(CAI_INVALID_ARGUMENT, "more than 2^32 windows: use a longer seq_len");
  }
}

const std::vector<uint32_t>& WindowSampler::Permutation(int64_t epoch) const {
  if (epoch != cached_epoch_) {
    permutation_.resize(static_cast<size_t>(window_count_));
    std::iota(permutation_.begin(), permutation_.end(), 0u);
    // Seed and epoch each go through the mixer so neighbouring seeds or epochs give
    // unrelated orders.
    uint64_t seed_state = options_.seed;
    uint64_t epoch_state = static_cast<uint64_t>(epoch);
    uint64_t state = SplitMix64(seed_state) ^ SplitMix64(epoch_state);
    for (size_t i = permutation_.size(); i > 1; --i) {
      std::swap(permutation_[i - 1], permutation_[Below(state, i)]);
    }
    cached_epoch_ = epoch;
  }
  return permutation_;
}

std::vector<int64_t> WindowSampler::GlobalBatchStarts(int64_t step) const {
  if (step < 0) throw Error(CAI_INVALID_ARGUMENT, "step " + std::to_string(step) + " < 0");
  std::vector<int64_t> starts;
  starts.reserve(static_cast<size_t>(options_.global_batch));
  for (int64_t j = 0; j < options_.global_batch; ++j) {
    const int64_t sample = step * options_.global_batch + j;
    const int64_t slot = sample % window_count_;
    const int64_t window =
        options_.shuffle ? Permutation(sample / window_count_)[static_cast<size_t>(slot)] : slot;
    starts.push_back(window * options_.seq_len);
  }
  return starts;
}

Batch WindowSampler::Gather(std::span<const int64_t> starts) const {
  const int64_t t = options_.seq_len;
  Batch batch;
  batch.rows = static_cast<int64_t>(starts.size());
  batch.seq_len = t;
  batch.loss_weight = static_cast<double>(batch.rows) / static_cast<double>(options_.global_batch);
  batch.tokens.reserve(starts.size() * static_cast<size_t>(t));
  batch.targets.reserve(starts.size() * static_cast<size_t>(t));
  for (int64_t start : starts) {
    if (start < 0 || start + t + 1 > static_cast<int64_t>(tokens_.size())) {
      throw Error(CAI_OUT_OF_RANGE, "window at token " + std::to_string(start) +
                                        " runs past the stream's " +
                                        std::to_string(tokens_.size()) + " tokens");
    }
    const auto window = tokens_.subspan(static_cast<size_t>(start), static_cast<size_t>(t + 1));
    batch.tokens.insert(batch.tokens.end(), window.begin(), window.end() - 1);
    batch.targets.insert(batch.targets.end(), window.begin() + 1, window.end());
  }
  return batch;
}

std::vector<Batch> WindowSampler::RankMicroBatches(int64_t step, int rank, int world_size,
                                                   int64_t micro_batch) const {
  if (micro_batch < 1) {
    throw Error(CAI_INVALID_ARGUMENT,
                "micro_batch must be at least 1, got " + std::to_string(micro_batch));
  }
  const RankShare share = ShareOfRank(options_.global_batch, rank, world_size);
  const std::vector<int64_t> starts = GlobalBatchStarts(step);
  const auto mine = std::span<const int64_t>(starts).subspan(static_cast<size_t>(share.first),
                                                             static_cast<size_t>(share.count));
  std::vector<Batch> batches;
  for (int64_t begin = 0; begin < share.count; begin += micro_batch) {
    const int64_t rows = std::min(micro_batch, share.count - begin);
    batches.push_back(Gather(mine.subspan(static_cast<size_t>(begin), static_cast<size_t>(rows))));
  }
  return batches;
}

}  // namespace cai::data
