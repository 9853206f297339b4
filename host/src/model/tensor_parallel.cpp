#include "model/tensor_parallel.h"

#include <algorithm>
#include <functional>
#include <future>
#include <limits>
#include <string>
#include <utility>
#include <vector>

#include "core/status.h"
#include "model/kernels.h"

namespace cai::tp {

int64_t Handle(const TensorParallelGroup& group) {
  return static_cast<int64_t>(reinterpret_cast<intptr_t>(&group));
}
const TensorParallelGroup& GroupOf(int64_t handle) {
  return *reinterpret_cast<const TensorParallelGroup*>(static_cast<intptr_t>(handle));
}

namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;
using tp::GroupOf;  // beside the overload below, which would hide it

const TensorParallelGroup& GroupOf(AutogradContext* ctx) {
  return GroupOf(ctx->saved_data["group"].toInt());
}

struct Copy : torch::autograd::Function<Copy> {
  static torch::Tensor forward(AutogradContext* ctx, torch::Tensor x, int64_t group) {
    ctx->saved_data["group"] = group;
    return x;
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    // A copy: autograd may hand the same gradient tensor to another branch (the residual).
    torch::Tensor grad = grads[0].clone(at::MemoryFormat::Contiguous);
    GroupOf(ctx).all_reduce(grad, CAI_REDUCE_SUM);
    return {grad, torch::Tensor()};
  }
};

struct Reduce : torch::autograd::Function<Reduce> {
  static torch::Tensor forward(AutogradContext*, torch::Tensor x, int64_t group) {
    torch::Tensor out = x.contiguous();
    GroupOf(group).all_reduce(out, CAI_REDUCE_SUM);
    return out;
  }
  static variable_list backward(AutogradContext*, variable_list grads) {
    return {grads[0], torch::Tensor()};
  }
};

// Every rank's x side by side along `dim`, in rank order: [..., s, ...] -> [..., size·s, ...].
torch::Tensor AllGatherAlong(const torch::Tensor& x, const TensorParallelGroup& g, int64_t dim) {
  std::vector<int64_t> shape = x.sizes().vec();
  shape.insert(shape.begin(), g.size);
  torch::Tensor out = torch::empty(shape, x.options());
  g.all_gather(x.contiguous(), out);
  std::vector<int64_t> whole = x.sizes().vec();
  whole[dim] *= g.size;
  return out.movedim(0, dim).reshape(whole);
}

struct Gather : torch::autograd::Function<Gather> {
  static torch::Tensor forward(AutogradContext* ctx, torch::Tensor x, int64_t group) {
    ctx->saved_data["group"] = group;
    return AllGatherAlong(x, GroupOf(group), x.dim() - 1);
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const TensorParallelGroup& g = GroupOf(ctx);
    std::vector<int64_t> split = grads[0].sizes().vec();
    split.back() /= g.size;
    split.insert(split.end() - 1, g.size);
    torch::Tensor grad = grads[0].reshape(split).select(-2, g.rank);
    return {grad.contiguous(), torch::Tensor()};
  }
};

// [B, t, ...] shards -> [B, size·t, ...].
torch::Tensor AllGatherSequence(const torch::Tensor& x, const TensorParallelGroup& g) {
  return AllGatherAlong(x, g, 1);
}

// [B, size·t, ...] partial sums -> this rank's [B, t, ...] of the sums.
torch::Tensor ReduceScatterSequence(const torch::Tensor& x, const TensorParallelGroup& g) {
  if (x.size(1) % g.size != 0) {
    throw Error(CAI_INVALID_ARGUMENT,
                "sequence parallelism splits the sequence over the tensor-parallel group: the "
                "sequence length (" +
                    std::to_string(x.size(1)) + ") must divide by tp (" + std::to_string(g.size) +
                    "); choose train.seq_len a multiple of tp_size");
  }
  std::vector<int64_t> parts = x.sizes().vec();
  parts[1] /= g.size;
  parts.insert(parts.begin() + 1, g.size);
  torch::Tensor in = x.reshape(parts).movedim(1, 0).contiguous();
  parts.erase(parts.begin() + 1);
  torch::Tensor out = torch::empty(parts, x.options());
  g.reduce_scatter(in, out);
  return out;
}

// A collective over the group whose backward is another: Forward, then Backward on the
// gradient.
using GroupFn = torch::Tensor (*)(const torch::Tensor&, const TensorParallelGroup&);
template <GroupFn Forward, GroupFn Backward>
struct Inverses : torch::autograd::Function<Inverses<Forward, Backward>> {
  static torch::Tensor forward(AutogradContext* ctx, torch::Tensor x, int64_t group) {
    ctx->saved_data["group"] = group;
    return Forward(x, GroupOf(group));
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    return {Backward(grads[0], GroupOf(ctx)), torch::Tensor()};
  }
};

using ScatterSeq = Inverses<ReduceScatterSequence, AllGatherSequence>;

// ---- Rings: size − 1 shift steps, each overlapping the compute on what is already here ------

// The kinds of message a ring sends, on channels of their own so that two rings in flight at
// once (keys and values moving on while gradients return) never take each other's place.
constexpr int kRingForward = 0, kRingReturn = 1;

// `send` around the ring into a new tensor, on a thread of its own so that it overlaps the
// step's compute; get() waits for it and rethrows its failure.
std::future<torch::Tensor> ShiftAsync(const TensorParallelGroup& g, torch::Tensor send,
                                      int channel) {
  return std::async(std::launch::async, [&g, send = std::move(send), channel] {
    torch::Tensor recv = torch::empty_like(send);
    g.shift(send, recv, channel);
    return recv;
  });
}

// An all-gather as a ring: fn(chunk, j) for every rank j's `chunk` (this rank's first), each
// call overlapping the next chunk's transfer.
void RingGather(const TensorParallelGroup& g, torch::Tensor chunk,
                const std::function<void(const torch::Tensor&, int64_t)>& fn) {
  chunk = chunk.contiguous();
  for (int64_t step = 0; step < g.size; ++step) {
    std::future<torch::Tensor> next;
    if (step + 1 < g.size) next = ShiftAsync(g, chunk, kRingForward);
    fn(chunk, (g.rank - step + g.size) % g.size);
    if (next.valid()) chunk = next.get();
  }
}

// A reduce-scatter as a ring: partial(j), this rank's addend to rank j's part of the sum, is
// computed for j = rank − 1, rank − 2, ..., rank while the sum so far travels to the next rank,
// which adds its own; the last step's is this rank's part.
torch::Tensor RingReduceScatter(const TensorParallelGroup& g,
                                const std::function<torch::Tensor(int64_t)>& partial) {
  std::future<torch::Tensor> moving;
  for (int64_t step = 0;; ++step) {
    torch::Tensor sum = partial((g.rank - 1 - step + 2 * g.size) % g.size);
    if (moving.valid()) sum = sum.add_(moving.get());
    if (step + 1 == g.size) return sum;
    moving = ShiftAsync(g, sum.contiguous(), kRingReturn);
  }
}

// Rows [j·t, (j + 1)·t) of dimension 1.
torch::Tensor Chunk(const torch::Tensor& x, int64_t j, int64_t t) {
  return x.slice(1, j * t, (j + 1) * t);
}

struct GatheredLinear : torch::autograd::Function<GatheredLinear> {
  // `biases` holds the defined ones; `has_bias` says which projection each belongs to.
  // The lists travel as TensorList: autograd tracks the tensors of a TensorList argument (and
  // would take a std::vector for a constant).
  static variable_list forward(AutogradContext* ctx, torch::Tensor x, at::TensorList weights,
                               at::TensorList biases, std::vector<int64_t> has_bias, int64_t group,
                               bool ring) {
    ctx->saved_data["group"] = group;
    ctx->saved_data["has_bias"] = has_bias;
    ctx->saved_data["ring"] = ring;
    const TensorParallelGroup& g = GroupOf(group);
    std::vector<torch::Tensor> bias(weights.size());
    for (size_t i = 0, next = 0; i < weights.size(); ++i) {
      if (has_bias[i]) bias[i] = biases[next++];
    }
    variable_list out;
    if (ring) {
      const int64_t t = x.size(1);
      for (const torch::Tensor& w : weights) {
        out.push_back(torch::empty({x.size(0), g.size * t, w.size(0)}, x.options()));
      }
      RingGather(g, x, [&](const torch::Tensor& chunk, int64_t j) {
        for (size_t i = 0; i < weights.size(); ++i) {
          Chunk(out[i], j, t).copy_(torch::linear(chunk, weights[i], bias[i]));
        }
      });
    } else {
      const torch::Tensor whole = AllGatherSequence(x, g);
      for (size_t i = 0; i < weights.size(); ++i) {
        out.push_back(torch::linear(whole, weights[i], bias[i]));
      }
    }
    variable_list saved = {x};
    saved.insert(saved.end(), weights.begin(), weights.end());
    ctx->save_for_backward(saved);
    return out;
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const variable_list saved = ctx->get_saved_variables();
    const std::vector<int64_t> has_bias = ctx->saved_data["has_bias"].toIntVector();
    const TensorParallelGroup& g = GroupOf(ctx);
    if (ctx->saved_data["ring"].toBool()) return RingBackward(saved, grads, has_bias, g);
    const torch::Tensor whole = AllGatherSequence(saved[0], g);
    const torch::Tensor rows = whole.reshape({-1, whole.size(-1)});
    torch::Tensor dwhole;
    variable_list dweights, dbiases;
    for (size_t i = 0; i < has_bias.size(); ++i) {
      const torch::Tensor& w = saved[1 + i];
      const torch::Tensor& dy = grads[i];
      if (!dy.defined()) {
        dweights.emplace_back();
        if (has_bias[i]) dbiases.emplace_back();
        continue;
      }
      const torch::Tensor dy_rows = dy.reshape({-1, dy.size(-1)});
      const torch::Tensor dx = dy.matmul(w);
      dwhole = dwhole.defined() ? dwhole.add_(dx) : dx;
      dweights.push_back(dy_rows.t().mm(rows));
      if (has_bias[i]) dbiases.push_back(dy_rows.sum(0));
    }
    variable_list out = {dwhole.defined() ? ReduceScatterSequence(dwhole, g) : torch::Tensor()};
    out.insert(out.end(), dweights.begin(), dweights.end());
    out.insert(out.end(), dbiases.begin(), dbiases.end());
    out.emplace_back();  // has_bias
    out.emplace_back();  // group
    out.emplace_back();  // ring
    return out;
  }

  // The input's chunks gathered again ring-wise, each one's weight gradients computed as it
  // comes; then the input's gradient reduce-scattered ring-wise, each rank's chunk computed as
  // the sum so far travels.
  static variable_list RingBackward(const variable_list& saved, const variable_list& grads,
                                    const std::vector<int64_t>& has_bias,
                                    const TensorParallelGroup& g) {
    const torch::Tensor& x = saved[0];
    const int64_t t = x.size(1);
    variable_list dweights(has_bias.size()), dbiases;
    for (size_t i = 0; i < has_bias.size(); ++i) {
      if (grads[i].defined()) dweights[i] = torch::zeros_like(saved[1 + i]);
      if (has_bias[i]) {
        dbiases.push_back(grads[i].defined() ? grads[i].sum(std::vector<int64_t>{0, 1})
                                             : torch::Tensor());
      }
    }
    RingGather(g, x, [&](const torch::Tensor& chunk, int64_t j) {
      const torch::Tensor rows = chunk.reshape({-1, chunk.size(-1)});
      for (size_t i = 0; i < has_bias.size(); ++i) {
        if (!grads[i].defined()) continue;
        const torch::Tensor dy = Chunk(grads[i], j, t);
        dweights[i].add_(dy.reshape({-1, dy.size(-1)}).t().mm(rows));
      }
    });
    bool any = false;
    for (const torch::Tensor& dy : grads) any = any || dy.defined();
    variable_list out = {any ? RingReduceScatter(g,
                                                 [&](int64_t j) {
                                                   torch::Tensor dx;
                                                   for (size_t i = 0; i < has_bias.size(); ++i) {
                                                     if (!grads[i].defined()) continue;
                                                     torch::Tensor part =
                                                         Chunk(grads[i], j, t).matmul(saved[1 + i]);
                                                     dx = dx.defined() ? dx.add_(part) : part;
                                                   }
                                                   return dx;
                                                 })
                             : torch::Tensor()};
    out.insert(out.end(), dweights.begin(), dweights.end());
    out.insert(out.end(), dbiases.begin(), dbiases.end());
    out.emplace_back();  // has_bias
    out.emplace_back();  // group
    out.emplace_back();  // ring
    return out;
  }
};

// The row-parallel projection with its reduce-scatter as a ring (RingScatteredLinear).
struct RingScattered : torch::autograd::Function<RingScattered> {
  static torch::Tensor forward(AutogradContext* ctx, torch::Tensor x, torch::Tensor weight,
                               int64_t group) {
    const TensorParallelGroup& g = GroupOf(group);
    if (x.size(1) % g.size != 0) {
      throw Error(CAI_INVALID_ARGUMENT,
                  "sequence parallelism splits the sequence over the tensor-parallel group: the "
                  "sequence length (" +
                      std::to_string(x.size(1)) + ") must divide by tp (" + std::to_string(g.size) +
                      "); choose train.seq_len a multiple of tp_size");
    }
    const int64_t t = x.size(1) / g.size;
    ctx->saved_data["group"] = group;
    ctx->save_for_backward({x, weight});
    return RingReduceScatter(g, [&](int64_t j) { return torch::linear(Chunk(x, j, t), weight); });
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const variable_list saved = ctx->get_saved_variables();
    const torch::Tensor &x = saved[0], &weight = saved[1];
    const TensorParallelGroup& g = GroupOf(ctx);
    const int64_t t = x.size(1) / g.size;
    torch::Tensor dx = torch::empty_like(x), dweight = torch::zeros_like(weight);
    RingGather(g, grads[0], [&](const torch::Tensor& dy, int64_t j) {
      const torch::Tensor xj = Chunk(x, j, t);
      Chunk(dx, j, t).copy_(dy.matmul(weight));
      dweight.add_(dy.reshape({-1, dy.size(-1)}).t().mm(xj.reshape({-1, xj.size(-1)})));
    });
    return {dx, dweight, torch::Tensor()};
  }
};

struct CrossEntropy : torch::autograd::Function<CrossEntropy> {
  static torch::Tensor forward(AutogradContext* ctx, torch::Tensor logits, torch::Tensor targets,
                               int64_t group, int64_t start, int64_t ignore) {
    const TensorParallelGroup& g = GroupOf(group);
    const int64_t n = logits.size(0), part = logits.size(1);
    torch::Tensor max =
        part > 0 ? std::get<0>(logits.max(1)).contiguous()
                 : torch::full({n}, -std::numeric_limits<float>::infinity(), logits.options());
    g.all_reduce(max, CAI_REDUCE_MAX);
    torch::Tensor exp = (logits - max.unsqueeze(1)).exp_();
    torch::Tensor sum = exp.sum(1).contiguous();
    g.all_reduce(sum, CAI_REDUCE_SUM);
    const torch::Tensor counted = targets.ne(ignore);
    const torch::Tensor here =
        counted.logical_and(targets.ge(start)).logical_and(targets.lt(start + part));
    const torch::Tensor column = (targets - start).masked_fill(here.logical_not(), 0);
    torch::Tensor picked = part > 0 ? logits.gather(1, column.unsqueeze(1)).squeeze(1)
                                    : torch::zeros({n}, logits.options());
    picked = picked.masked_fill(here.logical_not(), 0).contiguous();
    g.all_reduce(picked, CAI_REDUCE_SUM);
    // log Σ exp(l) - l_target, with the maximum taken out of the sum.
    const torch::Tensor per_row = (sum.log() + max - picked).masked_fill(counted.logical_not(), 0);
    const torch::Tensor count = counted.sum().to(logits.scalar_type());
    ctx->save_for_backward({exp.div_(sum.unsqueeze(1)), column, here, counted, count});
    return per_row.sum() / count;
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    variable_list saved = ctx->get_saved_variables();
    torch::Tensor grad = saved[0];  // softmax; this graph's backward runs once
    const torch::Tensor& column = saved[1];
    const torch::Tensor& here = saved[2];
    const torch::Tensor& counted = saved[3];
    if (grad.size(1) > 0) {
      grad.scatter_add_(1, column.unsqueeze(1), -here.to(grad.scalar_type()).unsqueeze(1));
    }
    grad.mul_((counted.to(grad.scalar_type()) * (grads[0] / saved[4])).unsqueeze(1));
    return {grad, torch::Tensor(), torch::Tensor(), torch::Tensor(), torch::Tensor()};
  }
};

// Ulysses' two all-to-alls over [B, heads, positions, D]. Sequence to heads: this rank's
// positions of every head -> every rank's positions (in rank order) of this rank's 1/size of
// the heads. Heads to sequence is its inverse; each is the other's backward.
torch::Tensor AllToAllSequenceToHeads(const torch::Tensor& x, const TensorParallelGroup& g) {
  const int64_t b = x.size(0), h = x.size(1), t = x.size(2), d = x.size(3);
  torch::Tensor in = x.reshape({b, g.size, h / g.size, t, d}).transpose(0, 1).contiguous();
  torch::Tensor out = torch::empty_like(in);
  g.all_to_all(in, out);  // out[i]: rank i's positions of this rank's heads
  return out.permute({1, 2, 0, 3, 4}).reshape({b, h / g.size, g.size * t, d});
}

torch::Tensor AllToAllHeadsToSequence(const torch::Tensor& x, const TensorParallelGroup& g) {
  const int64_t b = x.size(0), h = x.size(1), t = x.size(2) / g.size, d = x.size(3);
  torch::Tensor in = x.reshape({b, h, g.size, t, d}).permute({2, 0, 1, 3, 4}).contiguous();
  torch::Tensor out = torch::empty_like(in);
  g.all_to_all(in, out);  // out[i]: rank i's heads at this rank's positions
  // Laid out [B, t, H, D] underneath, so that merging the heads after it is a view.
  return out.permute({1, 3, 0, 2, 4}).reshape({b, t, g.size * h, d}).transpose(1, 2);
}

using SequenceToHeadsFn = Inverses<AllToAllSequenceToHeads, AllToAllHeadsToSequence>;
using HeadsToSequenceFn = Inverses<AllToAllHeadsToSequence, AllToAllSequenceToHeads>;

// ---- Ring attention --------------------------------------------------------------------------

// The zigzag split: a rank's 2c positions are chunk r then chunk 2·size − 1 − r of 2·size. Which
// of its query rows [q0, q1) see which of the key rows [k0, k1) of rank `source`'s block:
// its own block causally by local index (both chunks ascend); an earlier rank's first chunk
// precedes both of this rank's chunks and its second follows them; of a later rank's block,
// only this rank's second chunk follows both of its chunks. Off the diagonal a step does half
// the work, the same half on every rank.
struct RingStep {
  int64_t q0, q1, k0, k1;
  bool causal;
};
RingStep StepOf(int64_t rank, int64_t source, int64_t t) {
  const int64_t c = t / 2;
  if (source == rank) return {0, t, 0, t, true};
  if (source < rank) return {0, t, 0, c, false};
  return {c, t, 0, t, false};
}

// The causal mask of query rows [i0, i1) against the step's keys; none off the diagonal.
torch::Tensor Mask(const RingStep& st, int64_t i0, int64_t i1, const torch::Device& device) {
  return st.causal ? kernels::FutureMask(i0, i1, st.k0, st.k1, device) : torch::Tensor();
}

// Query rows per tile: the scores held at once are a tile's rows against one block's keys.
constexpr int64_t kRingTile = 128;
// k or v [B, Hkv, t, D] for queries of `group` heads each: repeated as attention reads them.
torch::Tensor Expand(const torch::Tensor& x, int64_t group) {
  return group == 1 ? x : x.repeat_interleave(group, 1);
}
// The gradient of Expand: a key/value head's queries' gradients summed.
torch::Tensor Contract(const torch::Tensor& x, int64_t group) {
  return x.view({x.size(0), x.size(1) / group, group, x.size(2), x.size(3)}).sum(2);
}

// The keys and values of a step (of `kv`, k and v stacked), as its queries read them.
std::pair<torch::Tensor, torch::Tensor> StepKeysValues(const torch::Tensor& kv, const RingStep& st,
                                                       int64_t heads_per_kv) {
  return {Expand(kv[0].slice(2, st.k0, st.k1), heads_per_kv),
          Expand(kv[1].slice(2, st.k0, st.k1), heads_per_kv)};
}

struct RingAttentionFn : torch::autograd::Function<RingAttentionFn> {
  static torch::Tensor forward(AutogradContext* ctx, torch::Tensor q, torch::Tensor k,
                               torch::Tensor v, int64_t group) {
    const TensorParallelGroup& g = GroupOf(group);
    const int64_t b = q.size(0), h = q.size(1), t = q.size(2), d = q.size(3);
    const int64_t heads_per_kv = h / k.size(1);
    const float inf = std::numeric_limits<float>::infinity();
    const torch::TensorOptions f32 = q.options().dtype(torch::kFloat);
    torch::Tensor m = torch::full({b, h, t}, -inf, f32), l = torch::zeros({b, h, t}, f32);
    torch::Tensor acc = torch::zeros({b, h, t, d}, f32);
    torch::Tensor kv = torch::stack({k, v});
    for (int64_t step = 0; step < g.size; ++step) {
      std::future<torch::Tensor> next;
      if (step + 1 < g.size) next = ShiftAsync(g, kv, kRingForward);
      const RingStep st = StepOf(g.rank, (g.rank - step + g.size) % g.size, t);
      const auto [ks, vs] = StepKeysValues(kv, st, heads_per_kv);
      for (int64_t i0 = st.q0; i0 < st.q1; i0 += kRingTile) {
        const int64_t i1 = std::min(st.q1, i0 + kRingTile);
        kernels::AttendBlock(q.slice(2, i0, i1), ks, vs, Mask(st, i0, i1, q.device()),
                             m.slice(2, i0, i1), l.slice(2, i0, i1), acc.slice(2, i0, i1));
      }
      if (next.valid()) kv = next.get();
    }
    // [B, T, H, D] underneath, as the memory-efficient attention writes it: merging the heads
    // is then a view.
    torch::Tensor out = torch::empty({b, t, h, d}, q.options()).transpose(1, 2);
    out.copy_(acc.div_(l.unsqueeze(-1)));
    const torch::Tensor lse = m.add_(l.log_());
    ctx->save_for_backward({q, k, v, out, lse});
    ctx->saved_data["group"] = group;
    return out;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const variable_list saved = ctx->get_saved_variables();
    const torch::Tensor &q = saved[0], &k = saved[1], &v = saved[2], &out = saved[3],
                        &lse = saved[4];
    const TensorParallelGroup& g = GroupOf(ctx);
    const torch::ScalarType type = q.scalar_type();
    const int64_t t = q.size(2), heads_per_kv = q.size(1) / k.size(1);
    const torch::Tensor& dout = grads[0];
    // FlashAttention-2's D = rowsum(dO ∘ O).
    const torch::Tensor delta = (dout.to(torch::kFloat) * out.to(torch::kFloat)).sum(-1);
    torch::Tensor dq = torch::zeros(q.sizes(), q.options().dtype(torch::kFloat));
    torch::Tensor kv = torch::stack({k, v});
    // The gradient of the block held, from the ranks it has visited, and its way on.
    std::future<torch::Tensor> returning;
    for (int64_t step = 0; step < g.size; ++step) {
      std::future<torch::Tensor> next;
      if (step + 1 < g.size) next = ShiftAsync(g, kv, kRingForward);
      const RingStep st = StepOf(g.rank, (g.rank - step + g.size) % g.size, t);
      const auto [ks, vs] = StepKeysValues(kv, st, heads_per_kv);
      // The block's gradient; without grouped heads the step accumulates into it in place.
      torch::Tensor dkv = torch::zeros(kv.sizes(), dq.options());
      const torch::Tensor dk_rows = dkv[0].slice(2, st.k0, st.k1);
      const torch::Tensor dv_rows = dkv[1].slice(2, st.k0, st.k1);
      torch::Tensor dks = heads_per_kv == 1 ? dk_rows : torch::zeros(ks.sizes(), dq.options());
      torch::Tensor dvs = heads_per_kv == 1 ? dv_rows : torch::zeros(vs.sizes(), dq.options());
      for (int64_t i0 = st.q0; i0 < st.q1; i0 += kRingTile) {
        const int64_t i1 = std::min(st.q1, i0 + kRingTile);
        kernels::AttendBlockBackward(q.slice(2, i0, i1), ks, vs, dout.slice(2, i0, i1),
                                     lse.slice(2, i0, i1), delta.slice(2, i0, i1),
                                     Mask(st, i0, i1, q.device()), dq.slice(2, i0, i1), dks, dvs);
      }
      if (heads_per_kv > 1) {
        dk_rows.copy_(Contract(dks, heads_per_kv));
        dv_rows.copy_(Contract(dvs, heads_per_kv));
      }
      if (returning.valid()) dkv.add_(returning.get());
      if (next.valid()) kv = next.get();
      // On to the rank that now holds the block; after the last step, home to its owner.
      returning = ShiftAsync(g, dkv, kRingReturn);
    }
    const torch::Tensor dkv = returning.get();
    return {dq.to(type), dkv[0].to(type), dkv[1].to(type), torch::Tensor()};
  }
};

}  // namespace

torch::Tensor RingAttention(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                            const TensorParallelGroup& group) {
  return RingAttentionFn::apply(q, k, v, Handle(group));
}

torch::Tensor CopyToGroup(const torch::Tensor& x, const TensorParallelGroup& group) {
  return Copy::apply(x, Handle(group));
}
torch::Tensor ReduceFromGroup(const torch::Tensor& x, const TensorParallelGroup& group) {
  return Reduce::apply(x, Handle(group));
}
torch::Tensor GatherLastDim(const torch::Tensor& x, const TensorParallelGroup& group) {
  return Gather::apply(x, Handle(group));
}
torch::Tensor ScatterSequence(const torch::Tensor& x, const TensorParallelGroup& group) {
  return ScatterSeq::apply(x, Handle(group));
}
torch::Tensor SequenceToHeads(const torch::Tensor& x, const TensorParallelGroup& group) {
  return SequenceToHeadsFn::apply(x, Handle(group));
}
torch::Tensor HeadsToSequence(const torch::Tensor& x, const TensorParallelGroup& group) {
  return HeadsToSequenceFn::apply(x, Handle(group));
}

torch::Tensor SequenceShardLoss(const torch::Tensor& mean, const torch::Tensor& targets,
                                int64_t ignore, const TensorParallelGroup& group) {
  const int64_t counted = targets.ne(ignore).sum().item<int64_t>();
  // An all-ignored shard's mean is 0/0: it adds nothing, but stays in the graph.
  const torch::Tensor sum = counted > 0 ? mean * double(counted) : mean.nan_to_num(0) * 0;
  torch::Tensor totals = torch::stack({sum.detach().to(torch::kFloat),
                                       torch::scalar_tensor(double(counted), torch::kFloat)})
                             .contiguous();
  group.all_reduce(totals, CAI_REDUCE_SUM);
  const double whole = totals[1].item<double>();
  // Value: the micro-batch's mean over every shard. Gradient: this shard's share of it, so
  // that the ranks' gradients sum to the gradient, as data-parallel replicas' weighted ones do.
  const torch::Tensor share = sum / whole;
  return share - share.detach() + totals[0] / whole;
}
std::vector<torch::Tensor> GatheredLinears(const torch::Tensor& x,
                                           const std::vector<torch::Tensor>& weights,
                                           const std::vector<torch::Tensor>& biases,
                                           const TensorParallelGroup& group, bool ring) {
  variable_list defined;
  std::vector<int64_t> has_bias;
  for (const torch::Tensor& b : biases) {
    has_bias.push_back(b.defined());
    if (b.defined()) defined.push_back(b);
  }
  return GatheredLinear::apply(x, at::TensorList(weights), at::TensorList(defined), has_bias,
                               Handle(group), ring);
}
torch::Tensor RingScatteredLinear(const torch::Tensor& x, const torch::Tensor& weight,
                                  const TensorParallelGroup& group) {
  return RingScattered::apply(x, weight, Handle(group));
}
torch::Tensor VocabParallelCrossEntropy(const torch::Tensor& logits, const torch::Tensor& targets,
                                        const TensorParallelGroup& group, int64_t start,
                                        int64_t ignore) {
  return CrossEntropy::apply(logits, targets, Handle(group), start, ignore);
}

void SliceParam(ParamSpec& p, int32_t dim, int32_t blocks, int64_t padded_block,
                const TensorParallelGroup& group) {
  torch::NoGradGuard no_grad;
  const int64_t block = p.tensor.size(dim) / blocks;
  const int64_t part = padded_block / group.size, first = group.rank * part;
  std::vector<torch::Tensor> pieces;
  for (int32_t b = 0; b < blocks; ++b) {
    const int64_t count = std::clamp<int64_t>(block - first, 0, part);
    if (count > 0) pieces.push_back(p.tensor.narrow(dim, b * block + first, count));
    if (count < part) {  // padding (the vocabulary's): zeros, never read
      std::vector<int64_t> shape = p.global_shape;
      shape[dim] = part - count;
      pieces.push_back(torch::zeros(shape, p.tensor.options()));
    }
  }
  p.tensor.set_data(torch::cat(pieces, dim).contiguous());
  p.tp_dim = dim;
  p.tp_blocks = blocks;
  p.tp_padded = padded_block * blocks;
}

}  // namespace cai::tp
