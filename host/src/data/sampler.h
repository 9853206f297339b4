// Which token windows each rank trains on at each step.
//
// The global batch of step s is a function of (tokens, seq_len, global_batch, seed, s) only:
// the same B windows in the same order whatever the world size, so a run on 1, 2 or 3 ranks
// sees exactly the data the single-process reference sees, and parity tests compare them.
// Rank r of N then takes a contiguous slice of it (ShareOfRank).
//
// Windows: the token stream is cut into W = (n - 1) / T non-overlapping windows of T inputs;
// window w is tokens [w*T, w*T + T] (T + 1 tokens: inputs are the first T, targets the last T).
// Training sample i (counting from step 0) is window perm_e[i mod W] with e = i / W: every
// window is seen once per epoch, in a new order each epoch, and a batch may straddle two
// epochs. Evaluation walks the windows in order without shuffling.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "data/tokenizer.h"

namespace cai::data {

// The part of a global batch one rank owns: rows [first, first + count).
//
// When N does not divide B, the first B mod N ranks get ceil(B/N) rows and the rest
// floor(B/N). Ranks then hold different numbers of rows, so averaging per-rank mean losses
// would overweight the small ranks; instead each rank scales its mean loss by
// weight = count / B and gradients are all-reduced with SUM, which yields exactly the mean over
// the B rows of the global batch (and is what the 1-rank reference computes).
struct RankShare {
  int64_t first = 0;
  int64_t count = 0;
  double weight = 0;  // count / global_batch
};

// Throws cai::Error (INVALID_ARGUMENT) unless 0 <= rank < world_size and
// global_batch >= world_size (a rank with no rows could not run forward).
RankShare ShareOfRank(int64_t global_batch, int rank, int world_size);

// Micro-batch of `rows` sequences; tokens and targets are row-major [rows, seq_len], targets
// shifted by one token. loss_weight = rows / global_batch: summing loss_weight * mean loss
// over every micro-batch of every rank gives the global batch's mean loss.
struct Batch {
  int64_t rows = 0;
  int64_t seq_len = 0;
  double loss_weight = 0;
  std::vector<int64_t> tokens;
  std::vector<int64_t> targets;
};

// Train on the head of a stream and evaluate on its tail: the last ceil(n * eval_fraction)
// tokens are for evaluation. Contiguous so no eval window overlaps a train window.
// Throws cai::Error (INVALID_ARGUMENT) unless 0 <= eval_fraction < 1.
struct TokenSplit {
  std::span<const Token> train;
  std::span<const Token> eval;
};
TokenSplit SplitTokens(std::span<const Token> tokens, double eval_fraction);

struct SamplerOptions {
  int64_t seq_len = 0;       // T
  int64_t global_batch = 0;  // B, sequences per optimizer step over all ranks
  uint64_t seed = 0;
  bool shuffle = true;  // false for evaluation: windows in stream order
};

// Not thread-safe: caches the permutation of the epoch last asked for. `tokens` must outlive
// the sampler.
class WindowSampler {
 public:
  // Throws cai::Error (INVALID_ARGUMENT) for seq_len or global_batch < 1, and when the stream
  // holds fewer than seq_len + 1 tokens (with the count it has and needs).
  WindowSampler(std::span<const Token> tokens, const SamplerOptions& options);

  int64_t window_count() const { return window_count_; }

  // Token offsets of the B windows of step `step` (>= 0), in global-batch order.
  std::vector<int64_t> GlobalBatchStarts(int64_t step) const;

  // This rank's rows of step `step`, cut into micro-batches of at most `micro_batch` rows (the
  // last may be smaller). Throws as ShareOfRank, and for micro_batch < 1.
  std::vector<Batch> RankMicroBatches(int64_t step, int rank, int world_size,
                                      int64_t micro_batch) const;

  // The windows starting at `starts`, as one batch.
  Batch Gather(std::span<const int64_t> starts) const;

 private:
  const std::vector<uint32_t>& Permutation(int64_t epoch) const;

  std::span<const Token> tokens_;
  SamplerOptions options_;
  int64_t window_count_ = 0;
  mutable int64_t cached_epoch_ = -1;
  mutable std::vector<uint32_t> permutation_;
};

}  // namespace cai::data
