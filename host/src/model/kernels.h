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
// x [..., C], weight [C]: x / rms(x) · weight, the statistics in fp32.
torch::Tensor FusedRmsNorm(const torch::Tensor& x, const torch::Tensor& weight, double eps);
// tanh-GELU(x + bias); bias may be undefined.
torch::Tensor FusedBiasGelu(const torch::Tensor& x, const torch::Tensor& bias);
// silu(gate) · up.
torch::Tensor FusedSwiGlu(const torch::Tensor& gate, const torch::Tensor& up);

}  // namespace cai::kernels
