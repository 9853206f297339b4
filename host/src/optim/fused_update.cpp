#include "optim/fused_update.h"

#include <algorithm>
#include <cmath>

#include "mem/parallel.h"
#include "mem/vectorize.h"
#include "optim/fused_scalars.h"

namespace cai {
namespace {

// Elements per tile: a tile's fp32 gradient (converted from bf16/fp16) stays in L1 between
// the conversion and the update.
constexpr size_t kTile = 2048;
// Thread range boundaries in elements: whole cache lines of the 2-byte low-precision copy.
constexpr size_t kAlign = 64;

// Each line mirrors one ATen call of torch::optim::Adam(W)::step, in its order:
// grad.add(p, wd); p.mul_(1 - lr*wd); exp_avg.mul_(b1).add_(grad, 1-b1);
// exp_avg_sq.mul_(b2).addcmul_(grad, grad, 1-b2); denom = sqrt(v) / sqrt(bc2) + eps;
// p.addcdiv_(exp_avg, denom, -lr/bc1).
CAI_VECTOR_CLONES void AdamTile(float* p, const float* g, float* m, float* v, size_t n,
                                AdamScalars s) {
  for (size_t i = 0; i < n; ++i) {
    float grad = g[i] * s.grad_scale;
    grad = s.use_l2 ? grad + s.l2 * p[i] : grad;
    const float param = p[i] * s.decay;
    const float exp_avg = m[i] * s.beta1 + s.one_minus_beta1 * grad;
    const float exp_avg_sq = v[i] * s.beta2 + s.one_minus_beta2 * grad * grad;
    const float denom = std::sqrt(exp_avg_sq) / s.sqrt_bias_correction2 + s.eps;
    p[i] = param + s.neg_step_size * exp_avg / denom;
    m[i] = exp_avg;
    v[i] = exp_avg_sq;
  }
}

// torch::optim::SGD::step: d_p = grad.add(p, wd); buf = clone(d_p) at the first step, else
// buf.mul_(momentum).add_(d_p, 1 - dampening); d_p = nesterov ? d_p.add(buf, momentum) : buf;
// p.add_(d_p, -lr).
CAI_VECTOR_CLONES void SgdMomentumTile(float* p, const float* g, float* buf, size_t n,
                                       SgdScalars s) {
  for (size_t i = 0; i < n; ++i) {
    float grad = g[i] * s.grad_scale;
    grad = s.use_l2 ? grad + s.l2 * p[i] : grad;
    const float b = s.first ? grad : buf[i] * s.momentum + s.one_minus_dampening * grad;
    buf[i] = b;
    const float step = s.nesterov ? grad + s.momentum * b : b;
    p[i] = p[i] + s.neg_lr * step;
  }
}

CAI_VECTOR_CLONES void SgdTile(float* p, const float* g, size_t n, SgdScalars s) {
  for (size_t i = 0; i < n; ++i) {
    float grad = g[i] * s.grad_scale;
    grad = s.use_l2 ? grad + s.l2 * p[i] : grad;
    p[i] = p[i] + s.neg_lr * grad;
  }
}

// Walks u's elements tile by tile on all threads, giving `rule(begin, grad, n)` an fp32
// gradient for elements [begin, begin + n) and writing the low-precision copy afterwards.
template <class Rule>
void ForEachTile(const FusedUpdate& u, Rule rule) {
  ParallelFor(u.numel, kAlign, [&](size_t begin, size_t end) {
    float converted[kTile];
    const size_t grad_size = SizeOf(u.grad_type);
    const size_t lowp_size = SizeOf(u.param_lowp_type);
    for (size_t i = begin; i < end; i += kTile) {
      const size_t n = std::min(kTile, end - i);
      const void* grad = static_cast<const char*>(u.grad) + i * grad_size;
      const float* g = static_cast<const float*>(grad);
      if (u.grad_type != FloatType::kF32) {
        serial::CastCopy(grad, u.grad_type, converted, FloatType::kF32, n);
        g = converted;
      }
      rule(i, g, n);
      if (u.param_lowp) {
        serial::CastCopy(u.param + i, FloatType::kF32,
                         static_cast<char*>(u.param_lowp) + i * lowp_size, u.param_lowp_type, n);
      }
    }
  });
}

}  // namespace

void FusedAdam(const FusedUpdate& u, const GroupHyper& h, bool decoupled) {
  const AdamScalars s = MakeAdamScalars(u, h, decoupled);
  ForEachTile(u, [&](size_t i, const float* g, size_t n) {
    AdamTile(u.param + i, g, u.state[0] + i, u.state[1] + i, n, s);
  });
}

void FusedSgd(const FusedUpdate& u, const GroupHyper& h) {
  const SgdScalars s = MakeSgdScalars(u, h);
  if (h.momentum == 0) {
    ForEachTile(u, [&](size_t i, const float* g, size_t n) { SgdTile(u.param + i, g, n, s); });
  } else {
    ForEachTile(u, [&](size_t i, const float* g, size_t n) {
      SgdMomentumTile(u.param + i, g, u.state[0] + i, n, s);
    });
  }
}

}  // namespace cai
