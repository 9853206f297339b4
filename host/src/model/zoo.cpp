// The model zoo: GPT-2 and Llama as flat lists of parameters and the forward of each unit.
#include <algorithm>
#include <cmath>
#include <limits>
#include <sstream>

#include "core/status.h"
#include "model/kernels.h"
#include "model/network.h"
#include "model/tensor_parallel.h"
#include "model/torch_compat.h"
#include "model/weight_grad.h"

namespace cai {
namespace {

constexpr uint32_t kNone = std::numeric_limits<uint32_t>::max();

// splitmix64 (Steele et al., "Fast splittable pseudorandom number generators", 2014): spreads
// (seed, parameter index) into independent generator seeds.
uint64_t SplitMix64(uint64_t x) {
  x += 0x9e3779b97f4a7c15ULL;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ULL;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebULL;
  return x ^ (x >> 31);
}

[[noreturn]] void BadConfig(const std::string& message) {
  throw Error(CAI_INVALID_ARGUMENT, "model config: " + message);
}

void Validate(const ModelConfig& c) {
  auto positive = [](int64_t v, const char* name) {
    if (v <= 0) BadConfig(std::string(name) + " must be positive, got " + std::to_string(v));
  };
  positive(c.vocab_size, "vocab_size");
  positive(c.n_ctx, "n_ctx");
  positive(c.n_layer, "n_layer");
  positive(c.n_head, "n_head");
  positive(c.n_embd, "n_embd");
  if (c.n_kv_head < 0 || c.ffn_hidden < 0) BadConfig("n_kv_head and ffn_hidden must be >= 0");
  if (c.n_embd % c.n_head != 0) {
    BadConfig("n_embd (" + std::to_string(c.n_embd) + ") must be a multiple of n_head (" +
              std::to_string(c.n_head) + ")");
  }
  const int64_t kv = c.n_kv_head == 0 ? c.n_head : c.n_kv_head;
  if (c.arch == ModelConfig::Arch::kGpt2 && kv != c.n_head) {
    BadConfig("GPT-2 has no grouped-query attention: n_kv_head must be 0 or n_head");
  }
  if (c.n_head % kv != 0) {
    BadConfig("n_head (" + std::to_string(c.n_head) + ") must be a multiple of n_kv_head (" +
              std::to_string(kv) + ")");
  }
  if (c.arch == ModelConfig::Arch::kLlama && (c.n_embd / c.n_head) % 2 != 0) {
    BadConfig("Llama's rotary embedding needs an even head size (n_embd / n_head)");
  }
  if (c.dropout != 0.0) {
    BadConfig(
        "dropout must be 0: a stochastic forward cannot be recomputed identically under "
        "activation checkpointing");
  }
  if (!(c.norm_eps > 0.0)) BadConfig("norm_eps must be positive");
  if (!(c.rope_theta > 0.0)) BadConfig("rope_theta must be positive");
  if (!(c.init_std >= 0.0)) BadConfig("init_std must be >= 0");
}

// Registers parameters in order; the registration index seeds each parameter's generator, so
// a parameter's values do not depend on when it is drawn (lazy_init draws it on first read).
class Builder {
 public:
  Builder(Network& net, uint64_t seed, bool lazy) : net_(net), seed_(seed), lazy_(lazy) {}

  uint32_t Normal(const std::string& module, std::vector<int64_t> shape, double std, int32_t unit,
                  cai_param_role role, int32_t parallel_dim) {
    const uint64_t seed = SplitMix64(seed_ ^ SplitMix64(Next()));
    return Add(module, "weight", std::move(shape), unit, role, parallel_dim, false,
               [seed, std](const torch::Tensor& t) {
                 torch::Generator gen = torch_compat::CpuGenerator(seed);
                 t.normal_(0.0, std, gen);
               });
  }
  uint32_t Fill(const std::string& module, const char* leaf, int64_t n, double value, int32_t unit,
                cai_param_role role, int32_t parallel_dim) {
    Next();
    return Add(module, leaf, {n}, unit, role, parallel_dim, std::string(leaf) == "bias",
               [value](const torch::Tensor& t) { t.fill_(value); });
  }

 private:
  uint64_t Next() { return index_++; }
  uint32_t Add(const std::string& module, const char* leaf, std::vector<int64_t> shape,
               int32_t unit, cai_param_role role, int32_t parallel_dim, bool is_bias,
               std::function<void(const torch::Tensor&)> init) {
    torch::Tensor t;
    if (lazy_) {
      t = torch_compat::UnallocatedTensor(shape);
    } else {
      t = torch::empty(shape, torch::kFloat);
      init(t);
    }
    ParamSpec spec;
    spec.name = module + "." + leaf;
    spec.module_path = module;
    spec.init = std::move(init);
    spec.tensor = t.requires_grad_(true);
    spec.unit = unit;
    spec.role = role;
    spec.parallel_dim = parallel_dim;
    spec.is_bias = is_bias;
    net_.params.push_back(std::move(spec));
    return static_cast<uint32_t>(net_.params.size() - 1);
  }

  Network& net_;
  uint64_t seed_;
  bool lazy_;
  uint64_t index_ = 0;
};

// [B, T, H * D] -> [B, H, T, D] and back.
torch::Tensor SplitHeads(const torch::Tensor& x, int64_t heads) {
  return x.view({x.size(0), x.size(1), heads, -1}).transpose(1, 2);
}
torch::Tensor MergeHeads(const torch::Tensor& x) {
  return x.transpose(1, 2).contiguous().view({x.size(0), x.size(2), -1});
}

class ZooNetwork : public Network {
 public:
  void EnableKernels(uint64_t kernels) override {
    constexpr uint64_t kKnown = CAI_MODEL_KERNEL_MEMORY_EFFICIENT_ATTENTION |
                                CAI_MODEL_KERNEL_FUSED_NORMALIZATION |
                                CAI_MODEL_KERNEL_FUSED_ACTIVATION;
    if (kernels & ~kKnown) {
      throw Error(CAI_INVALID_ARGUMENT,
                  "enable_kernels: unknown kernel bits " + std::to_string(kernels & ~kKnown));
    }
    kernels_ |= kernels;
  }

  void ApplyTensorParallel(TensorParallelGroup group,
                           const TensorParallelOptions& options) override {
    if (tp_.size > 1) {
      throw Error(CAI_FAILED_PRECONDITION,
                  "apply_tensor_parallel: tensor parallelism is already applied to this model");
    }
    if (sp_.size > 1) {
      throw Error(CAI_FAILED_PRECONDITION,
                  "apply_tensor_parallel: sequence parallelism is already applied to this "
                  "model; apply tensor parallelism first, which divides the heads Ulysses "
                  "divides again");
    }
    const int64_t n = CheckedSize(group, "apply_tensor_parallel");
    auto divides = [&](int64_t value, const std::string& what) {
      if (value % n != 0) {
        throw Error(CAI_INVALID_ARGUMENT, "apply_tensor_parallel: a tensor-parallel group of " +
                                              std::to_string(n) + " ranks must divide " + what +
                                              " (" + std::to_string(value) +
                                              "); choose a tp size that divides it");
      }
    };
    divides(c_.n_head, "the attention heads (n_head)");
    divides(n_kv_head_, "the key/value heads (n_kv_head)");
    divides(ffn_, "the MLP width (ffn_hidden)");
    const int64_t multiple = n * std::max<int64_t>(1, options.vocab_divisible_by);
    padded_vocab_ = (c_.vocab_size + multiple - 1) / multiple * multiple;
    for (ParamSpec& p : params) {
      p.global_shape = p.tensor.sizes().vec();
      if (p.parallel_dim < 0) continue;
      const bool vocab = p.role == CAI_ROLE_EMBEDDING || p.role == CAI_ROLE_LM_HEAD;
      const int32_t blocks = p.role == CAI_ROLE_ATTN_QKV ? 3 : 1;
      tp::SliceParam(p, p.parallel_dim, blocks,
                     vocab ? padded_vocab_ : p.tensor.size(p.parallel_dim) / blocks, group);
    }
    heads_ = c_.n_head / n;
    kv_heads_ = n_kv_head_ / n;
    gather_output_ = options.gather_output;
    sequence_parallel_ = options.sequence_parallel && n > 1;
    ring_ = sequence_parallel_ && options.ring;
    tp_ = std::move(group);
  }

  void ApplySequenceParallel(TensorParallelGroup group, int32_t mode) override {
    if (sp_.size > 1) {
      throw Error(CAI_FAILED_PRECONDITION,
                  "apply_sequence_parallel: sequence parallelism is already applied to this "
                  "model");
    }
    if (sequence_parallel_) {
      throw Error(CAI_INVALID_ARGUMENT,
                  "apply_sequence_parallel: tensor parallelism's sequence_parallel "
                  "(split_gather) already splits the sequence; use one of the two");
    }
    const int64_t n = CheckedSize(group, "apply_sequence_parallel");
    const std::string per_rank = tp_.size > 1 ? " per tensor-parallel rank" : "";
    for (const auto& [value, what] : {std::pair{heads_, "attention heads (n_head"},
                                      std::pair{kv_heads_, "key/value heads (n_kv_head"}}) {
      // Ring attention keeps every head on every rank.
      if (mode == CAI_SEQUENCE_PARALLEL_ALL_TO_ALL && value % n != 0) {
        throw Error(CAI_INVALID_ARGUMENT,
                    "apply_sequence_parallel: Ulysses gives each of the " + std::to_string(n) +
                        " ranks of the sequence-parallel group an equal share of the " + what +
                        (tp_.size > 1 ? " / tp" : "") + ": " + std::to_string(value) + per_rank +
                        "); choose an sp size that divides it");
      }
    }
    sp_ = std::move(group);
    sp_mode_ = mode;
  }

  torch::Tensor LocalTargets(const torch::Tensor& targets) const override {
    return SequenceShard(targets, 1);
  }

  torch::Tensor CrossEntropy(const torch::Tensor& logits, const torch::Tensor& targets,
                             int64_t ignore_index) const override {
    const torch::Tensor mean = VocabCrossEntropy(logits, targets, ignore_index);
    return sp_.size > 1 ? tp::SequenceShardLoss(mean, targets, ignore_index, sp_) : mean;
  }

 protected:
  explicit ZooNetwork(const ModelConfig& c) : c_(c) {
    vocab_size = c.vocab_size;
    n_ctx = c.n_ctx;
  }
  torch::Tensor Wb(uint32_t index) const { return index == kNone ? torch::Tensor() : W(index); }
  // x·Wᵀ + b in the compute dtype; its weight gradient may be deferred (split backward).
  torch::Tensor Project(const torch::Tensor& x, uint32_t w, uint32_t b) const {
    return Linear(x, params[w].tensor, b == kNone ? torch::Tensor() : params[b].tensor,
                  compute_type());
  }

  bool Has(uint64_t kernel) const { return (kernels_ & kernel) != 0; }

  static int64_t CheckedSize(const TensorParallelGroup& group, const char* what) {
    if (group.size < 1 || group.rank < 0 || group.rank >= group.size) {
      throw Error(CAI_INVALID_ARGUMENT, std::string(what) + ": rank " + std::to_string(group.rank) +
                                            " of a group of " + std::to_string(group.size));
    }
    return group.size;
  }

  // The mean cross-entropy of this rank's logits, over the vocabulary's tensor-parallel split.
  torch::Tensor VocabCrossEntropy(const torch::Tensor& logits, const torch::Tensor& targets,
                                  int64_t ignore_index) const {
    if (tp_.size == 1) return Network::CrossEntropy(logits, targets, ignore_index);
    const torch::Tensor local = logits.to(torch::kFloat);
    if (gather_output_) {
      torch::Tensor whole = tp::GatherLastDim(local, tp_);
      return Network::CrossEntropy(whole.slice(1, 0, c_.vocab_size), targets, ignore_index);
    }
    const int64_t part = local.size(1), start = tp_.rank * part;
    const int64_t real = std::clamp<int64_t>(c_.vocab_size - start, 0, part);
    return tp::VocabParallelCrossEntropy(local.slice(1, 0, real), targets, tp_, start,
                                         ignore_index);
  }

  bool RingAttn() const { return sp_.size > 1 && sp_mode_ == CAI_SEQUENCE_PARALLEL_RING_ATTN; }

  // This rank's positions of `x` along `dim` (the whole sequence's length): under Ulysses the
  // consecutive T/sp from rank·T/sp; under ring attention chunks rank and 2·sp − 1 − rank of
  // 2·sp (the zigzag split); all of them otherwise.
  torch::Tensor SequenceShard(const torch::Tensor& x, int64_t dim) const {
    if (sp_.size == 1) return x;
    const int64_t t = x.size(dim), parts = RingAttn() ? 2 * sp_.size : sp_.size;
    if (t % parts != 0) {
      throw Error(CAI_INVALID_ARGUMENT,
                  RingAttn()
                      ? "sequence parallelism (ring_attn) cuts the sequence into 2 x sp_size "
                        "= " +
                            std::to_string(parts) +
                            " equal chunks, two per rank of the sequence-parallel group: its "
                            "length (" +
                            std::to_string(t) + ") must divide by " + std::to_string(parts) +
                            "; choose train.seq_len a multiple of it"
                      : "sequence parallelism (all_to_all) gives each of the " +
                            std::to_string(sp_.size) +
                            " ranks of the sequence-parallel group an equal shard of the "
                            "sequence: its length (" +
                            std::to_string(t) +
                            ") must divide by sp_size; choose train.seq_len a multiple of it");
    }
    const int64_t c = t / parts, r = sp_.rank;
    if (!RingAttn()) return x.slice(dim, r * c, (r + 1) * c);
    return torch::cat(
        {x.slice(dim, r * c, (r + 1) * c), x.slice(dim, (parts - 1 - r) * c, (parts - r) * c)},
        dim);
  }

  // Causal attention of q [B, Hq, t, D] over k, v [B, Hkv, t, D] (this rank's heads), merged
  // to [B, t, Hq·D]. Under sequence parallelism t is this rank's shard of the positions. Under
  // Ulysses one all-to-all takes q, k, v packed to every position of 1/sp of the heads
  // (key/value heads going with their queries' share), and one brings the output back; under
  // ring attention the keys and values go around the group.
  torch::Tensor Attend(torch::Tensor q, torch::Tensor k, torch::Tensor v) const {
    const int64_t hq = q.size(1), hkv = k.size(1);
    if (RingAttn()) return MergeHeads(tp::RingAttention(q, k, v, sp_));
    if (sp_.size > 1) {
      const int64_t s = sp_.size, b = q.size(0), t = q.size(2), d = q.size(3);
      auto per_rank = [&](const torch::Tensor& x) {
        return x.reshape({b, s, x.size(1) / s, t, d});
      };
      const torch::Tensor packed =
          torch::cat({per_rank(q), per_rank(k), per_rank(v)}, 2).reshape({b, -1, t, d});
      const std::vector<torch::Tensor> parts =
          tp::SequenceToHeads(packed, sp_).split({hq / s, hkv / s, hkv / s}, 1);
      q = parts[0];
      k = parts[1];
      v = parts[2];
    }
    const int64_t group = hq / hkv;
    if (group > 1) {
      k = k.repeat_interleave(group, 1);
      v = v.repeat_interleave(group, 1);
    }
    torch::Tensor out = Attention(q, k, v);
    return MergeHeads(sp_.size > 1 ? tp::HeadsToSequence(out, sp_) : out);
  }
  torch::Tensor Attention(const torch::Tensor& q, const torch::Tensor& k,
                          const torch::Tensor& v) const {
    return Has(CAI_MODEL_KERNEL_MEMORY_EFFICIENT_ATTENTION)
               ? kernels::MemoryEfficientAttention(q, k, v)
               : kernels::MathAttention(q, k, v);
  }

  // Column-parallel projections of x, one per (weight, bias) pair (kNone: no bias): f before
  // them, or under sequence parallelism the all-gather of the sequence shards, which backward
  // gathers again rather than keep the whole sequence.
  std::vector<torch::Tensor> Column(const torch::Tensor& x,
                                    std::initializer_list<std::pair<uint32_t, uint32_t>> wb) const {
    if (sequence_parallel_) {
      std::vector<torch::Tensor> weights, biases;
      for (const auto& [w, b] : wb) {
        weights.push_back(W(w));
        biases.push_back(Wb(b));
      }
      return tp::GatheredLinears(x, weights, biases, tp_, ring_);
    }
    const torch::Tensor in = tp_.size == 1 ? x : tp::CopyToGroup(x, tp_);
    std::vector<torch::Tensor> out;
    for (const auto& [w, b] : wb) out.push_back(Project(in, w, b));
    return out;
  }
  // A row-parallel projection: partial products summed over the group (g, or under sequence
  // parallelism reduce-scattered into sequence shards), the bias added once.
  torch::Tensor RowLinear(const torch::Tensor& x, uint32_t w, uint32_t b) const {
    if (tp_.size == 1) return Project(x, w, b);
    torch::Tensor y = ring_                ? tp::RingScatteredLinear(x, W(w), tp_)
                      : sequence_parallel_ ? tp::ScatterSequence(Project(x, w, kNone), tp_)
                                           : tp::ReduceFromGroup(Project(x, w, kNone), tp_);
    return b == kNone ? y : y + Shard(b);
  }
  // A replicated parameter read between the tensor-parallel regions (norms, row-parallel
  // biases, positions). Under sequence parallelism each rank sees its shard of the sequence,
  // so its gradient is partial: f sums it over the group in backward, and every rank holds
  // the whole gradient, as without sequence parallelism.
  torch::Tensor Shard(uint32_t index) const {
    if (index == kNone) return torch::Tensor();
    return sequence_parallel_ ? tp::CopyToGroup(W(index), tp_) : W(index);
  }
  // Token embedding; under tensor parallelism each rank looks up the tokens of its rows of
  // the vocabulary, zeros for the others, and the group sums.
  torch::Tensor Embed(uint32_t index, const torch::Tensor& tokens) const {
    if (tp_.size == 1) return torch::embedding(W(index), tokens);
    const int64_t part = params[index].tensor.size(0), start = tp_.rank * part;
    const torch::Tensor outside = tokens.lt(start).logical_or(tokens.ge(start + part));
    torch::Tensor rows = torch::embedding(W(index), (tokens - start).masked_fill(outside, 0));
    rows = rows.masked_fill(outside.unsqueeze(-1), 0);
    return sequence_parallel_ ? tp::ScatterSequence(rows, tp_) : tp::ReduceFromGroup(rows, tp_);
  }
  int32_t Block(int64_t layer) const { return static_cast<int32_t>(layer + 1); }
  int32_t Head() const { return static_cast<int32_t>(c_.n_layer + 1); }
  std::string BlockName(int64_t layer) const { return "blocks." + std::to_string(layer); }

  // Units: embedding, blocks, head; each unit reads its own parameters plus `extra_head_reads`.
  void DeclareUnits(const char* embedding_name, const char* head_name,
                    std::vector<uint32_t> extra_head_reads) {
    units.push_back({embedding_name, CAI_UNIT_EMBEDDING, {}});
    for (int64_t l = 0; l < c_.n_layer; ++l) units.push_back({BlockName(l), CAI_UNIT_BLOCK, {}});
    units.push_back({head_name, CAI_UNIT_HEAD, {}});
    for (uint32_t i = 0; i < params.size(); ++i) units[params[i].unit].reads.push_back(i);
    for (uint32_t i : extra_head_reads) units.back().reads.push_back(i);
  }

  std::string DescribeSizes(const char* arch) const {
    std::ostringstream s;
    s << arch << " vocab_size=" << c_.vocab_size << " n_ctx=" << c_.n_ctx
      << " n_layer=" << c_.n_layer << " n_head=" << c_.n_head << " n_kv_head=" << n_kv_head_
      << " n_embd=" << c_.n_embd << " ffn_hidden=" << ffn_ << " bias=" << c_.bias;
    return s.str();
  }

  ModelConfig c_;
  int64_t n_kv_head_ = 0;
  int64_t ffn_ = 0;
  // This rank's attention and key/value heads (all of them without tensor parallelism).
  int64_t heads_ = 0, kv_heads_ = 0;
  TensorParallelGroup tp_;
  int64_t padded_vocab_ = 0;
  bool gather_output_ = false;
  bool sequence_parallel_ = false;
  bool ring_ = false;       // sequence_parallel_'s gathers and reduce-scatters as overlapped rings
  TensorParallelGroup sp_;  // sequence parallelism's group (size 1: none)
  int32_t sp_mode_ = 0;     // cai_sequence_parallel_mode
};

// GPT-2 (Radford et al. 2019) as nanoGPT writes it: learned positions, pre-LayerNorm blocks,
// fused qkv, tanh-GELU MLP, final LayerNorm, output projection tied to the token embedding.
class Gpt2 final : public ZooNetwork {
 public:
  Gpt2(const ModelConfig& c, uint64_t seed) : ZooNetwork(c) {
    n_kv_head_ = heads_ = kv_heads_ = c.n_head;
    ffn_ = c.ffn_hidden == 0 ? 4 * c.n_embd : c.ffn_hidden;
    const int64_t e = c.n_embd;
    // GPT-2 paper, section 2.3: residual projections scaled by 1/sqrt(N), N = 2 * n_layer.
    const double std = c.init_std, residual_std = c.init_std / std::sqrt(2.0 * double(c.n_layer));
    Builder b(*this, seed, c.lazy_init);
    auto bias = [&](const std::string& m, int64_t n, int32_t u, cai_param_role r, int32_t pd) {
      return c.bias ? b.Fill(m, "bias", n, 0.0, u, r, pd) : kNone;
    };
    wte_ = b.Normal("wte", {c.vocab_size, e}, std, 0, CAI_ROLE_EMBEDDING, 0);
    wpe_ = b.Normal("wpe", {c.n_ctx, e}, std, 0, CAI_ROLE_POS_EMBEDDING, -1);
    for (int64_t l = 0; l < c.n_layer; ++l) {
      const std::string p = BlockName(l);
      const int32_t u = Block(l);
      Layer y;
      y.ln1_w = b.Fill(p + ".ln_1", "weight", e, 1.0, u, CAI_ROLE_NORM, -1);
      y.ln1_b = bias(p + ".ln_1", e, u, CAI_ROLE_NORM, -1);
      y.qkv_w = b.Normal(p + ".attn.qkv", {3 * e, e}, std, u, CAI_ROLE_ATTN_QKV, 0);
      y.qkv_b = bias(p + ".attn.qkv", 3 * e, u, CAI_ROLE_ATTN_QKV, 0);
      y.proj_w = b.Normal(p + ".attn.proj", {e, e}, residual_std, u, CAI_ROLE_ATTN_OUT, 1);
      y.proj_b = bias(p + ".attn.proj", e, u, CAI_ROLE_ATTN_OUT, -1);
      y.ln2_w = b.Fill(p + ".ln_2", "weight", e, 1.0, u, CAI_ROLE_NORM, -1);
      y.ln2_b = bias(p + ".ln_2", e, u, CAI_ROLE_NORM, -1);
      y.fc_w = b.Normal(p + ".mlp.fc", {ffn_, e}, std, u, CAI_ROLE_MLP_UP, 0);
      y.fc_b = bias(p + ".mlp.fc", ffn_, u, CAI_ROLE_MLP_UP, 0);
      y.down_w = b.Normal(p + ".mlp.proj", {e, ffn_}, residual_std, u, CAI_ROLE_MLP_DOWN, 1);
      y.down_b = bias(p + ".mlp.proj", e, u, CAI_ROLE_MLP_DOWN, -1);
      layers_.push_back(y);
    }
    lnf_w_ = b.Fill("ln_f", "weight", e, 1.0, Head(), CAI_ROLE_NORM, -1);
    lnf_b_ = bias("ln_f", e, Head(), CAI_ROLE_NORM, -1);
    DeclareUnits("embedding", "head", {wte_});
  }

  torch::Tensor Forward(size_t unit, const torch::Tensor& x) const override {
    if (unit == 0) {
      const torch::Tensor tokens = SequenceShard(x, 1);
      const int64_t t = tokens.size(1);
      torch::Tensor positions = SequenceShard(W(wpe_).slice(0, 0, x.size(1)), 0);
      if (sequence_parallel_) {  // this rank's rows [rank·t/size, (rank + 1)·t/size)
        const int64_t part = t / tp_.size;
        positions =
            tp::CopyToGroup(positions, tp_).slice(0, tp_.rank * part, (tp_.rank + 1) * part);
      }
      return Embed(wte_, tokens) + positions;
    }
    if (unit == size_t(Head())) return Column(LayerNorm(x, lnf_w_, lnf_b_), {{wte_, kNone}})[0];
    const Layer& y = layers_[unit - 1];
    torch::Tensor qkv = Column(LayerNorm(x, y.ln1_w, y.ln1_b), {{y.qkv_w, y.qkv_b}})[0];
    std::vector<torch::Tensor> parts = qkv.chunk(3, -1);
    torch::Tensor att = Attend(SplitHeads(parts[0], heads_), SplitHeads(parts[1], heads_),
                               SplitHeads(parts[2], heads_));
    torch::Tensor h = x + RowLinear(att, y.proj_w, y.proj_b);
    const torch::Tensor m = LayerNorm(h, y.ln2_w, y.ln2_b);
    const torch::Tensor up =
        Has(CAI_MODEL_KERNEL_FUSED_ACTIVATION)
            ? kernels::FusedBiasGelu(Column(m, {{y.fc_w, kNone}})[0], Wb(y.fc_b))
            : torch::gelu(Column(m, {{y.fc_w, y.fc_b}})[0], "tanh");
    return h + RowLinear(up, y.down_w, y.down_b);
  }

  std::string Describe() const override { return DescribeSizes("gpt2") + " tied=wte"; }

 private:
  struct Layer {
    uint32_t ln1_w, ln1_b, qkv_w, qkv_b, proj_w, proj_b, ln2_w, ln2_b, fc_w, fc_b, down_w, down_b;
  };
  torch::Tensor LayerNorm(const torch::Tensor& x, uint32_t w, uint32_t b) const {
    return torch::layer_norm(x, {c_.n_embd}, Shard(w), Shard(b), c_.norm_eps);
  }

  uint32_t wte_, wpe_, lnf_w_, lnf_b_;
  std::vector<Layer> layers_;
};

// Llama (Touvron et al. 2023): RMSNorm, rotary position embedding, SwiGLU MLP, grouped-query
// attention with n_kv_head key/value heads, untied output projection.
class Llama final : public ZooNetwork {
 public:
  Llama(const ModelConfig& c, uint64_t seed) : ZooNetwork(c) {
    n_kv_head_ = kv_heads_ = c.n_kv_head == 0 ? c.n_head : c.n_kv_head;
    heads_ = c.n_head;
    // Meta's reference: hidden = 2/3 * 4 * n_embd, rounded up to a multiple of 256.
    ffn_ = c.ffn_hidden != 0 ? c.ffn_hidden : 256 * ((8 * c.n_embd / 3 + 255) / 256);
    const int64_t e = c.n_embd, d = e / c.n_head;
    const double std = c.init_std, residual_std = c.init_std / std::sqrt(2.0 * double(c.n_layer));
    Builder b(*this, seed, c.lazy_init);
    auto bias = [&](const std::string& m, int64_t n, int32_t u, cai_param_role r, int32_t pd) {
      return c.bias ? b.Fill(m, "bias", n, 0.0, u, r, pd) : kNone;
    };
    embed_ = b.Normal("embed_tokens", {c.vocab_size, e}, std, 0, CAI_ROLE_EMBEDDING, 0);
    for (int64_t l = 0; l < c.n_layer; ++l) {
      const std::string p = BlockName(l);
      const int32_t u = Block(l);
      Layer y;
      y.attn_norm = b.Fill(p + ".attn_norm", "weight", e, 1.0, u, CAI_ROLE_NORM, -1);
      y.q_w = b.Normal(p + ".attn.q", {e, e}, std, u, CAI_ROLE_ATTN_Q, 0);
      y.q_b = bias(p + ".attn.q", e, u, CAI_ROLE_ATTN_Q, 0);
      y.k_w = b.Normal(p + ".attn.k", {n_kv_head_ * d, e}, std, u, CAI_ROLE_ATTN_K, 0);
      y.k_b = bias(p + ".attn.k", n_kv_head_ * d, u, CAI_ROLE_ATTN_K, 0);
      y.v_w = b.Normal(p + ".attn.v", {n_kv_head_ * d, e}, std, u, CAI_ROLE_ATTN_V, 0);
      y.v_b = bias(p + ".attn.v", n_kv_head_ * d, u, CAI_ROLE_ATTN_V, 0);
      y.o_w = b.Normal(p + ".attn.o", {e, e}, residual_std, u, CAI_ROLE_ATTN_OUT, 1);
      y.o_b = bias(p + ".attn.o", e, u, CAI_ROLE_ATTN_OUT, -1);
      y.mlp_norm = b.Fill(p + ".mlp_norm", "weight", e, 1.0, u, CAI_ROLE_NORM, -1);
      y.gate_w = b.Normal(p + ".mlp.gate", {ffn_, e}, std, u, CAI_ROLE_MLP_GATE, 0);
      y.gate_b = bias(p + ".mlp.gate", ffn_, u, CAI_ROLE_MLP_GATE, 0);
      y.up_w = b.Normal(p + ".mlp.up", {ffn_, e}, std, u, CAI_ROLE_MLP_UP, 0);
      y.up_b = bias(p + ".mlp.up", ffn_, u, CAI_ROLE_MLP_UP, 0);
      y.down_w = b.Normal(p + ".mlp.down", {e, ffn_}, residual_std, u, CAI_ROLE_MLP_DOWN, 1);
      y.down_b = bias(p + ".mlp.down", e, u, CAI_ROLE_MLP_DOWN, -1);
      layers_.push_back(y);
    }
    norm_ = b.Fill("norm", "weight", e, 1.0, Head(), CAI_ROLE_NORM, -1);
    lm_head_ = b.Normal("lm_head", {c.vocab_size, e}, std, Head(), CAI_ROLE_LM_HEAD, 0);
    DeclareUnits("embedding", "head", {});

    // RoFormer (Su et al. 2021) frequencies theta^(-2i/d), rotate-half layout as in HF Llama.
    torch::Tensor inv_freq =
        torch::pow(c.rope_theta, -torch::arange(0, d, 2, torch::kDouble) / double(d));
    torch::Tensor angles = torch::outer(torch::arange(c.n_ctx, torch::kDouble), inv_freq);
    angles = torch::cat({angles, angles}, -1);
    cos_ = angles.cos().to(torch::kFloat);
    sin_ = angles.sin().to(torch::kFloat);
  }

  torch::Tensor Forward(size_t unit, const torch::Tensor& x) const override {
    if (unit == 0) return Embed(embed_, SequenceShard(x, 1));
    if (unit == size_t(Head())) return Column(RmsNorm(x, norm_), {{lm_head_, kNone}})[0];
    const Layer& y = layers_[unit - 1];
    const std::vector<torch::Tensor> qkv =
        Column(RmsNorm(x, y.attn_norm), {{y.q_w, y.q_b}, {y.k_w, y.k_b}, {y.v_w, y.v_b}});
    // The whole sequence under split_gather (the projections gathered it), this rank's shard
    // of it under Ulysses and ring attention, rotated at its positions.
    const int64_t whole = qkv[0].size(1) * sp_.size;
    torch::Tensor cos = SequenceShard(cos_.slice(0, 0, whole), 0).to(x.device(), x.scalar_type());
    torch::Tensor sin = SequenceShard(sin_.slice(0, 0, whole), 0).to(x.device(), x.scalar_type());
    torch::Tensor h = x + RowLinear(Attend(Rotate(SplitHeads(qkv[0], heads_), cos, sin),
                                           Rotate(SplitHeads(qkv[1], kv_heads_), cos, sin),
                                           SplitHeads(qkv[2], kv_heads_)),
                                    y.o_w, y.o_b);
    const std::vector<torch::Tensor> gate_up =
        Column(RmsNorm(h, y.mlp_norm), {{y.gate_w, y.gate_b}, {y.up_w, y.up_b}});
    const torch::Tensor &gate = gate_up[0], &up = gate_up[1];
    const torch::Tensor swiglu = Has(CAI_MODEL_KERNEL_FUSED_ACTIVATION)
                                     ? kernels::FusedSwiGlu(gate, up)
                                     : torch::silu(gate) * up;
    return h + RowLinear(swiglu, y.down_w, y.down_b);
  }

  std::string Describe() const override { return DescribeSizes("llama"); }

 private:
  struct Layer {
    uint32_t attn_norm, q_w, q_b, k_w, k_b, v_w, v_b, o_w, o_b, mlp_norm, gate_w, gate_b, up_w,
        up_b, down_w, down_b;
  };
  // Zhang & Sennrich 2019; statistics in fp32 whatever the compute dtype.
  torch::Tensor RmsNorm(const torch::Tensor& x, uint32_t w) const {
    if (Has(CAI_MODEL_KERNEL_FUSED_NORMALIZATION)) {
      return kernels::FusedRmsNorm(x, Shard(w), c_.norm_eps);
    }
    torch::Tensor xf = x.to(torch::kFloat);
    torch::Tensor normed = xf * torch::rsqrt(xf.pow(2).mean(-1, true) + c_.norm_eps);
    return normed.to(x.scalar_type()) * Shard(w);
  }
  static torch::Tensor Rotate(const torch::Tensor& x, const torch::Tensor& cos,
                              const torch::Tensor& sin) {
    std::vector<torch::Tensor> halves = x.chunk(2, -1);
    return x * cos + torch::cat({-halves[1], halves[0]}, -1) * sin;
  }

  uint32_t embed_, norm_, lm_head_;
  std::vector<Layer> layers_;
  // Non-persistent (never exposed as buffers): a function of the config alone.
  torch::Tensor cos_, sin_;
};

}  // namespace

std::unique_ptr<Network> MakeZooNetwork(const ModelConfig& config, uint64_t seed) {
  Validate(config);
  if (config.arch == ModelConfig::Arch::kGpt2) return std::make_unique<Gpt2>(config, seed);
  return std::make_unique<Llama>(config, seed);
}

std::unique_ptr<Model> MakeZooModel(const ModelConfig& config, uint64_t seed,
                                    const ParamOptions& options) {
  return MakeModel(MakeZooNetwork(config, seed), options);
}

}  // namespace cai
