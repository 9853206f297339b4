#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <string>

#include "core/status.h"
#include "cuda/fused_optim.h"

namespace cai::cuda {
namespace {

constexpr int kThreads = 256;

__device__ float Load(const float* g, size_t i) { return g[i]; }
__device__ float Load(const __nv_bfloat16* g, size_t i) { return __bfloat162float(g[i]); }
__device__ float Load(const __half* g, size_t i) { return __half2float(g[i]); }

__device__ void Store(float*, size_t, float) {}
__device__ void Store(__nv_bfloat16* out, size_t i, float x) { out[i] = __float2bfloat16_rn(x); }
__device__ void Store(__half* out, size_t i, float x) { out[i] = __float2half_rn(x); }

// Grid-stride loops: one launch covers any numel whatever the grid size. The expressions are
// those of AdamTile / SgdMomentumTile / SgdTile in optim/fused_update.cpp, with FMA
// contraction off (__fmul_rn/__fadd_rn) so the device rounds as the CPU does.
template <class G, class L>
__global__ void AdamKernel(float* p, const G* g, float* m, float* v, L* lowp, size_t n,
                           AdamScalars s) {
  for (size_t i = blockIdx.x * size_t{blockDim.x} + threadIdx.x; i < n;
       i += size_t{blockDim.x} * gridDim.x) {
    float grad = __fmul_rn(Load(g, i), s.grad_scale);
    if (s.use_l2) grad = __fadd_rn(grad, __fmul_rn(s.l2, p[i]));
    const float param = __fmul_rn(p[i], s.decay);
    const float exp_avg = __fadd_rn(__fmul_rn(m[i], s.beta1), __fmul_rn(s.one_minus_beta1, grad));
    const float exp_avg_sq =
        __fadd_rn(__fmul_rn(v[i], s.beta2), __fmul_rn(__fmul_rn(s.one_minus_beta2, grad), grad));
    const float denom =
        __fadd_rn(__fdiv_rn(__fsqrt_rn(exp_avg_sq), s.sqrt_bias_correction2), s.eps);
    const float updated = __fadd_rn(param, __fdiv_rn(__fmul_rn(s.neg_step_size, exp_avg), denom));
    p[i] = updated;
    m[i] = exp_avg;
    v[i] = exp_avg_sq;
    if (lowp != nullptr) Store(lowp, i, updated);
  }
}

template <class G, class L>
__global__ void SgdKernel(float* p, const G* g, float* buf, L* lowp, size_t n, SgdScalars s) {
  for (size_t i = blockIdx.x * size_t{blockDim.x} + threadIdx.x; i < n;
       i += size_t{blockDim.x} * gridDim.x) {
    float grad = __fmul_rn(Load(g, i), s.grad_scale);
    if (s.use_l2) grad = __fadd_rn(grad, __fmul_rn(s.l2, p[i]));
    float step = grad;
    if (buf != nullptr) {
      const float b = s.first ? grad
                              : __fadd_rn(__fmul_rn(buf[i], s.momentum),
                                          __fmul_rn(s.one_minus_dampening, grad));
      buf[i] = b;
      step = s.nesterov ? __fadd_rn(grad, __fmul_rn(s.momentum, b)) : b;
    }
    const float updated = __fadd_rn(p[i], __fmul_rn(s.neg_lr, step));
    p[i] = updated;
    if (lowp != nullptr) Store(lowp, i, updated);
  }
}

unsigned Blocks(size_t n) {
  // Enough blocks to fill any current GPU several times over; the loops stride the rest.
  const size_t wanted = (n + kThreads - 1) / kThreads;
  return static_cast<unsigned>(wanted < 65536 ? (wanted > 0 ? wanted : 1) : 65536);
}

void CheckLaunch(const char* what) {
  const cudaError_t e = cudaGetLastError();
  if (e != cudaSuccess) {
    throw Error(CAI_INTERNAL, std::string(what) + " launch failed: " + cudaGetErrorString(e));
  }
}

// Calls f(grad pointer, low-precision pointer) with the pointers cast to their element types.
template <class F>
void Dispatch(const FusedUpdate& u, F f) {
  auto with_lowp = [&](auto* grad) {
    if (u.param_lowp == nullptr) {
      f(grad, static_cast<float*>(nullptr));
    } else if (u.param_lowp_type == FloatType::kBF16) {
      f(grad, static_cast<__nv_bfloat16*>(u.param_lowp));
    } else {
      f(grad, static_cast<__half*>(u.param_lowp));
    }
  };
  switch (u.grad_type) {
    case FloatType::kF32:
      return with_lowp(static_cast<const float*>(u.grad));
    case FloatType::kBF16:
      return with_lowp(static_cast<const __nv_bfloat16*>(u.grad));
    case FloatType::kF16:
      return with_lowp(static_cast<const __half*>(u.grad));
  }
}

}  // namespace

void LaunchAdam(const FusedUpdate& u, const AdamScalars& s, void* stream) {
  if (u.numel == 0) return;
  Dispatch(u, [&](auto* grad, auto* lowp) {
    AdamKernel<<<Blocks(u.numel), kThreads, 0, static_cast<cudaStream_t>(stream)>>>(
        u.param, grad, u.state[0], u.state[1], lowp, u.numel, s);
  });
  CheckLaunch("fused Adam kernel");
}

void LaunchSgd(const FusedUpdate& u, const SgdScalars& s, bool with_momentum, void* stream) {
  if (u.numel == 0) return;
  Dispatch(u, [&](auto* grad, auto* lowp) {
    SgdKernel<<<Blocks(u.numel), kThreads, 0, static_cast<cudaStream_t>(stream)>>>(
        u.param, grad, with_momentum ? u.state[0] : nullptr, lowp, u.numel, s);
  });
  CheckLaunch("fused SGD kernel");
}

}  // namespace cai::cuda
