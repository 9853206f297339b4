// The zoo's optional kernels (ColossalAI's Shardformer optimisations), each an autograd
// function with its own backward that keeps less for it than the composed ATen ops would:
//
//   MemoryEfficientAttention  causal attention tiled over query and key blocks with an online
//                             softmax (Dao et al. 2022, FlashAttention; the backward of
//                             FlashAttention-2): forward and backward never hold the T×T scores,
//                             only a block's, and backward keeps the output and the rows'
//                             log-sum-exp, O(T·d) instead of O(T²) per head.
//   FusedRmsNorm              RMSNorm keeping its input and the rows' 1/rms for backward (one
//                             tensor and a column) instead of every intermediate.
//   FusedBiasGelu             tanh-GELU of x + bias keeping only x + bias.
//   FusedSwiGlu               silu(gate) · up keeping only gate and up.
//
// LibTorch 1.13 has no fused attention on the CPU; these are written with ATen ops on blocks,
// so they run wherever the model runs, CUDA included. They compute in the inputs' dtype with
// fp32 softmax statistics and norms, as the unfused paths do.
#pragma once

#include <torch/torch.h>

namespace cai::kernels {

// Causal attention as composed ATen ops (LibTorch 1.13 has no fused attention): the T×T scores,
// masked, softmax in fp32 for bf16/fp16 inputs as fused kernels do. The zoo's default.
// q, k, v: [B, H, T, D] (k and v with as many heads as q). Returns [B, H, T, D].
torch::Tensor MathAttention(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v);
// The same, tiled (see above).
torch::Tensor MemoryEfficientAttention(const torch::Tensor& q, const torch::Tensor& k,
                                       const torch::Tensor& v, int64_t block = 128);
// The causal mask of queries [q0, q1) against keys [k0, k1): true where key index > query index.
torch::Tensor FutureMask(int64_t q0, int64_t q1, int64_t k0, int64_t k1, const torch::Device& d);
// FlashAttention's two steps on a tile of queries q [B, H, n, D] against a block of keys and
// values k, v [B, H, m, D], scaled by 1/sqrt(D), `future` [n, m] masking keys (undefined:
// none): the memory-efficient attention's and ring attention's, written once.
// Forward: folds the block into the rows' running maximum m and denominator l [B, H, n] and
// the unnormalised output acc [B, H, n, D] (fp32, updated in place).
void AttendBlock(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                 const torch::Tensor& future, const torch::Tensor& m, const torch::Tensor& l,
                 const torch::Tensor& acc);
// Backward (FlashAttention-2's), from the rows' log-sum-exp lse and D = rowsum(dO ∘ O) delta
// [B, H, n]: adds the tile's and the block's gradients into dq [B, H, n, D] and dk, dv
// [B, H, m, D] (fp32, in place).
void AttendBlockBackward(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                         const torch::Tensor& dout, const torch::Tensor& lse,
                         const torch::Tensor& delta, const torch::Tensor& future,
                         const torch::Tensor& dq, const torch::Tensor& dk, const torch::Tensor& dv);
// x [..., C], weight [C]: x / rms(x) · weight, the statistics in fp32.
torch::Tensor FusedRmsNorm(const torch::Tensor& x, const torch::Tensor& weight, double eps);
// tanh-GELU(x + bias); bias may be undefined.
torch::Tensor FusedBiasGelu(const torch::Tensor& x, const torch::Tensor& bias);
// silu(gate) · up.
torch::Tensor FusedSwiGlu(const torch::Tensor& gate, const torch::Tensor& up);

}  // namespace cai::kernels
