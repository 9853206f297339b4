// Megatron-LM's tensor-parallel operators (Shoeybi et al. 2019, section 3) as autograd
// functions over a TensorParallelGroup, and the cutting of a parameter into a rank's slice.
// The zoo's networks and TorchScript models under a policy both use them. Every rank of the
// group calls them in the same order; the group must outlive every graph they build.
#pragma once

#include <torch/torch.h>

#include <cstdint>
#include <vector>

#include "model/network.h"

namespace cai::tp {

// A group as an integer, for what holds only IValues (autograd contexts, TorchScript graphs):
// its address. The group must outlive whatever holds the handle.
int64_t Handle(const TensorParallelGroup& group);
const TensorParallelGroup& GroupOf(int64_t handle);

// f: identity forward, all-reduce of the gradient backward. It stands before column-parallel
// projections, whose input every rank holds whole.
torch::Tensor CopyToGroup(const torch::Tensor& x, const TensorParallelGroup& group);
// g: all-reduce forward (in place when `x` is contiguous and nothing else reads it),
// identity backward. It follows row-parallel projections, whose outputs are partial sums.
torch::Tensor ReduceFromGroup(const torch::Tensor& x, const TensorParallelGroup& group);
// Every rank's [..., part] side by side along the last dimension [..., size·part]; backward
// keeps this rank's columns.
torch::Tensor GatherLastDim(const torch::Tensor& x, const TensorParallelGroup& group);
// Megatron-LM's sequence parallelism (Korthikanti et al. 2022, section 4.2.2) over dimension 1
// of [B, T, ...], T divisible by the group's size: partial sums [B, T, ...] reduce-scattered
// into this rank's summed shard of the sequence (backward: the shards' gradients
// all-gathered).
torch::Tensor ScatterSequence(const torch::Tensor& x, const TensorParallelGroup& group);
// Column-parallel projections of the gathered sequence shards, y_i = x_whole·W_iᵀ + b_i
// (an undefined b_i: none), keeping only the shard for backward, which gathers it again
// (Megatron-LM's sequence-parallel linear layers): the whole input is never held between
// forward and backward.
// With `ring` (ColossalAI's "ring" mode) the gather is size − 1 shift steps, each overlapping
// the projections of the chunk already here; backward gathers again the same way for the
// weight gradients and reduce-scatters the input's gradient ring-wise.
std::vector<torch::Tensor> GatheredLinears(const torch::Tensor& x,
                                           const std::vector<torch::Tensor>& weights,
                                           const std::vector<torch::Tensor>& biases,
                                           const TensorParallelGroup& group, bool ring = false);
// A row-parallel projection x·Wᵀ (x [B, T, part], every position) reduce-scattered into this
// rank's sequence shard [B, T/size, out] as a ring: each step computes the partial sums of one
// rank's chunk while the previous step's travel on (ColossalAI's "ring"). Backward gathers the
// output's gradient the same way, each chunk's input and weight gradients computed as it comes.
torch::Tensor RingScatteredLinear(const torch::Tensor& x, const torch::Tensor& weight,
                                  const TensorParallelGroup& group);
// DeepSpeed-Ulysses (Jacobs et al. 2023) over the sequence-parallel group: [B, H, T/size, D],
// this rank's positions of every head, to [B, H/size, T, D], the whole sequence of this rank's
// heads [rank·H/size, (rank + 1)·H/size); and back. Each one all-to-all, backward the other.
torch::Tensor SequenceToHeads(const torch::Tensor& x, const TensorParallelGroup& group);
torch::Tensor HeadsToSequence(const torch::Tensor& x, const TensorParallelGroup& group);
// Ring attention (Liu et al. 2023) over the sequence-parallel group under the zigzag split
// (cai_sequence_parallel_mode's RING_ATTN): q [B, H, t, D], k and v [B, Hkv, t, D] at this
// rank's 2 chunks of t/2 positions; returns this rank's rows of the causal attention over the
// whole sequence, [B, H, t, D]. Keys and values go around the ring (each step's send overlaps
// its compute), merged with an online softmax; the scores are held a tile of queries against
// one rank's keys at a time, and backward keeps only q, k, v, the output and the rows'
// log-sum-exp (FlashAttention-2's backward), passing the keys and values around again with
// their gradients following them home.
torch::Tensor RingAttention(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                            const TensorParallelGroup& group);
// The loss of a sequence shard under Ulysses or ring attention: `mean`, this rank's mean
// cross-entropy over its `targets` other than `ignore`, becomes the whole micro-batch's mean (the
// shards' sums and counts all-reduced, 2 floats), with the gradient of this shard's part of it.
torch::Tensor SequenceShardLoss(const torch::Tensor& mean, const torch::Tensor& targets,
                                int64_t ignore, const TensorParallelGroup& group);
// Cross-entropy over vocabulary-parallel fp32 logits [N, part] holding the vocabulary's columns
// [start, start + part): the maxima, the softmax denominators and the targets' logits are
// all-reduced (3·N floats), so no rank holds the whole logits. Mean over targets other than
// `ignore`, as cross_entropy.
torch::Tensor VocabParallelCrossEntropy(const torch::Tensor& logits, const torch::Tensor& targets,
                                        const TensorParallelGroup& group, int64_t start,
                                        int64_t ignore);

// Replaces p.tensor's data by this rank's part of each of `blocks` equal blocks along `dim`,
// each block first padded with zeros to `padded_block` (a multiple of the group's size), and
// records the cut in p's tp fields. global_shape must already hold the whole shape.
void SliceParam(ParamSpec& p, int32_t dim, int32_t blocks, int64_t padded_block,
                const TensorParallelGroup& group);

}  // namespace cai::tp
