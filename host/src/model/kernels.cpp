// The zoo's optional kernels (kernels.h). On the CPU the element-wise ones are single passes
// over the data (at::parallel_for) in fp32 or bf16 storage with fp32 arithmetic; elsewhere
// (CUDA) and for other dtypes they compose ATen ops with the same saved state.
#include "model/kernels.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

namespace cai::kernels {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

bool LoopKernel(const torch::Tensor& t) {
  return t.device().is_cpu() &&
         (t.scalar_type() == torch::kFloat || t.scalar_type() == torch::kBFloat16);
}

// A contiguous fp32 tensor of t's values (t itself when it already is one): the RMSNorm loops
// are written once, for float, and bf16 storage goes through one conversion each way.
torch::Tensor AsFloat(const torch::Tensor& t) { return t.contiguous().to(torch::kFloat); }

constexpr float kGeluK = 0.7978845608028654f;  // sqrt(2 / pi)
constexpr float kGeluC = 0.044715f;

// ---- Element-wise loops ---------------------------------------------------------------------
//
// Written so that the compiler vectorises them (kernels.cpp is built with -O3): no calls into
// libm, whose scalar exp/tanh would serialise each element. On x86-64 each loop also has an
// x86-64-v3 (AVX2, FMA) clone picked at load time, as ATen dispatches its own kernels.
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define CAI_VECTOR_CLONES __attribute__((target_clones("arch=x86-64-v3", "default")))
#else
#define CAI_VECTOR_CLONES
#endif

// e^x for x in [-87, 88] within ~2 ulp: e^x = 2^k · e^r with k = round(x / ln 2) and
// |r| <= ln 2 / 2, e^r by its Taylor series to r^7 (relative error < 2e-8 there), and 2^k put
// into the exponent bits.
inline float Exp(float in) {
  // Clamped so that k converts to an int32 defined (NaN too); a NaN input still returns NaN
  // below, so that overflow checks downstream see it.
  const float x = in > -87.0f ? (in < 88.0f ? in : 88.0f) : -87.0f;
  // Round to nearest by adding and removing 1.5 · 2^23 (no libm call, so it vectorises).
  const float k = (x * 1.44269504088896341f + 12582912.0f) - 12582912.0f;
  // ln 2 in two parts, so that x - k·ln 2 loses nothing for |k| <= 127.
  const float r = (x - k * 0.693145751953125f) - k * 1.428606765330187e-06f;
  float p = 1.0f / 5040;
  p = p * r + 1.0f / 720;
  p = p * r + 1.0f / 120;
  p = p * r + 1.0f / 24;
  p = p * r + 1.0f / 6;
  p = p * r + 0.5f;
  p = p * r + 1.0f;
  p = p * r + 1.0f;
  const int32_t bits = (static_cast<int32_t>(k) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof scale);
  return in == in ? p * scale : in;
}

// tanh(u) = 1 - 2 / (e^{2u} + 1); its absolute error (~1e-7) is what GELU, which multiplies
// 1 + tanh by x / 2, sees.
inline float Tanh(float u) { return 1.0f - 2.0f / (Exp(2.0f * u) + 1.0f); }

inline float Gelu(float a) { return 0.5f * a * (1.0f + Tanh(kGeluK * (a + kGeluC * a * a * a))); }

// z = x + bias (kept for backward) and y = gelu(z), rows of c.
CAI_VECTOR_CLONES void BiasGeluForwardLoop(const float* x, const float* bias, int64_t rows,
                                           int64_t c, float* z, float* y) {
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t i = 0; i < c; ++i) {
      const float a = x[r * c + i] + bias[i];
      z[r * c + i] = a;
      y[r * c + i] = Gelu(a);
    }
  }
}

CAI_VECTOR_CLONES void GeluForwardLoop(const float* x, int64_t n, float* y) {
  for (int64_t i = 0; i < n; ++i) y[i] = Gelu(x[i]);
}

CAI_VECTOR_CLONES void GeluBackwardLoop(const float* z, const float* g, int64_t n, float* dz) {
  for (int64_t i = 0; i < n; ++i) {
    const float a = z[i], th = Tanh(kGeluK * (a + kGeluC * a * a * a));
    dz[i] = g[i] * (0.5f * (1.0f + th) +
                    0.5f * a * (1.0f - th * th) * kGeluK * (1.0f + 3.0f * kGeluC * a * a));
  }
}

CAI_VECTOR_CLONES void SwiGluForwardLoop(const float* gate, const float* up, int64_t n, float* y) {
  for (int64_t i = 0; i < n; ++i) y[i] = gate[i] / (1.0f + Exp(-gate[i])) * up[i];
}

CAI_VECTOR_CLONES void SwiGluBackwardLoop(const float* gate, const float* up, const float* dy,
                                          int64_t n, float* dgate, float* dup) {
  for (int64_t i = 0; i < n; ++i) {
    const float a = gate[i], sig = 1.0f / (1.0f + Exp(-a));
    dup[i] = dy[i] * a * sig;
    dgate[i] = dy[i] * up[i] * sig * (1.0f + a * (1.0f - sig));
  }
}

CAI_VECTOR_CLONES void RmsNormForwardLoop(const float* x, int64_t rows, int64_t c, float eps,
                                          float* normed, float* rstd) {
  for (int64_t r = 0; r < rows; ++r) {
    const float* row = x + r * c;
    float sum = 0;
    for (int64_t i = 0; i < c; ++i) sum += row[i] * row[i];
    const float inv = 1.0f / std::sqrt(sum / float(c) + eps);
    rstd[r] = inv;
    for (int64_t i = 0; i < c; ++i) normed[r * c + i] = row[i] * inv;
  }
}

// dx = inv · (g·w - n · mean(g·w·n)), n = x · inv; dw accumulates g·n.
CAI_VECTOR_CLONES void RmsNormBackwardLoop(const float* x, const float* g, const float* w,
                                           const float* rstd, int64_t rows, int64_t c, float* dx,
                                           float* dw) {
  for (int64_t r = 0; r < rows; ++r) {
    const float *row = x + r * c, *gr = g + r * c;
    const float inv = rstd[r];
    float dot = 0;
    for (int64_t i = 0; i < c; ++i) {
      const float n = row[i] * inv;
      dw[i] += gr[i] * n;
      dot += gr[i] * w[i] * n;
    }
    dot /= float(c);
    for (int64_t i = 0; i < c; ++i) dx[r * c + i] = inv * (gr[i] * w[i] - row[i] * inv * dot);
  }
}

// ---- Memory-efficient attention -------------------------------------------------------------

}  // namespace

torch::Tensor FutureMask(int64_t q0, int64_t q1, int64_t k0, int64_t k1, const torch::Device& d) {
  torch::Tensor rows = torch::arange(q0, q1, torch::TensorOptions().dtype(torch::kLong).device(d));
  torch::Tensor cols = torch::arange(k0, k1, torch::TensorOptions().dtype(torch::kLong).device(d));
  return cols.unsqueeze(0).gt(rows.unsqueeze(1));
}

namespace {
// The tile's scores against the block in fp32, masked.
torch::Tensor Scores(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& future) {
  torch::Tensor s = torch::matmul(q, k.transpose(-2, -1))
                        .to(torch::kFloat)
                        .mul_(1.0 / std::sqrt(double(q.size(3))));
  if (future.defined()) s.masked_fill_(future, -std::numeric_limits<float>::infinity());
  return s;
}
}  // namespace

void AttendBlock(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                 const torch::Tensor& future, const torch::Tensor& m, const torch::Tensor& l,
                 const torch::Tensor& acc) {
  torch::Tensor s = Scores(q, k, future);
  const torch::Tensor m_new = torch::maximum(m, std::get<0>(s.max(-1)));
  const torch::Tensor p = s.sub_(m_new.unsqueeze(-1)).exp_();
  const torch::Tensor correction = (m - m_new).exp_();
  l.mul_(correction).add_(p.sum(-1));
  acc.mul_(correction.unsqueeze(-1))
      .add_(torch::matmul(p.to(q.scalar_type()), v).to(torch::kFloat));
  m.copy_(m_new);
}

void AttendBlockBackward(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                         const torch::Tensor& dout, const torch::Tensor& lse,
                         const torch::Tensor& delta, const torch::Tensor& future,
                         const torch::Tensor& dq, const torch::Tensor& dk,
                         const torch::Tensor& dv) {
  const torch::ScalarType type = q.scalar_type();
  const torch::Tensor p = Scores(q, k, future).sub_(lse.unsqueeze(-1)).exp_();
  dv.add_(torch::matmul(p.transpose(-2, -1).to(type), dout).to(torch::kFloat));
  const torch::Tensor dp = torch::matmul(dout, v.transpose(-2, -1)).to(torch::kFloat);
  const torch::Tensor ds =
      p.mul_(dp.sub_(delta.unsqueeze(-1))).mul_(1.0 / std::sqrt(double(q.size(3)))).to(type);
  dq.add_(torch::matmul(ds, k).to(torch::kFloat));
  dk.add_(torch::matmul(ds.transpose(-2, -1), q).to(torch::kFloat));
}

namespace {

struct Attention : torch::autograd::Function<Attention> {
  static torch::Tensor forward(AutogradContext* ctx, torch::Tensor q, torch::Tensor k,
                               torch::Tensor v, int64_t block) {
    const int64_t t = q.size(2);
    // [B, T, H, D] underneath, as FlashAttention writes it: merging the heads for the output
    // projection is then a view, and the tensor this function keeps for backward is the one
    // the projection keeps, not a second copy of s·b·h.
    torch::Tensor out =
        torch::empty({q.size(0), t, q.size(1), q.size(3)}, q.options()).transpose(1, 2);
    torch::Tensor lse = torch::empty({q.size(0), q.size(1), t}, q.options().dtype(torch::kFloat));
    const float inf = std::numeric_limits<float>::infinity();
    for (int64_t i0 = 0; i0 < t; i0 += block) {
      const int64_t i1 = std::min(t, i0 + block);
      const torch::Tensor qi = q.slice(2, i0, i1);
      torch::Tensor m = torch::full({q.size(0), q.size(1), i1 - i0}, -inf, lse.options());
      torch::Tensor l = torch::zeros_like(m);
      torch::Tensor acc = torch::zeros({q.size(0), q.size(1), i1 - i0, q.size(3)}, lse.options());
      for (int64_t j0 = 0; j0 < i1; j0 += block) {  // causal: no key block after the queries
        const int64_t j1 = std::min(t, j0 + block);
        AttendBlock(qi, k.slice(2, j0, j1), v.slice(2, j0, j1),
                    j1 > i0 + 1 ? FutureMask(i0, i1, j0, j1, q.device()) : torch::Tensor(), m, l,
                    acc);
      }
      out.slice(2, i0, i1).copy_(acc.div_(l.unsqueeze(-1)));
      lse.slice(2, i0, i1).copy_(m.add_(l.log_()));
    }
    ctx->save_for_backward({q, k, v, out, lse});
    ctx->saved_data["block"] = block;
    return out;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const variable_list saved = ctx->get_saved_variables();
    const torch::Tensor &q = saved[0], &k = saved[1], &v = saved[2], &out = saved[3],
                        &lse = saved[4];
    const int64_t block = ctx->saved_data["block"].toInt();
    const torch::ScalarType type = q.scalar_type();
    const int64_t t = q.size(2);
    // Strided as it comes (a view of the merged heads' gradient in a model): the block matmuls
    // read it in place, and a contiguous copy would cost another s·b·h at backward's peak.
    const torch::Tensor& dout = grads[0];
    // FlashAttention-2's D = rowsum(dO ∘ O).
    const torch::Tensor delta = (dout.to(torch::kFloat) * out.to(torch::kFloat)).sum(-1);
    torch::Tensor dq = torch::zeros(q.sizes(), q.options().dtype(torch::kFloat));
    torch::Tensor dk = torch::empty_like(k), dv = torch::empty_like(v);
    for (int64_t j0 = 0; j0 < t; j0 += block) {
      const int64_t j1 = std::min(t, j0 + block);
      const torch::Tensor kj = k.slice(2, j0, j1), vj = v.slice(2, j0, j1);
      torch::Tensor dkj = torch::zeros(kj.sizes(), dq.options());
      torch::Tensor dvj = torch::zeros(vj.sizes(), dq.options());
      for (int64_t i0 = (j0 / block) * block; i0 < t; i0 += block) {  // queries at or after j0
        const int64_t i1 = std::min(t, i0 + block);
        AttendBlockBackward(q.slice(2, i0, i1), kj, vj, dout.slice(2, i0, i1), lse.slice(2, i0, i1),
                            delta.slice(2, i0, i1),
                            j1 > i0 + 1 ? FutureMask(i0, i1, j0, j1, q.device()) : torch::Tensor(),
                            dq.slice(2, i0, i1), dkj, dvj);
      }
      dk.slice(2, j0, j1).copy_(dkj);
      dv.slice(2, j0, j1).copy_(dvj);
    }
    return {dq.to(type), dk, dv, torch::Tensor()};
  }
};

// ---- RMSNorm --------------------------------------------------------------------------------

struct RmsNorm : torch::autograd::Function<RmsNorm> {
  static torch::Tensor forward(AutogradContext* ctx, torch::Tensor x, torch::Tensor weight,
                               double eps) {
    const int64_t c = x.size(-1), rows = x.numel() / c;
    torch::Tensor rstd, normed;  // rstd: [rows] fp32
    if (LoopKernel(x)) {
      const torch::Tensor xf = AsFloat(x);
      rstd = torch::empty({rows}, xf.options());
      normed = torch::empty_like(xf);
      const float* px = xf.data_ptr<float>();
      float *pn = normed.data_ptr<float>(), *pr = rstd.data_ptr<float>();
      at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
        RmsNormForwardLoop(px + begin * c, end - begin, c, float(eps), pn + begin * c, pr + begin);
      });
    } else {
      const torch::Tensor xf = x.to(torch::kFloat);
      rstd = torch::rsqrt(xf.pow(2).mean(-1, true) + eps);
      normed = xf * rstd;
      rstd = rstd.reshape({rows});
    }
    ctx->save_for_backward({x, weight, rstd});
    // As the unfused path: normalised in fp32, rounded to the compute dtype, then scaled.
    return normed.to(x.scalar_type()) * weight;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const variable_list saved = ctx->get_saved_variables();
    const torch::Tensor &x = saved[0], &weight = saved[1], &rstd = saved[2];
    const int64_t c = x.size(-1), rows = x.numel() / c;
    const torch::Tensor xf = AsFloat(x).view({rows, c});
    const torch::Tensor dy = AsFloat(grads[0]).view({rows, c});
    const torch::Tensor wf = AsFloat(weight);
    torch::Tensor dx, dw;
    if (LoopKernel(x)) {
      dx = torch::empty_like(xf);
      // dw: one partial row per chunk of rows, summed after.
      const int64_t grain = 64, chunks = (rows + grain - 1) / grain;
      torch::Tensor partial = torch::zeros({std::max<int64_t>(chunks, 1), c}, xf.options());
      const float *px = xf.data_ptr<float>(), *pdy = dy.data_ptr<float>(),
                  *pw = wf.data_ptr<float>(), *pr = rstd.data_ptr<float>();
      float *pdx = dx.data_ptr<float>(), *pp = partial.data_ptr<float>();
      at::parallel_for(0, chunks, 1, [&](int64_t begin, int64_t end) {
        for (int64_t chunk = begin; chunk < end; ++chunk) {
          const int64_t first = chunk * grain, count = std::min(rows, first + grain) - first;
          RmsNormBackwardLoop(px + first * c, pdy + first * c, pw, pr + first, count, c,
                              pdx + first * c, pp + chunk * c);
        }
      });
      dw = partial.sum(0);
    } else {
      const torch::Tensor inv = rstd.view({rows, 1});
      const torch::Tensor n = xf * inv, gw = dy * wf;
      dw = (dy * n).sum(0);
      dx = inv * (gw - n * (gw * n).mean(-1, true));
    }
    return {dx.view(x.sizes()).to(x.scalar_type()), dw.to(weight.scalar_type()), torch::Tensor()};
  }
};

// ---- bias + GELU, SwiGLU --------------------------------------------------------------------

struct BiasGelu : torch::autograd::Function<BiasGelu> {
  // `bias` has no elements when there is none: LibTorch 1.13's autograd functions take no
  // undefined tensors.
  static torch::Tensor forward(AutogradContext* ctx, torch::Tensor x, torch::Tensor given_bias) {
    const torch::Tensor bias = given_bias.numel() > 0 ? given_bias : torch::Tensor();
    ctx->saved_data["bias"] = bias.defined();
    const bool loop = LoopKernel(x) && x.scalar_type() == torch::kFloat &&
                      (!bias.defined() || bias.scalar_type() == torch::kFloat);
    if (!loop) {
      const torch::Tensor z = bias.defined() ? x + bias : x;
      ctx->save_for_backward({z});
      return torch::gelu(z, "tanh");
    }
    // One pass: z = x + bias (kept for backward) and gelu(z).
    const torch::Tensor xc = x.contiguous();
    torch::Tensor z = bias.defined() ? torch::empty_like(xc) : xc;
    torch::Tensor y = torch::empty_like(xc);
    const int64_t c = xc.size(-1);
    const float* px = xc.data_ptr<float>();
    const torch::Tensor bc = bias.defined() ? bias.contiguous() : torch::Tensor();
    const float* pb = bc.defined() ? bc.data_ptr<float>() : nullptr;
    float *pz = z.data_ptr<float>(), *py = y.data_ptr<float>();
    at::parallel_for(0, xc.numel() / c, 16, [&](int64_t begin, int64_t end) {
      if (pb) {
        BiasGeluForwardLoop(px + begin * c, pb, end - begin, c, pz + begin * c, py + begin * c);
      } else {
        GeluForwardLoop(px + begin * c, (end - begin) * c, py + begin * c);
      }
    });
    ctx->save_for_backward({z});
    return y;
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const torch::Tensor z = ctx->get_saved_variables()[0];
    torch::Tensor dz;
    if (LoopKernel(z) && z.scalar_type() == torch::kFloat &&
        grads[0].scalar_type() == torch::kFloat) {
      const torch::Tensor zc = z.contiguous(), g = grads[0].contiguous();
      dz = torch::empty_like(zc);
      const float *pz = zc.data_ptr<float>(), *pg = g.data_ptr<float>();
      float* pd = dz.data_ptr<float>();
      at::parallel_for(0, zc.numel(), 4096, [&](int64_t begin, int64_t end) {
        GeluBackwardLoop(pz + begin, pg + begin, end - begin, pd + begin);
      });
    } else {
      dz = torch::gelu_backward(grads[0], z, "tanh");
    }
    torch::Tensor dbias;
    if (ctx->saved_data["bias"].toBool()) dbias = dz.reshape({-1, dz.size(-1)}).sum(0);
    return {dz, dbias};
  }
};

struct SwiGlu : torch::autograd::Function<SwiGlu> {
  static torch::Tensor forward(AutogradContext* ctx, torch::Tensor gate, torch::Tensor up) {
    ctx->save_for_backward({gate, up});
    if (!LoopKernel(gate) || gate.scalar_type() != torch::kFloat ||
        up.scalar_type() != torch::kFloat) {
      return torch::silu(gate) * up;
    }
    const torch::Tensor g = gate.contiguous(), u = up.contiguous();
    torch::Tensor y = torch::empty_like(g);
    const float *pg = g.data_ptr<float>(), *pu = u.data_ptr<float>();
    float* py = y.data_ptr<float>();
    at::parallel_for(0, g.numel(), 4096, [&](int64_t begin, int64_t end) {
      SwiGluForwardLoop(pg + begin, pu + begin, end - begin, py + begin);
    });
    return y;
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const variable_list saved = ctx->get_saved_variables();
    const torch::Tensor &gate = saved[0], &up = saved[1];
    if (!LoopKernel(gate) || gate.scalar_type() != torch::kFloat ||
        up.scalar_type() != torch::kFloat) {
      const torch::Tensor sig = torch::sigmoid(gate);
      const torch::Tensor silu = gate * sig;
      return {grads[0] * up * sig * (1 + gate * (1 - sig)), grads[0] * silu};
    }
    const torch::Tensor g = gate.contiguous(), u = up.contiguous(), dy = grads[0].contiguous();
    torch::Tensor dg = torch::empty_like(g), du = torch::empty_like(u);
    const float *pg = g.data_ptr<float>(), *pu = u.data_ptr<float>(), *pdy = dy.data_ptr<float>();
    float *pdg = dg.data_ptr<float>(), *pdu = du.data_ptr<float>();
    at::parallel_for(0, g.numel(), 4096, [&](int64_t begin, int64_t end) {
      SwiGluBackwardLoop(pg + begin, pu + begin, pdy + begin, end - begin, pdg + begin,
                         pdu + begin);
    });
    return {dg, du};
  }
};

}  // namespace

torch::Tensor MathAttention(const torch::Tensor& q, const torch::Tensor& k,
                            const torch::Tensor& v) {
  const int64_t t = q.size(2);
  torch::Tensor scores = torch::matmul(q, k.transpose(-2, -1)) / std::sqrt(double(q.size(3)));
  torch::Tensor future =
      torch::ones({t, t}, torch::TensorOptions().dtype(torch::kBool).device(q.device())).triu(1);
  scores = scores.masked_fill(future, -std::numeric_limits<double>::infinity());
  torch::Tensor probs = torch::softmax(scores, -1, torch::kFloat).to(q.scalar_type());
  return torch::matmul(probs, v);
}

torch::Tensor MemoryEfficientAttention(const torch::Tensor& q, const torch::Tensor& k,
                                       const torch::Tensor& v, int64_t block) {
  return Attention::apply(q, k, v, block);
}

torch::Tensor FusedRmsNorm(const torch::Tensor& x, const torch::Tensor& weight, double eps) {
  return RmsNorm::apply(x, weight, eps);
}

torch::Tensor FusedBiasGelu(const torch::Tensor& x, const torch::Tensor& bias) {
  return BiasGelu::apply(x, bias.defined() ? bias : torch::empty({0}, x.options()));
}

torch::Tensor FusedSwiGlu(const torch::Tensor& gate, const torch::Tensor& up) {
  return SwiGlu::apply(gate, up);
}

}  // namespace cai::kernels
