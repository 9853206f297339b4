// libcai_hybrid_parallel: tensor and pipeline parallelism with data parallelism across the
// replicas, as ColossalAI's HybridParallelPlugin; sequence parallelism in its split_gather mode
// (Megatron-LM's, over the tensor-parallel group), its all_to_all mode (DeepSpeed-Ulysses, over
// a group of sp_size ranks of its own), its ring_attn mode (ring attention over the same
// group, zigzag split) and its ring mode (split_gather with the gathers and reduce-scatters as
// rings overlapping the projections' matmuls).
//
// Mesh. The world is dp_size × pp_size × sp_size × tp_size ranks, tensor parallelism innermost
// (ColossalAI's dp-outside order): world rank = ((dp_rank · pp_size + pp_rank) · sp_size +
// sp_rank) · tp_size + tp_rank. A tensor-parallel group is tp_size consecutive ranks; a
// sequence-parallel group holds one rank of each of sp_size neighbouring tensor-parallel
// groups; a pipeline holds one rank of each stage's group; a data-parallel group holds the
// ranks of one (stage, tp rank) position across the replicas and, under all_to_all and
// ring_attn, across the sequence-parallel ranks too: both leave each rank a partial gradient
// whose sum over its sequence-parallel group is the gradient, so gradients are reduced (and
// ZeRO shards) over dp × sp, as ColossalAI does. The host hands every rank of a replica the same
// micro-batches; the model takes each sequence-parallel rank's shard of the positions.
//
// Tensor parallelism is the host's (apply_tensor_parallel, at boost, before anything else):
// each rank keeps its slices of the split parameters and the model all-reduces inside forward
// and backward, so the rest of this plugin sees a smaller model. Parameters whole on every rank
// of a group get the same gradient on each: only tp rank 0 counts them in the gradient norm.
// Checkpoints gather the slices into whole tensors (sdk::TensorParallelIo).
//
// Shardformer's optimisations are the host's kernels too (enable_kernels): the enable_* keys
// turn them on whatever the model.* keys say, and num_ckpt_layers_per_stage /
// gradient_checkpointing_ratio pick the blocks of each of this rank's stages that recompute
// (set_unit_checkpointing).
//
// Stages. The model's transformer blocks are spread over S = pp_size · num_model_chunks
// virtual stages (ColossalAI's distribute_layers: an even split, the remainder given to the
// middle stages; or num_layers_per_stage); the units before the first block (the embedding) join
// virtual stage 0, those after the last (final norm, head) the last one. Virtual stage v runs on
// pipeline rank v mod pp_size, so with num_model_chunks = c each rank holds c chunks of the
// model (the interleaved schedule); under zbv, rank r holds stages r and 2·pp_size − 1 − r (a V:
// stage 0 and the last share rank 0, and stage pp_size − 1 hands its output to stage pp_size on
// the same rank, without a send). A rank keeps only the parameters its chunks hold or read
// (GPT-2's head reads the token embedding held by stage 0): after boost the others are released.
//
// A parameter several pipeline ranks need (the tied embedding) is held by each of them and
// kept identical: broadcast from the holder at boost, its gradients summed over those ranks
// after backward (ColossalAI's sync_shared_params), then updated identically everywhere. Only
// its holder counts it in the gradient norm and writes it to checkpoints.
//
// One step (execute_pipeline, pp_size > 1), per rank, for the m micro-batches of its replica:
//  schedule  1f1b: min(p - r - 1, m) warm-up forwards, then one forward one backward, then the
//            remaining backwards (Narayanan et al., PipeDream-Flush); interleaved: Megatron-LM's
//            schedule over its chunks (Narayanan et al., SC'21), m a multiple of pp_size; zbv:
//            the zero-bubble V schedule (ZeroBubbleVSchedule), each backward split into the
//            input-gradient pass and a weight-gradient pass that runs where 1F1B would wait.
//  forward   stage 0 takes the tokens; every other virtual stage receives its input activation
//            from the previous one (send/recv on the pipeline group, in fp32, bf16 under bf16);
//            the last computes the loss, weighted by the micro-batch's share of the global batch.
//  backward  the last stage starts from loss · weight · loss_scale; every other receives the
//            gradient of its output and sends its input's gradient back.
//  step      tied gradients summed; gradients reduced over the data-parallel group (zero_stage
//            0: DDP buckets; 1: ZeRO-1's reduce-scatter) and the step's agreement (Σ g², fp16
//            overflow, used parameters) settled over the whole world; update; (ZeRO: all-gather).
// Activation memory: under 1F1B a rank holds at most p - r micro-batches' activations at once,
// not m (interleaved: about (p - r - 1)·2 + (c - 1)·p + 1 chunk activations; zbv: at most 2·p
// chunk activations, half a stage each, counted until their weight pass).
//
// pp_size = 1 is pure data parallelism: forward_backward per micro-batch with the DDP reducer's
// overlap and no_sync (or ZeRO-1/2 over the world).
//
// Checkpoints use the canonical layout ("model/<name>", "optim/<name>/<slot>", docs/
// checkpoint-layout.md): each stage's data-parallel rank 0 writes the parameters its stage
// holds (a tied one by its holder only), so any pp × dp, and every data-parallel strategy, loads
// them.
#include <algorithm>
#include <array>
#include <cai/sdk.hpp>
#include <cai/sdk/bucket_reducer.hpp>
#include <cai/sdk/collectives.hpp>
#include <cai/sdk/flat.hpp>
#include <cai/sdk/sharding.hpp>
#include <cai/sdk/step.hpp>
#include <cai/sdk/tensor_parallel.hpp>
#include <cai/sdk/zero.hpp>
#include <chrono>
#include <cmath>
#include <deque>
#include <map>
#include <numeric>
#include <optional>
#include <set>
#include <sstream>
#include <string>
#include <tuple>
#include <vector>

namespace {

namespace sdk = cai::sdk;
using sdk::Buffer;
using sdk::Check;
using sdk::Error;
using sdk::Host;
using Clock = std::chrono::steady_clock;

constexpr cai_dtype kBF16{CAI_DTYPE_BFLOAT, 16, 1};
const char* const kPipelineStyles[] = {"1f1b", "interleaved", "zbv", nullptr};
const char* const kSequenceModes[] = {"split_gather", "ring", "all_to_all", "ring_attn", nullptr};

// One operation of a rank's schedule: the forward or backward of micro-batch `mb` through its
// model chunk `chunk`, or (`weights`, zbv) the weight-gradient pass of a split backward.
struct Op {
  bool forward;
  int32_t mb;
  int32_t chunk;
  bool weights = false;
};

// A rank's order of operations (see the header comment).
std::vector<Op> PipelineSchedule(int32_t pp, int32_t rank, int32_t m, int32_t chunks) {
  std::vector<Op> ops;
  if (chunks == 1) {
    const int32_t warmup = std::min(pp - rank - 1, m);
    for (int32_t i = 0; i < warmup; ++i) ops.push_back({true, i, 0});
    for (int32_t i = 0; i < m - warmup; ++i) {
      ops.push_back({true, warmup + i, 0});
      ops.push_back({false, i, 0});
    }
    for (int32_t i = m - warmup; i < m; ++i) ops.push_back({false, i, 0});
    return ops;
  }
  // Megatron-LM's interleaved order: the k-th forward (backward) of a rank runs micro-batch
  // (k / (p·c))·p + k mod p through chunk (k / p) mod c (backward: c - 1 - that).
  const int32_t total = m * chunks;
  auto mb = [&](int32_t k) { return (k / (pp * chunks)) * pp + k % pp; };
  auto chunk = [&](int32_t k, bool forward) {
    const int32_t c = (k / pp) % chunks;
    return forward ? c : chunks - 1 - c;
  };
  const int32_t warmup = m == pp ? total : std::min(total, (pp - rank - 1) * 2 + (chunks - 1) * pp);
  for (int32_t k = 0; k < warmup; ++k) ops.push_back({true, mb(k), chunk(k, true)});
  for (int32_t i = 0; i < total - warmup; ++i) {
    ops.push_back({true, mb(warmup + i), chunk(warmup + i, true)});
    ops.push_back({false, mb(i), chunk(i, false)});
  }
  for (int32_t k = total - warmup; k < total; ++k) ops.push_back({false, mb(k), chunk(k, false)});
  return ops;
}

// The virtual stage of chunk `chunk` (0 or 1) of pipeline rank `rank` in zbv's V.
int32_t ZbvStage(int32_t pp, int32_t rank, int32_t chunk) {
  return chunk == 0 ? rank : 2 * pp - 1 - rank;
}

// ZB-V (Qi et al. 2024, "Pipeline Parallelism with Controllable Memory"; ColossalAI's zbv):
// 2·pp virtual stages in a V, rank r holding stages r (chunk 0) and 2·pp − 1 − r (chunk 1), every
// backward split into B (the input's gradient, which the previous stage waits for) and W (the
// weight gradients, which nothing waits for). The order comes from simulating every rank with
// equal times for F, B and W: at each tick an idle rank runs a ready B (earliest micro-batch
// first), else a ready F while it holds fewer than 2·pp chunk activations (1F1B's peak: pp
// micro-batches through a whole stage), its second chunk first, else its oldest W. W fills what
// would be bubbles. An order the simulation produced respects every dependency, and the executor
// posts receives ahead and never blocks on a send, so it runs as simulated. `ticks` receives the
// simulated step's length, against 6·m ticks of work per rank.
std::vector<Op> ZeroBubbleVSchedule(int32_t pp, int32_t rank, int32_t m, int64_t* ticks) {
  const int32_t stages = 2 * pp, limit = 2 * pp;
  constexpr int64_t kNotYet = -1;
  // Tick at which F / B of (micro-batch, virtual stage) ran.
  std::vector<int64_t> f_done(size_t(m) * stages, kNotYet), b_done(f_done);
  auto at = [&](int32_t mb, int32_t v) { return size_t(mb) * stages + v; };
  struct RankState {
    std::array<int32_t, 2> next_f{0, 0}, next_b{0, 0};
    std::deque<std::pair<int32_t, int32_t>> w;  // (mb, chunk) awaiting W
    int32_t held = 0;                           // chunk activations held (F done, W not)
    std::vector<Op> ops;
  };
  std::vector<RankState> ranks(pp);
  const size_t total = size_t(3) * 2 * m * pp;
  size_t done = 0;
  int64_t tick = 0;
  for (; done < total; ++tick) {
    auto ran_before = [&](const std::vector<int64_t>& when, int32_t mb, int32_t v) {
      return when[at(mb, v)] != kNotYet && when[at(mb, v)] < tick;
    };
    std::vector<std::pair<int32_t, Op>> started;
    for (int32_t r = 0; r < pp; ++r) {
      RankState& st = ranks[r];
      std::optional<Op> op;
      for (int32_t c = 0; c < 2; ++c) {  // B: the earliest micro-batch, then chunk 0
        const int32_t mb = st.next_b[c], v = ZbvStage(pp, r, c);
        if (mb < m && ran_before(f_done, mb, v) &&
            (v == stages - 1 || ran_before(b_done, mb, v + 1)) && (!op || mb < op->mb)) {
          op = Op{false, mb, c};
        }
      }
      for (int32_t c = 1; !op && st.held < limit && c >= 0; --c) {  // F: chunk 1 first
        const int32_t mb = st.next_f[c], v = ZbvStage(pp, r, c);
        if (mb < m && (v == 0 || ran_before(f_done, mb, v - 1))) op = Op{true, mb, c};
      }
      if (!op && !st.w.empty()) op = Op{false, st.w.front().first, st.w.front().second, true};
      if (op) started.emplace_back(r, *op);
    }
    if (started.empty()) {
      throw Error(CAI_INTERNAL, "hybrid_parallel: the zbv schedule stalled at pp_size " +
                                    std::to_string(pp) + ", " + std::to_string(m) +
                                    " micro-batches");
    }
    for (const auto& [r, op] : started) {
      RankState& st = ranks[r];
      const int32_t v = ZbvStage(pp, r, op.chunk);
      if (op.weights) {
        st.w.pop_front();
        --st.held;
      } else if (op.forward) {
        f_done[at(op.mb, v)] = tick;
        ++st.next_f[op.chunk];
        ++st.held;
      } else {
        b_done[at(op.mb, v)] = tick;
        ++st.next_b[op.chunk];
        st.w.emplace_back(op.mb, op.chunk);
      }
      st.ops.push_back(op);
      ++done;
    }
  }
  *ticks = tick;
  return ranks[rank].ops;
}

// ColossalAI's distribute_layers: `layers` blocks over `stages` virtual stages, evenly, the
// remainder to the middle stages.
std::vector<int32_t> DistributeLayers(int32_t layers, int32_t stages) {
  std::vector<int32_t> per(stages, layers / stages);
  const int32_t remainder = layers % stages;
  const int32_t start = stages / 2 - remainder / 2;
  for (int32_t i = start; i < start + remainder; ++i) ++per[i];
  return per;
}

class HybridParallel {
 public:
  static constexpr const char* kName = "hybrid_parallel";
  static constexpr const char* kVersion = "0.1.0";
  static constexpr uint64_t kCapabilities = CAI_CAP_PRECISION_FP32 | CAI_CAP_PRECISION_BF16 |
                                            CAI_CAP_PRECISION_FP16 | CAI_CAP_NO_SYNC |
                                            CAI_CAP_PIPELINE | CAI_CAP_TENSOR_PARALLEL;

  // HybridParallelPlugin's keys with its defaults where they exist.
  static std::span<const cai_config_key> ConfigKeys() {
    using sdk::BoolKey;
    using sdk::FloatKey;
    using sdk::IntKey;
    using sdk::StringKey;
    constexpr uint64_t kMin = CAI_CONFIG_HAS_MIN;
    static constexpr auto kKeys = sdk::JoinKeys(
        std::array{
            IntKey("tp_size", "1",
                   "Tensor-parallel degree (Megatron-LM's column/row-parallel layers, the "
                   "vocabulary split over the group); must divide the heads, key/value heads and "
                   "MLP width. A TorchScript model splits as its model.tp_policy file says.",
                   1, 0, kMin),
            BoolKey("parallel_output", "true",
                    "tp_size > 1, zoo models: keep the logits split over the vocabulary and "
                    "compute a distributed cross-entropy; false all-gathers them before the loss "
                    "(a TorchScript policy's gather_output decides for its model)."),
            IntKey("make_vocab_size_divisible_by", "64",
                   "tp_size > 1: pad the vocabulary to a multiple of this times tp_size (padding "
                   "rows are zeros that never train and are not saved).",
                   1, 0, kMin),
            BoolKey("enable_all_optimization", "false",
                    "All of enable_fused_normalization, enable_flash_attention and "
                    "enable_jit_fused (ColossalAI's Shardformer optimisations)."),
            BoolKey("enable_fused_normalization", "false",
                    "Llama's RMSNorm in one pass keeping only its input and 1/rms (GPT-2's "
                    "LayerNorm is ATen's fused kernel already); as model.fused_normalization."),
            BoolKey("enable_flash_attention", "false",
                    "Memory-efficient attention: causal attention tiled with an online softmax, "
                    "O(T·d) memory instead of the T×T scores (the host's kernel: no "
                    "FlashAttention exists on the CPU); as model.memory_efficient_attention."),
            BoolKey("enable_jit_fused", "false",
                    "bias + GELU (GPT-2) and SwiGLU (Llama) in one pass each way; as "
                    "model.fused_activation."),
            StringKey("num_ckpt_layers_per_stage", "\"\"",
                      "Activation checkpointing (ColossalAI's gradient_checkpoint_config): the "
                      "first N transformer blocks of each virtual stage recompute their forward "
                      "in backward; one number for every stage or one per stage, "
                      "comma-separated. Empty: gradient_checkpointing_ratio decides."),
            FloatKey("gradient_checkpointing_ratio", "0.0",
                     "The share of each virtual stage's blocks that recompute (rounded to the "
                     "nearest block), when num_ckpt_layers_per_stage is empty; 0 leaves "
                     "model.activation_checkpointing in charge.",
                     0, 1, kMin | CAI_CONFIG_HAS_MAX),
            IntKey("sp_size", "1",
                   "all_to_all and ring_attn: the ranks of the sequence-parallel group, each "
                   "holding 1/sp_size of every sequence (the world is dp x pp x sp x tp). "
                   "all_to_all: must divide the heads and key/value heads per tensor-parallel "
                   "rank, and train.seq_len; ring_attn: 2 x sp_size must divide train.seq_len. "
                   "1 for split_gather, which runs over the tensor-parallel group.",
                   1, 0, kMin),
            BoolKey("enable_sequence_parallelism", "false",
                    "Split every sequence over ranks as sequence_parallelism_mode says."),
            StringKey("sequence_parallelism_mode", "\"split_gather\"",
                      "split_gather (tp_size > 1): Megatron-LM's sequence parallelism, norms, "
                      "residuals and position embeddings on 1/tp_size of the sequence, all-gather "
                      "before the column-parallel layers, reduce-scatter after the row-parallel "
                      "ones (1.25x tensor parallelism's bytes on the wire); train.seq_len must "
                      "divide by tp_size. all_to_all (sp_size > 1): DeepSpeed-Ulysses, every "
                      "layer on 1/sp_size of the sequence, attention on all of it for 1/sp_size "
                      "of the heads through two all-to-alls; gradients reduced over dp x sp. "
                      "ring_attn (sp_size > 1): ring attention, the sequence cut into 2 x sp_size "
                      "chunks, rank r holding chunks r and 2 x sp_size - 1 - r (zigzag, an equal "
                      "share of the causal work), keys and values passed around the "
                      "sequence-parallel group during attention; gradients reduced over dp x sp. "
                      "ring (tp_size > 1): split_gather with each all-gather and reduce-scatter "
                      "around the projections run as a ring of send/recv steps, each overlapping "
                      "the matmul of a chunk already here (the same results and bytes).",
                      kSequenceModes),
            IntKey("pp_size", "1",
                   "Pipeline stages; the world must be a multiple of it (the rest is data "
                   "parallelism).",
                   1, 0, kMin),
            StringKey("pp_style", "\"1f1b\"",
                      "1f1b: one forward one backward (PipeDream-Flush); interleaved: "
                      "num_model_chunks chunks per rank (Megatron-LM), fewer bubbles; zbv: "
                      "zero-bubble V (num_model_chunks = 2, rank r holding virtual stages r and "
                      "2 x pp_size - 1 - r, backward split into input- and weight-gradient "
                      "passes, the weight passes run where 1F1B waits; 1F1B's activation peak).",
                      kPipelineStyles),
            IntKey("num_model_chunks", "1",
                   "Model chunks per pipeline rank; > 1 needs pp_style = \"interleaved\" or "
                   "\"zbv\" (which takes 2).",
                   1, 0, kMin),
            IntKey("num_microbatches", "0",
                   "Micro-batches per step; 0 = train.grad_accum, which it must equal otherwise.",
                   0, 0, kMin),
            IntKey("microbatch_size", "0",
                   "Rows per micro-batch; 0 = what train.global_batch, the data-parallel size "
                   "and train.grad_accum give, which it must equal otherwise.",
                   0, 0, kMin),
            StringKey("num_layers_per_stage", "\"\"",
                      "Transformer blocks per virtual stage, comma-separated (\"3,3,2\"); empty: "
                      "an even split, the remainder to the middle stages."),
            IntKey("zero_stage", "0",
                   "0: gradients all-reduced (DDP buckets); 1: ZeRO-1 over the data-parallel "
                   "group; 2: ZeRO-2, only without pipelining (pp_size = 1).",
                   0, 2, kMin | CAI_CONFIG_HAS_MAX),
            BoolKey("overlap_p2p", "true",
                    "Post the next operation's receive before running the current one, so "
                    "activations arrive behind compute."),
            FloatKey("max_norm", "0.0",
                     "Clip gradients to this global L2 norm across every stage and rank (0 = "
                     "optimizer.max_grad_norm).",
                     0, 0, kMin),
            FloatKey("ddp_bucket_cap_mb", "25", "zero_stage 0: gradient bucket size in MiB.", 0, 0,
                     kMin),
            BoolKey("find_unused_parameters", "false",
                    "zero_stage 0: allow parameters without a gradient in a step."),
            BoolKey("gradient_as_bucket_view", "false",
                    "zero_stage 0: make each .grad a view into its bucket."),
            BoolKey("static_graph", "false",
                    "zero_stage 0: the used parameters never change (learned in the first step)."),
            FloatKey("zero_bucket_size_in_m", "12",
                     "zero_stage 1/2: bucket size in millions (2^20) of elements.", 0, 0, kMin),
            BoolKey("overlap_communication", "true",
                    "zero_stage 1/2: reduce-scatter during backward where the schedule allows."),
            BoolKey("overlap_allgather", "false",
                    "zero_stage 1/2: all-gather the updated parameters asynchronously."),
            BoolKey("cpu_offload", "false",
                    "zero_stage 1/2: fp32 masters and optimizer state on the host tier."),
        },
        sdk::LossScalerKeys("65536.0", "fp16: initial loss scale (2^16, ColossalAI's)."));
    return kKeys;
  }

  explicit HybridParallel(const cai_create_args& args)
      : world_rank_(args.rank), world_(args.world_size) {
    sdk::Config config(args.config);
    tp_ = static_cast<int32_t>(config.Int("tp_size"));
    const bool enabled = config.Bool("enable_sequence_parallelism");
    const std::string& mode = config.String("sequence_parallelism_mode");
    sequence_parallel_ = enabled && (mode == "split_gather" || mode == "ring");
    ring_ = enabled && mode == "ring";
    if (enabled && mode == "all_to_all") sp_mode_ = CAI_SEQUENCE_PARALLEL_ALL_TO_ALL;
    if (enabled && mode == "ring_attn") sp_mode_ = CAI_SEQUENCE_PARALLEL_RING_ATTN;
    if (sequence_parallel_ && tp_ < 2) {
      throw Error(CAI_INVALID_ARGUMENT,
                  "hybrid_parallel: enable_sequence_parallelism with sequence_parallelism_mode "
                  "= \"" +
                      mode +
                      "\" splits the sequence over the tensor-parallel group: set tp_size > 1");
    }
    sp_ = static_cast<int32_t>(config.Int("sp_size"));
    if (sp_mode_ != 0 && sp_ < 2) {
      throw Error(CAI_INVALID_ARGUMENT,
                  "hybrid_parallel: sequence_parallelism_mode = \"" + mode +
                      "\" splits the sequence over a group of sp_size ranks: set sp_size > 1");
    }
    if (sp_mode_ == 0 && sp_ != 1) {
      throw Error(CAI_INVALID_ARGUMENT,
                  "hybrid_parallel: sp_size = " + std::to_string(sp_) +
                      " sizes the group of sequence_parallelism_mode = \"all_to_all\" or "
                      "\"ring_attn\" with enable_sequence_parallelism = true" +
                      (enabled ? " (split_gather runs over the tensor-parallel group: leave "
                                 "sp_size at 1)"
                               : "") +
                      "; set those, or sp_size = 1");
    }
    pp_ = static_cast<int32_t>(config.Int("pp_size"));
    if (world_ % (pp_ * sp_ * tp_) != 0) {
      throw Error(CAI_INVALID_ARGUMENT,
                  "hybrid_parallel: pp_size x sp_size x tp_size = " + std::to_string(pp_) + " x " +
                      std::to_string(sp_) + " x " + std::to_string(tp_) +
                      " does not divide the world of " + std::to_string(world_) +
                      " ranks; use divisors of it (the rest of the world is data parallelism)");
    }
    dp_ = world_ / (pp_ * sp_ * tp_);
    tp_rank_ = world_rank_ % tp_;
    sp_rank_ = (world_rank_ / tp_) % sp_;
    pp_rank_ = (world_rank_ / (tp_ * sp_)) % pp_;
    dp_rank_ = world_rank_ / (tp_ * sp_ * pp_);
    parallel_output_ = config.Bool("parallel_output");
    const bool all = config.Bool("enable_all_optimization");
    kernels_ =
        (all || config.Bool("enable_fused_normalization") ? CAI_MODEL_KERNEL_FUSED_NORMALIZATION
                                                          : 0) |
        (all || config.Bool("enable_flash_attention") ? CAI_MODEL_KERNEL_MEMORY_EFFICIENT_ATTENTION
                                                      : 0) |
        (all || config.Bool("enable_jit_fused") ? CAI_MODEL_KERNEL_FUSED_ACTIVATION : 0);
    ckpt_layers_text_ = config.String("num_ckpt_layers_per_stage");
    ckpt_ratio_ = config.Float("gradient_checkpointing_ratio");
    vocab_divisible_by_ = config.Int("make_vocab_size_divisible_by");
    interleaved_ = config.String("pp_style") == "interleaved";
    zbv_ = config.String("pp_style") == "zbv";
    chunks_ = static_cast<int32_t>(config.Int("num_model_chunks"));
    if (chunks_ > 1 && !interleaved_ && !zbv_) {
      throw Error(CAI_INVALID_ARGUMENT,
                  "hybrid_parallel: num_model_chunks = " + std::to_string(chunks_) +
                      " needs pp_style = \"interleaved\" or \"zbv\"");
    }
    if (zbv_ && (chunks_ != 2 || pp_ < 2)) {
      // ColossalAI asserts the same: the V is two chunks per rank over a real pipeline.
      throw Error(CAI_INVALID_ARGUMENT,
                  "hybrid_parallel: pp_style = \"zbv\" needs num_model_chunks = 2 (got " +
                      std::to_string(chunks_) + ") and pp_size > 1 (got " + std::to_string(pp_) +
                      ")");
    }
    if (interleaved_ && chunks_ < 2) {
      throw Error(CAI_INVALID_ARGUMENT,
                  "hybrid_parallel: pp_style = \"interleaved\" needs num_model_chunks >= 2");
    }
    num_microbatches_ = config.Int("num_microbatches");
    microbatch_size_ = config.Int("microbatch_size");
    layers_per_stage_text_ = config.String("num_layers_per_stage");
    zero_stage_ = static_cast<int>(config.Int("zero_stage"));
    if (zero_stage_ == 2 && pp_ > 1) {
      // ZeRO-2 reduce-scatters every backward into a shard; a pipeline runs one backward per
      // micro-batch and chunk, so it would reduce m·c times per step (ColossalAI refuses too).
      throw Error(CAI_INVALID_ARGUMENT,
                  "hybrid_parallel: zero_stage = 2 with pp_size > 1 would reduce-scatter the "
                  "gradients after every micro-batch; use zero_stage = 1 (ColossalAI refuses it "
                  "as well)");
    }
    overlap_p2p_ = config.Bool("overlap_p2p");
    max_norm_ = config.Float("max_norm");
    ddp_options_.bucket_cap_bytes =
        static_cast<size_t>(config.Float("ddp_bucket_cap_mb") * 1024 * 1024);
    ddp_options_.find_unused_parameters = config.Bool("find_unused_parameters");
    ddp_options_.gradient_as_bucket_view = config.Bool("gradient_as_bucket_view");
    ddp_options_.static_graph = config.Bool("static_graph");
    ddp_options_.owner = kName;
    zero_options_.stage = std::max(1, zero_stage_);
    zero_options_.bucket_cap =
        static_cast<size_t>(config.Float("zero_bucket_size_in_m") * (1 << 20));
    zero_options_.overlap_communication = config.Bool("overlap_communication");
    zero_options_.overlap_allgather = config.Bool("overlap_allgather");
    zero_options_.cpu_offload = config.Bool("cpu_offload");
    zero_options_.owner = kName;
    scaler_config_ = sdk::LossScalerConfig(config, kName);
  }

  ~HybridParallel() {
    // Sends in flight read our buffers: finish them before those go.
    sends_.clear();
    recvs_.clear();
    if (busy_s_ > 0) {
      std::ostringstream line;
      line << "hybrid_parallel: pipeline rank " << pp_rank_ << " busy " << busy_s_ << " s of "
           << pipeline_s_ << " s in execute_pipeline over " << steps_ << " steps (bubble fraction "
           << (1 - busy_s_ / pipeline_s_) << ")";
      sdk::Log(CAI_LOG_INFO, line.str());
    }
    for (cai_comm_group* g : groups_) Host().comm->destroy_group(g);
  }

  void Boost(const cai_boost_args& args) {
    if (model_) throw Error(CAI_FAILED_PRECONDITION, "hybrid_parallel: boost was already called");
    model_ = args.model;
    optimizer_ = args.optimizer;
    precision_ = args.precision;
    wire_dtype_ = precision_ == CAI_PRECISION_BF16 ? kBF16 : sdk::kFloat32;
    if (num_microbatches_ > 0 && num_microbatches_ != args.grad_accumulation) {
      throw Error(CAI_INVALID_ARGUMENT,
                  "hybrid_parallel: num_microbatches = " + std::to_string(num_microbatches_) +
                      " but train.grad_accum = " + std::to_string(args.grad_accumulation) +
                      "; the host hands the strategy train.grad_accum micro-batches per step: "
                      "set train.grad_accum = " +
                      std::to_string(num_microbatches_));
    }
    microbatches_ = args.grad_accumulation;
    if (interleaved_ && microbatches_ % pp_ != 0) {
      throw Error(CAI_INVALID_ARGUMENT,
                  "hybrid_parallel: the interleaved schedule needs the micro-batches per step ("
                  "train.grad_accum = " +
                      std::to_string(microbatches_) +
                      ") to be a multiple of pp_size = " + std::to_string(pp_));
    }
    sdk::RequireFp32Params(model_, kName);
    if (zbv_ && !CAI_HAS_FIELD(Host().model, cai_model_api, stage_backward_weights)) {
      throw Error(CAI_FAILED_PRECONDITION,
                  "hybrid_parallel: pp_style = \"zbv\" needs a host with ABI 1.3's split "
                  "backward (stage_backward_weights); use pp_style = \"1f1b\" or upgrade cai");
    }
    MakeGroups();
    if (tp_ > 1) ApplyTensorParallel();
    if (sp_mode_ != 0) ApplySequenceParallel();
    PlanStages();
    ConfigureModel();
    const uint32_t num_params = Host().model->num_params(model_);
    // A parameter whole on every rank of a tensor-parallel group (norms, biases after a
    // row-parallel projection, learned positions) gets the same gradient on each: the group's
    // rank 0 alone counts it in the gradient norm.
    for (uint32_t p = 0; p < num_params && tp_rank_ != 0; ++p) {
      if (needed_[p] && counted_[p] && sdk::ParamInfo(model_, p).tp_dim < 0) {
        not_counted_.push_back(p);
      }
    }

    // Every rank of a data-parallel group starts from its rank 0's values of what the stage
    // holds; a parameter several stages hold, from its holder.
    std::vector<uint32_t> held;
    for (uint32_t p = 0; p < num_params; ++p) {
      if (needed_[p]) held.push_back(p);
    }
    sdk::BroadcastParams(model_, held, dp_group_);
    sdk::BroadcastBuffers(model_, dp_group_);
    for (const Shared& s : shared_) sdk::BroadcastParams(model_, s.params, s.group, s.holder);

    std::vector<uint32_t> trainable;
    for (uint32_t p : sdk::OwnedParams(model_, /*trainable=*/true)) {
      if (needed_[p]) trainable.push_back(p);
    }
    if (trainable.empty()) {
      throw Error(CAI_FAILED_PRECONDITION,
                  "hybrid_parallel: pipeline rank " + std::to_string(pp_rank_) +
                      " holds no trainable parameter; unfreeze some (model.freeze) or use fewer "
                      "stages");
    }
    if (zero_stage_ == 0) {
      ddp_options_.group = dp_group_;
      replica_.emplace(model_, optimizer_, trainable, precision_, ddp_options_,
                       /*broadcast=*/false);
    } else {
      zero_options_.group = dp_group_;
      zero_options_.precision = precision_;
      zero_options_.comm_dtype = sdk::ComputeDtype(precision_);
      zero_options_.grad_accumulation = args.grad_accumulation;
      zero_.emplace(model_, optimizer_, trainable, zero_options_);
    }
    // What other stages hold goes: its storage is released (and not counted).
    for (uint32_t p = 0; p < num_params; ++p) {
      if (!needed_[p] && sdk::ParamInfo(model_, p).tied_to < 0) {
        Check(Host().model->release_param_storage(model_, p));
      }
    }
    epilogue_.emplace(optimizer_, max_norm_);
    if (precision_ == CAI_PRECISION_FP16) epilogue_->EnableLossScaling(scaler_config_);

    std::ostringstream line;
    line << "hybrid_parallel: dp " << dp_ << " x pp " << pp_ << " x sp " << sp_ << " x tp " << tp_
         << (ring_                                          ? " (sequence parallelism ring)"
             : sequence_parallel_                           ? " (sequence parallelism split_gather)"
             : sp_mode_ == CAI_SEQUENCE_PARALLEL_ALL_TO_ALL ? " (sequence parallelism all_to_all)"
             : sp_mode_ == CAI_SEQUENCE_PARALLEL_RING_ATTN  ? " (sequence parallelism ring_attn)"
                                                            : "")
         << ", "
         << (zbv_           ? "zbv"
             : interleaved_ ? "interleaved"
                            : "1f1b")
         << " over " << microbatches_ << " micro-batches, zero_stage " << zero_stage_
         << "; pipeline rank " << pp_rank_ << " runs";
    for (const Stage& s : stages_) {
      line << " units [" << s.first_unit << ", " << s.last_unit << ")";
    }
    if (zbv_) {
      int64_t ticks = 0;
      schedule_ = ZeroBubbleVSchedule(pp_, pp_rank_, microbatches_, &ticks);
      const int64_t work = 6 * int64_t{microbatches_};
      line << "; the zbv schedule takes " << ticks << " ticks for " << work
           << " of work per rank with equal F, B and W times (bubble "
           << double(ticks - work) / double(ticks) << "; 1F1B's "
           << double(pp_ - 1) / double(microbatches_ + pp_ - 1) << ")";
    } else if (pp_ > 1) {
      schedule_ = PipelineSchedule(pp_, pp_rank_, microbatches_, chunks_);
    }
    line << ", holds " << held.size() << " parameter tensors";
    if (!shared_.empty()) line << " (" << shared_.size() << " shared with other stages)";
    sdk::Log(CAI_LOG_INFO, line.str());
  }

  void ParallelLayout(cai_parallel_layout& out) {
    out.data_parallel_rank = dp_rank_;
    out.data_parallel_size = dp_;
    // The last virtual stage computes the loss: on the last rank, or on rank 0 at the end of
    // zbv's V.
    out.reports_loss = pp_rank_ == (zbv_ ? 0 : pp_ - 1) && sp_rank_ == 0 && tp_rank_ == 0;
    out.pipelines = pp_ > 1;
  }

  // pp_size = 1: data parallelism, one micro-batch at a time.
  void NoSync(bool enabled) { no_sync_ = enabled; }

  void ForwardBackward(const cai_micro_batch& batch) {
    if (!model_)
      throw Error(CAI_FAILED_PRECONDITION, "hybrid_parallel: forward_backward before boost");
    if (pp_ > 1) {
      throw Error(CAI_FAILED_PRECONDITION,
                  "hybrid_parallel: with pp_size > 1 every step is one execute_pipeline (the "
                  "host learns so from parallel_layout, ABI 1.3)");
    }
    CheckMicroBatch(batch);
    if (replica_) {
      sdk::BucketReducer& reducer = replica_->reducer();
      reducer.ExpectUnreduced();
      if (!no_sync_) reducer.Begin();
      sdk::RunMicroBatch(model_, batch, true, epilogue_->loss_scale());
      if (!no_sync_) reducer.Finish();
    } else {
      zero_->BeginBackward(/*reduce=*/!no_sync_);
      sdk::RunMicroBatch(model_, batch, true, epilogue_->loss_scale());
      zero_->EndBackward();
    }
  }

  void ExecutePipeline(const cai_pipeline_args& args) {
    if (!model_)
      throw Error(CAI_FAILED_PRECONDITION, "hybrid_parallel: execute_pipeline before boost");
    if (args.num_micro_batches != microbatches_) {
      throw Error(CAI_INVALID_ARGUMENT, "hybrid_parallel: execute_pipeline got " +
                                            std::to_string(args.num_micro_batches) +
                                            " micro-batches, boost was told " +
                                            std::to_string(microbatches_) + " (train.grad_accum)");
    }
    for (int32_t i = 0; i < args.num_micro_batches; ++i) CheckMicroBatch(args.micro_batches[i]);
    if (zero_) zero_->WaitGathers();
    const Clock::time_point start = Clock::now();
    double loss = 0;
    const std::vector<Op>& ops = schedule_;
    for (size_t i = 0; i < ops.size(); ++i) {
      PostRecv(ops[i], args);
      if (overlap_p2p_ && i + 1 < ops.size()) PostRecv(ops[i + 1], args);
      if (ops[i].weights) {
        Weights(ops[i]);
      } else if (ops[i].forward) {
        loss += Forward(ops[i], args.micro_batches[ops[i].mb]);
      } else {
        Backward(ops[i], args.micro_batches[ops[i].mb]);
      }
      DropFinishedSends();
    }
    for (Pending& s : sends_) s.work.Wait();
    sends_.clear();
    if (!activations_.empty() || !recvs_.empty() || !awaiting_weights_.empty()) {
      throw Error(CAI_INTERNAL, "hybrid_parallel: the schedule left activations or receives");
    }
    if (args.loss) *args.loss = loss;
    pipeline_s_ += std::chrono::duration<double>(Clock::now() - start).count();
    ++steps_;
  }

  // Forward only, through every chunk of the pipeline in order; the loss lands on the last
  // stage (the host counts it there: reports_loss).
  void Evaluate(const cai_micro_batch& batch) {
    if (!model_) throw Error(CAI_FAILED_PRECONDITION, "hybrid_parallel: evaluate before boost");
    if (zero_) zero_->WaitGathers();
    if (pp_ == 1) {
      sdk::RunMicroBatch(model_, batch, false);
      return;
    }
    *batch.loss = 0;
    Buffer handed;  // zbv: the output of this rank's chunk 0 is its chunk 1's input
    for (int32_t c = 0; c < chunks_; ++c) {
      const int32_t v = VirtualStage(c);
      const Stage& stage = stages_[c];
      Buffer input;
      int64_t shape[3];
      BoundaryShape(*batch.tokens, shape);
      if (v > 0 && RankOf(v - 1) == pp_rank_) {
        input = std::move(handed);
      } else if (v > 0) {
        input = sdk::AllocFlat(CAI_MEM_DEVICE, Elements(shape), wire_dtype_, "pipeline.eval");
        P2P(CAI_COMM_RECV, Tensor3(input, shape), RankOf(v - 1), Tag(2, 0, v)).Wait();
      }
      cai_stage_forward_args f{};
      f.struct_size = CAI_STAGE_FORWARD_ARGS_STRUCT_SIZE;
      f.first_unit = stage.first_unit;
      f.last_unit = stage.last_unit;
      f.tokens = v == 0 ? batch.tokens : nullptr;
      f.targets = v == last_stage_ ? batch.targets : nullptr;
      cai_tensor in = v > 0 ? Tensor3(input, shape) : cai_tensor{};
      f.input = v > 0 ? &in : nullptr;
      cai_activation* out = nullptr;
      f.output = &out;
      f.loss = batch.loss;
      f.no_grad = true;
      Check(Host().model->stage_forward(model_, &f));
      if (v == last_stage_) continue;
      Buffer wire = ToWire(out, shape);
      Host().model->activation_release(out);
      if (RankOf(v + 1) == pp_rank_) {
        handed = std::move(wire);
      } else {
        P2P(CAI_COMM_SEND, Tensor3(wire, shape), RankOf(v + 1), Tag(2, 0, v + 1)).Wait();
      }
    }
  }

  void Step(cai_step_result& result) {
    if (!model_) throw Error(CAI_FAILED_PRECONDITION, "hybrid_parallel: step before boost");
    SumSharedGrads();
    const uint32_t num_params = Host().model->num_params(model_);
    sdk::StepSums sums;
    if (replica_) {
      // The reduced buckets are the same on every rank of the group reducing them: its rank 0
      // contributes the norm.
      sums = replica_->LocalSums(num_params, epilogue_->loss_scaling(), ReducerRank() == 0,
                                 not_counted_);
    } else {
      sums = zero_->LocalSums(num_params, epilogue_->loss_scaling());
      sums.sum_squares -= zero_->SumSquaresOf(not_counted_);
    }
    const sdk::StepDecision d = epilogue_->Decide(sums, result);
    if (replica_) {
      replica_->Update(d);
    } else {
      zero_->Apply(d, sums.used);
    }
  }

  void ZeroGrad() {
    if (!model_) throw Error(CAI_FAILED_PRECONDITION, "hybrid_parallel: zero_grad before boost");
    if (replica_) {
      replica_->reducer().Reset();
    } else {
      zero_->ZeroGrad();
    }
  }

  // The canonical layout: each stage's rank 0 of the group reducing its gradients (data
  // parallelism, × sequence parallelism under all_to_all and ring_attn) writes what its stage
  // holds; with
  // tensor parallelism the slices are gathered over the group and its rank 0 writes them whole.
  void Save(const cai_checkpoint_args& args) {
    const bool writer = ReducerRank() == 0;
    auto writes = [&](uint32_t p) { return counted_[p] != 0; };
    const sdk::ParamIo& io = tp_io_ ? *tp_io_ : sdk::DirectIo();
    if (replica_) {
      if (writer) replica_->Save(args, writes, io);
    } else {
      zero_->Save(args, writer, writes, io);
    }
    if (writer && args.model) {
      for (uint32_t p : sdk::OwnedParams(model_, /*trainable=*/false)) {
        if (!writes(p)) continue;
        const cai_param_info info = sdk::ParamInfo(model_, p);
        cai_tensor data{};
        Check(Host().model->param_data(model_, p, &data));
        int64_t n = info.numel;
        cai_tensor flat = data;
        flat.ndim = 1;
        flat.shape = &n;
        static int64_t unit_stride = 1;
        flat.strides = &unit_stride;
        io.Write(args.checkpoint, "model/" + std::string(info.name), p, flat,
                 std::span<const int64_t>(info.shape, info.ndim));
      }
    }
    if (world_rank_ == 0 && args.optimizer) epilogue_->Save(args.checkpoint, kName);
  }

  void Load(const cai_checkpoint_args& args) {
    const sdk::ParamIo& io = tp_io_ ? *tp_io_ : sdk::DirectIo();
    if (replica_) {
      replica_->Load(args, io);
    } else {
      zero_->Load(args, io);
    }
    if (args.model) {
      for (uint32_t p : sdk::OwnedParams(model_, /*trainable=*/false)) {
        if (!needed_[p]) continue;
        cai_tensor data{};
        Check(Host().model->param_data(model_, p, &data));
        io.Read(args.checkpoint, "model/" + std::string(sdk::ParamInfo(model_, p).name), p, 0, 0,
                data);
      }
    }
    if (args.optimizer) epilogue_->Load(args.checkpoint, kName);
  }

  void Stats(cai_strategy_stats& stats) {
    for (uint32_t p : sdk::OwnedParams(model_, /*trainable=*/false)) {
      if (!needed_[p]) continue;
      const cai_param_info info = sdk::ParamInfo(model_, p);
      stats.param_bytes += static_cast<uint64_t>(info.numel) * sdk::ElementSize(info.dtype);
    }
    if (replica_) {
      replica_->AddStats(stats);
    } else {
      zero_->AddStats(stats);
    }
  }

  // Per rank: an even share 1/(pp_size · tp_size) of the model states (the tied embedding,
  // uneven splits and the parameters tensor parallelism keeps whole add to it), the optimizer
  // state and masters 1/dp with ZeRO.
  static void EstimateMemory(const cai_memory_estimate_args& args, cai_memory_estimate& out) {
    sdk::Config config(args.config);
    const uint64_t pp = args.config ? static_cast<uint64_t>(config.Int("pp_size")) : 1;
    const uint64_t tp = args.config ? static_cast<uint64_t>(config.Int("tp_size")) : 1;
    const int zero = args.config ? static_cast<int>(config.Int("zero_stage")) : 0;
    const uint64_t world = static_cast<uint64_t>(std::max(1, args.world_size));
    // ZeRO shards over every rank holding the same slice of the same stage: dp · sp.
    const uint64_t dp = std::max<uint64_t>(1, world / (pp * tp));
    const bool mixed = args.precision != CAI_PRECISION_FP32;
    if (args.config && tp == 1 && sdk::HasLayout(args) &&
        EstimateLayout(args, config, static_cast<int32_t>(pp), static_cast<int32_t>(dp), out)) {
      return;
    }
    const uint64_t stage = (static_cast<uint64_t>(args.num_params) + pp * tp - 1) / (pp * tp);
    const uint64_t sharded = zero > 0 ? (stage + dp - 1) / dp : stage;
    const uint64_t e = mixed ? 2 : 4;
    out.param_bytes = e * stage;
    out.grad_bytes = zero == 2 ? e * sharded : e * stage + (zero == 1 ? e * sharded : 0);
    out.master_bytes = mixed ? 4 * sharded : 0;
    out.optimizer_state_bytes = 4ull * args.optimizer_state_slots * sharded;
    out.device_bytes =
        out.param_bytes + out.grad_bytes + out.master_bytes + out.optimizer_state_bytes;
    out.formula = zero > 0 ? "per rank: (P + G)Ψ/(pp·tp) + (K + M)Ψ/(pp·tp·dp·sp), ZeRO over "
                             "dp·sp (sp: all_to_all's or ring_attn's sequence-parallel ranks, "
                             "else 1)"
                           : "per rank: (P + G + M + K)Ψ/(pp·tp), replicated over dp·sp";
  }

 private:
  // A virtual stage's units [first_unit, last_unit).
  struct Stage {
    int32_t first_unit = 0, last_unit = 0;
  };

  // The virtual stages' units: `per[v]` blocks each, the blocks starting at unit
  // `first_block`; the units before the blocks join stage 0, those after them the last.
  static std::vector<Stage> StageBounds(int32_t num_units, int32_t first_block,
                                        const std::vector<int32_t>& per) {
    std::vector<Stage> all(per.size());
    int32_t next = first_block;
    for (size_t v = 0; v < per.size(); ++v) {
      all[v].first_unit = v == 0 ? 0 : next;
      next += per[v];
      all[v].last_unit = v + 1 == per.size() ? num_units : next;
    }
    return all;
  }
  static int32_t RankOf(int32_t v, int32_t pp, bool zbv) {
    return zbv && v >= pp ? 2 * pp - 1 - v : v % pp;
  }

  // The estimate from the model's layout, without tensor parallelism (which splits parameters
  // the layout does not name): each pipeline rank's parameters as PlanStages assigns them, the
  // optimizer it runs over them (ZeroOptimizer's own estimate, or DataParallelReplica's
  // buffers), the largest rank. A head without an output projection of its own reads the token
  // embedding (GPT-2's tied head), which its rank then holds too. False where the layout cannot
  // be staged (boost refuses it, naming why).
  static bool EstimateLayout(const cai_memory_estimate_args& args, const sdk::Config& config,
                             int32_t pp, int32_t dp, cai_memory_estimate& out) {
    const int32_t num_units = static_cast<int32_t>(args.num_layout_units);
    std::vector<int32_t> blocks;
    for (int32_t u = 0; u < num_units; ++u) {
      if (args.unit_kind[u] == CAI_UNIT_BLOCK) blocks.push_back(u);
    }
    const bool zbv = config.String("pp_style") == "zbv";
    const int32_t total = pp * static_cast<int32_t>(config.Int("num_model_chunks"));
    std::vector<int32_t> rank_of_unit(num_units, 0);
    if (total > 1) {
      const auto layers = static_cast<int32_t>(blocks.size());
      if (blocks.empty() || blocks.back() - blocks.front() + 1 != layers) return false;
      const std::optional<std::vector<int32_t>> per =
          BlocksPerStage(config.String("num_layers_per_stage"), total, layers);
      if (!per || *std::min_element(per->begin(), per->end()) < 1) return false;
      const std::vector<Stage> all = StageBounds(num_units, blocks.front(), *per);
      for (int32_t v = 0; v < total; ++v) {
        for (int32_t u = all[v].first_unit; u < all[v].last_unit; ++u) {
          rank_of_unit[u] = RankOf(v, pp, zbv);
        }
      }
    }
    const uint32_t n = args.num_layout_params;
    // held[r][i]: pipeline rank r holds parameter i; one in no unit, every rank.
    std::vector<std::vector<bool>> held(static_cast<size_t>(pp), std::vector<bool>(n, false));
    int32_t head = -1, embedding = -1;
    bool head_projects = false;
    for (uint32_t i = 0; i < n; ++i) {
      const int32_t u = args.param_unit[i];
      if (u < 0 || u >= num_units) {
        for (auto& h : held) h[i] = true;
        continue;
      }
      held[static_cast<size_t>(rank_of_unit[u])][i] = true;
      if (args.unit_kind[u] == CAI_UNIT_EMBEDDING && embedding < 0) {
        embedding = static_cast<int32_t>(i);
      }
      if (args.unit_kind[u] == CAI_UNIT_HEAD) head = u;
    }
    for (uint32_t i = 0; embedding >= 0 && i < n; ++i) {
      head_projects |=
          args.param_unit[i] == head && args.param_numel[i] == args.param_numel[embedding];
    }
    if (head >= 0 && embedding >= 0 && !head_projects) {
      held[static_cast<size_t>(rank_of_unit[head])][static_cast<size_t>(embedding)] = true;
    }

    const int zero = static_cast<int>(config.Int("zero_stage"));
    const bool mixed = args.precision != CAI_PRECISION_FP32;
    const uint64_t e = mixed ? 2 : 4, k = args.optimizer_state_slots;
    // The step's agreement is all-reduced over the world.
    const uint64_t flags = sdk::StepEpilogue::AgreementBytes(n, args.world_size);
    sdk::ZeroOptimizer::Options o;
    o.stage = std::max(1, zero);
    o.bucket_cap = static_cast<size_t>(config.Float("zero_bucket_size_in_m") * (1 << 20));
    o.cpu_offload = config.Bool("cpu_offload");
    o.precision = args.precision;
    o.comm_dtype = sdk::ComputeDtype(args.precision);
    const size_t struct_size = out.struct_size;
    cai_extension_base* const extension = out.extension_start;
    out = cai_memory_estimate{};
    for (const std::vector<bool>& mine : held) {
      std::vector<int64_t> numel;
      for (uint32_t i = 0; i < n; ++i) {
        if (mine[i]) numel.push_back(args.param_numel[i]);
      }
      const uint64_t psi = std::accumulate(numel.begin(), numel.end(), uint64_t{0});
      cai_memory_estimate rank{};
      if (zero > 0) {
        sdk::ZeroOptimizer::EstimateMemory(numel, dp, o, static_cast<uint32_t>(k), flags)
            .Fill(rank);
      } else {  // DataParallelReplica: fp32 weights (+ the 16-bit copy), buckets, state
        rank.param_bytes = (mixed ? 4 + e : 4) * psi;
        rank.grad_bytes = e * psi + flags;
        rank.optimizer_state_bytes = 4 * k * psi;
        rank.device_bytes = rank.param_bytes + rank.grad_bytes + rank.optimizer_state_bytes;
      }
      if (rank.device_bytes >= out.device_bytes) out = rank;
    }
    out.formula =
        "the pipeline rank holding most: its stages' parameters as boost assigns the blocks (and, "
        "for a head without an output projection of its own, the tied token embedding), under "
        "zero_stage 1/2 ZeroOptimizer's buckets over dp·sp (padding, staging, masters, state, a "
        "checkpoint's gathered bucket), under zero_stage 0 fp32 weights, buckets and state "
        "(4 + e + 4k)Ψ_stage (+ eΨ_stage for the 16-bit copy under bf16/fp16); activations "
        "passed between stages not counted (they depend on the batch)";
    out.struct_size = struct_size;
    out.extension_start = extension;
    return true;
  }
  // Parameters several pipeline ranks of a replica hold, the group of those ranks, and the
  // holder's rank in it.
  struct Shared {
    std::vector<uint32_t> params;
    cai_comm_group* group = nullptr;
    int32_t holder = 0;
  };
  // A transfer in flight and the buffer it reads or fills.
  struct Pending {
    Buffer buffer;
    int64_t shape[3] = {0, 0, 0};
    sdk::Work work;
  };

  // ---- Boost ---------------------------------------------------------------------------------

  int32_t WorldRank(int32_t dp_rank, int32_t pp_rank, int32_t sp_rank, int32_t tp_rank) const {
    return ((dp_rank * pp_ + pp_rank) * sp_ + sp_rank) * tp_ + tp_rank;
  }
  // This rank's rank in the group its gradients are reduced over (dp × sp).
  int32_t ReducerRank() const { return dp_rank_ * sp_ + sp_rank_; }

  // A group of `ranks`, created on every rank (collective); `mine` is set where this rank is
  // a member.
  void NewGroup(const std::vector<int32_t>& ranks, cai_comm_group*& mine) {
    cai_comm_group* g = nullptr;
    Check(Host().comm->new_group(ranks.data(), ranks.size(), &g));
    if (g) mine = g;
    groups_.push_back(g);
  }

  // Tensor-parallel groups (tp consecutive ranks), sequence-parallel groups (one rank of sp
  // neighbouring tensor-parallel groups), pipeline groups (one tensor- and sequence-parallel
  // position of every stage of a replica) and the groups gradients are reduced over (one
  // (stage, tp rank) position across the replicas and the sequence-parallel ranks); every rank
  // creates every group, in one order.
  void MakeGroups() {
    auto each = [&](auto&& visit) {
      for (int32_t d = 0; d < dp_; ++d) {
        for (int32_t p = 0; p < pp_; ++p) {
          for (int32_t s = 0; s < sp_; ++s) {
            for (int32_t t = 0; t < tp_; ++t) visit(d, p, s, t);
          }
        }
      }
    };
    // Ranks that differ only where `key` of their coordinates differs, one group per key.
    auto groups = [&](auto key, cai_comm_group*& mine) {
      std::map<std::array<int32_t, 4>, std::vector<int32_t>> by_key;
      each([&](int32_t d, int32_t p, int32_t s, int32_t t) {
        by_key[key(d, p, s, t)].push_back(WorldRank(d, p, s, t));
      });
      for (const auto& [k, ranks] : by_key) NewGroup(ranks, mine);
    };
    if (tp_ > 1) {
      groups(
          [](int32_t d, int32_t p, int32_t s, int32_t) {
            return std::array{d, p, s, 0};
          },
          tp_group_);
    }
    if (sp_ > 1) {
      groups(
          [](int32_t d, int32_t p, int32_t, int32_t t) {
            return std::array{d, p, 0, t};
          },
          sp_group_);
    }
    if (pp_ > 1) {
      groups(
          [](int32_t d, int32_t, int32_t s, int32_t t) {
            return std::array{d, 0, s, t};
          },
          pp_group_);
    }
    const int32_t reducers = dp_ * sp_;
    if (pp_ * tp_ == 1) {
      dp_group_ = nullptr;  // the world
    } else if (reducers == 1) {
      dp_group_ = SelfGroup();
    } else {
      groups(
          [](int32_t, int32_t p, int32_t, int32_t t) {
            return std::array{0, p, 0, t};
          },
          dp_group_);
    }
  }

  // The Shardformer kernels and which blocks recompute.
  void ConfigureModel() {
    const cai_model_api& model = *Host().model;
    if (kernels_ != 0) {
      if (!CAI_HAS_FIELD(&model, cai_model_api, enable_kernels)) {
        throw Error(CAI_FAILED_PRECONDITION,
                    "hybrid_parallel: enable_all_optimization and the enable_* keys need a host "
                    "with ABI 1.3's enable_kernels; set them to false or upgrade cai");
      }
      Check(model.enable_kernels(model_, kernels_));
    }
    if (ckpt_layers_text_.empty() && ckpt_ratio_ == 0) return;
    if (!CAI_HAS_FIELD(&model, cai_model_api, set_unit_checkpointing)) {
      throw Error(CAI_FAILED_PRECONDITION,
                  "hybrid_parallel: num_ckpt_layers_per_stage and gradient_checkpointing_ratio "
                  "need a host with ABI 1.3's set_unit_checkpointing; leave them out or upgrade "
                  "cai");
    }
    const int32_t total = pp_ * chunks_;
    std::vector<int32_t> counts;
    if (!ckpt_layers_text_.empty()) {
      std::optional<std::vector<int32_t>> parsed = ParseCounts(ckpt_layers_text_);
      if (!parsed) {
        throw Error(CAI_INVALID_ARGUMENT, "hybrid_parallel: num_ckpt_layers_per_stage = \"" +
                                              ckpt_layers_text_ +
                                              "\" must be block counts >= 0, comma-separated");
      }
      counts = std::move(*parsed);
      if (counts.size() == 1) counts.assign(total, counts[0]);
      if (static_cast<int32_t>(counts.size()) != total) {
        throw Error(CAI_INVALID_ARGUMENT,
                    "hybrid_parallel: num_ckpt_layers_per_stage = \"" + ckpt_layers_text_ +
                        "\" lists " + std::to_string(counts.size()) + " counts for " +
                        std::to_string(total) +
                        " virtual stages (pp_size x num_model_chunks); give one, or one per stage");
      }
    }
    for (int32_t c = 0; c < chunks_; ++c) {
      const int32_t v = VirtualStage(c);
      std::vector<uint32_t> blocks;
      for (int32_t u = stages_[c].first_unit; u < stages_[c].last_unit; ++u) {
        cai_unit_info info{};
        info.struct_size = CAI_UNIT_INFO_STRUCT_SIZE;
        Check(model.unit_info(model_, static_cast<uint32_t>(u), &info));
        if (info.kind == CAI_UNIT_BLOCK) blocks.push_back(static_cast<uint32_t>(u));
      }
      const size_t n = counts.empty()
                           ? static_cast<size_t>(std::lround(ckpt_ratio_ * double(blocks.size())))
                           : static_cast<size_t>(counts[v]);
      if (n > blocks.size()) {
        throw Error(CAI_INVALID_ARGUMENT,
                    "hybrid_parallel: num_ckpt_layers_per_stage asks virtual stage " +
                        std::to_string(v) + " to recompute " + std::to_string(n) +
                        " blocks but it holds " + std::to_string(blocks.size()));
      }
      std::string recomputed;
      for (size_t i = 0; i < blocks.size(); ++i) {
        Check(model.set_unit_checkpointing(model_, blocks[i], i < n));
        if (i < n) recomputed += (recomputed.empty() ? "" : ", ") + std::to_string(blocks[i]);
      }
      sdk::Log(CAI_LOG_INFO, "hybrid_parallel: virtual stage " + std::to_string(v) +
                                 " recomputes units [" + recomputed + "] in backward");
    }
  }

  // Ulysses or ring attention over the sequence-parallel group (the host's all-to-alls around
  // attention, or its keys and values passed around the group).
  void ApplySequenceParallel() {
    const cai_model_api& model = *Host().model;
    if (!CAI_HAS_FIELD(&model, cai_model_api, apply_sequence_parallel)) {
      throw Error(CAI_FAILED_PRECONDITION,
                  "hybrid_parallel: sequence_parallelism_mode = \"all_to_all\" or "
                  "\"ring_attn\" needs a host with ABI 1.3's apply_sequence_parallel; upgrade "
                  "cai or use split_gather");
    }
    cai_sequence_parallel_args a{};
    a.struct_size = CAI_SEQUENCE_PARALLEL_ARGS_STRUCT_SIZE;
    a.group = sp_group_;
    a.mode = sp_mode_;
    try {
      Check(model.apply_sequence_parallel(model_, &a));
    } catch (const Error& e) {
      throw Error(e.code(), "hybrid_parallel: sp_size = " + std::to_string(sp_) + ": " + e.what());
    }
  }

  // Splits the model over the tensor-parallel group (the host's column/row-parallel layers).
  void ApplyTensorParallel() {
    cai_tensor_parallel_args a{};
    a.struct_size = CAI_TENSOR_PARALLEL_ARGS_STRUCT_SIZE;
    a.group = tp_group_;
    a.sequence_parallel = sequence_parallel_;
    a.vocab_divisible_by = vocab_divisible_by_;
    a.gather_output = !parallel_output_;
    a.sequence_parallel_ring = ring_;
    try {
      Check(Host().model->apply_tensor_parallel(model_, &a));
    } catch (const Error& e) {
      throw Error(e.code(), "hybrid_parallel: tp_size = " + std::to_string(tp_) + ": " + e.what());
    }
    tp_io_.emplace(model_, tp_group_);
  }

  // A one-rank group: data parallelism of size 1 (collectives on it are no-ops).
  cai_comm_group* SelfGroup() {
    cai_comm_group* self = nullptr;
    for (int32_t r = 0; r < world_; ++r) {
      cai_comm_group* g = nullptr;
      Check(Host().comm->new_group(&r, 1, &g));
      if (g) self = g;
      groups_.push_back(g);
    }
    return self;
  }

  // Which units each virtual stage runs, which parameters this rank needs, and which it shares
  // with other pipeline ranks.
  void PlanStages() {
    const auto& model = *Host().model;
    const uint32_t num_units = model.num_units(model_);
    const uint32_t num_params = model.num_params(model_);
    std::vector<cai_unit_info> units(num_units);
    std::vector<int32_t> blocks;
    for (uint32_t u = 0; u < num_units; ++u) {
      units[u].struct_size = CAI_UNIT_INFO_STRUCT_SIZE;
      Check(model.unit_info(model_, u, &units[u]));
      if (units[u].kind == CAI_UNIT_BLOCK) blocks.push_back(static_cast<int32_t>(u));
    }
    const int32_t total = pp_ * chunks_;
    last_stage_ = total - 1;
    needed_.assign(num_params, 1);
    counted_.assign(num_params, 1);
    if (total == 1) {  // data parallelism only: the whole model, any model
      stages_.push_back({0, static_cast<int32_t>(num_units)});
      return;
    }
    const int32_t layers = static_cast<int32_t>(blocks.size());
    if (blocks.empty() || blocks.back() - blocks.front() + 1 != layers) {
      throw Error(CAI_FAILED_PRECONDITION,
                  "hybrid_parallel: the model (" + std::string(model.describe(model_)) +
                      ") exposes no consecutive transformer blocks to split into stages; "
                      "pipeline parallelism needs a zoo model (model.kind = \"gpt2\" or "
                      "\"llama\")");
    }
    const std::vector<int32_t> per = ParseLayersPerStage(total, layers);
    if (*std::min_element(per.begin(), per.end()) < 1) {
      throw Error(CAI_INVALID_ARGUMENT,
                  "hybrid_parallel: " + std::to_string(layers) +
                      " transformer blocks cannot fill " + std::to_string(total) +
                      " virtual stages (pp_size " + std::to_string(pp_) + " x num_model_chunks " +
                      std::to_string(chunks_) +
                      "): every stage needs at least one block; use fewer stages or chunks");
    }
    const std::vector<Stage> all =
        StageBounds(static_cast<int32_t>(num_units), blocks.front(), per);
    for (int32_t c = 0; c < chunks_; ++c) stages_.push_back(all[VirtualStage(c)]);

    // For every pipeline rank, the parameters its units hold or read.
    const bool reads = CAI_HAS_FIELD(&units[0], cai_unit_info, reads);
    std::vector<std::set<int32_t>> ranks_of(num_params);
    std::vector<int32_t> holder(num_params, -1);
    for (int32_t v = 0; v < total; ++v) {
      const int32_t rank = RankOf(v);
      for (int32_t u = all[v].first_unit; u < all[v].last_unit; ++u) {
        for (uint32_t i = 0; i < units[u].num_params; ++i) {
          ranks_of[units[u].params[i]].insert(rank);
          holder[units[u].params[i]] = rank;
        }
        for (uint32_t i = 0; reads && i < units[u].num_reads; ++i) {
          ranks_of[units[u].reads[i]].insert(rank);
        }
      }
    }
    std::map<std::vector<int32_t>, std::vector<uint32_t>> shared_by_ranks;
    for (uint32_t p = 0; p < num_params; ++p) {
      if (ranks_of[p].empty()) {
        // In no unit: every stage keeps it, stage 0 counts and writes it.
        for (int32_t r = 0; r < pp_; ++r) ranks_of[p].insert(r);
        holder[p] = 0;
      }
      needed_[p] = ranks_of[p].count(pp_rank_) != 0;
      counted_[p] = holder[p] == pp_rank_;
      if (needed_[p] && !counted_[p]) not_counted_.push_back(p);
      if (ranks_of[p].size() > 1 && sdk::ParamInfo(model_, p).tied_to < 0) {
        shared_by_ranks[std::vector<int32_t>(ranks_of[p].begin(), ranks_of[p].end())].push_back(p);
      }
    }
    // One group per set of pipeline ranks sharing parameters, in every replica; collective.
    for (const auto& [ranks, params] : shared_by_ranks) {
      Shared mine;
      for (int32_t d = 0; d < dp_; ++d) {
        for (int32_t s = 0; s < sp_; ++s) {
          for (int32_t t = 0; t < tp_; ++t) {
            std::vector<int32_t> world_ranks;
            for (int32_t r : ranks) world_ranks.push_back(WorldRank(d, r, s, t));
            cai_comm_group* g = nullptr;
            Check(Host().comm->new_group(world_ranks.data(), world_ranks.size(), &g));
            groups_.push_back(g);
            if (!g) continue;
            mine.group = g;
            mine.params = params;
            mine.holder = static_cast<int32_t>(
                std::find(ranks.begin(), ranks.end(), holder[params.front()]) - ranks.begin());
          }
        }
      }
      if (mine.group) shared_.push_back(std::move(mine));
    }
    // The width of the activations between stages: the token embedding's.
    for (uint32_t p = 0; p < num_params && hidden_ == 0; ++p) {
      const cai_param_info info = sdk::ParamInfo(model_, p);
      if (info.role == CAI_ROLE_EMBEDDING && info.ndim == 2) hidden_ = info.shape[1];
    }
    if (hidden_ == 0) {
      throw Error(CAI_FAILED_PRECONDITION,
                  "hybrid_parallel: the model has no token embedding to size the activations "
                  "between stages by");
    }
  }

  // "2, 3,1" -> {2, 3, 1}; nullopt unless every item is an integer >= 0 (spaces around it).
  static std::optional<std::vector<int32_t>> ParseCounts(const std::string& text) {
    std::vector<int32_t> counts;
    std::stringstream in(text);
    for (std::string item; std::getline(in, item, ',');) {
      try {
        size_t used = 0;
        counts.push_back(std::stoi(item, &used));
        if (item.find_first_not_of(' ', used) != std::string::npos || counts.back() < 0) {
          return std::nullopt;
        }
      } catch (const std::exception&) {
        return std::nullopt;
      }
    }
    return counts;
  }

  // The blocks of each of `stages` virtual stages: the counts num_layers_per_stage (`text`)
  // lists, or DistributeLayers' when it is empty; nullopt unless `text` lists `stages` counts
  // that add up to `layers`.
  static std::optional<std::vector<int32_t>> BlocksPerStage(const std::string& text, int32_t stages,
                                                            int32_t layers) {
    if (text.empty()) return DistributeLayers(layers, stages);
    std::vector<int32_t> per = ParseCounts(text).value_or(std::vector<int32_t>{});
    if (static_cast<int32_t>(per.size()) != stages ||
        std::accumulate(per.begin(), per.end(), 0) != layers) {
      return std::nullopt;
    }
    return per;
  }

  // BlocksPerStage for this instance's num_layers_per_stage; an error naming the key when it
  // does not fit the model.
  std::vector<int32_t> ParseLayersPerStage(int32_t stages, int32_t layers) const {
    std::optional<std::vector<int32_t>> per =
        BlocksPerStage(layers_per_stage_text_, stages, layers);
    if (!per) {
      throw Error(
          CAI_INVALID_ARGUMENT,
          "hybrid_parallel: num_layers_per_stage = \"" + layers_per_stage_text_ + "\" must list " +
              std::to_string(stages) +
              " block counts (pp_size x num_model_chunks) that add up to the model's " +
              std::to_string(layers) + " blocks, e.g. \"" +
              [&] {
                std::string e;
                for (int32_t n : DistributeLayers(layers, stages)) {
                  e += (e.empty() ? "" : ",") + std::to_string(n);
                }
                return e;
              }() +
              "\"");
    }
    return *per;
  }

  void CheckMicroBatch(const cai_micro_batch& batch) const {
    if (microbatch_size_ > 0 && batch.tokens->shape[0] != microbatch_size_) {
      throw Error(CAI_INVALID_ARGUMENT,
                  "hybrid_parallel: microbatch_size = " + std::to_string(microbatch_size_) +
                      " but a micro-batch holds " + std::to_string(batch.tokens->shape[0]) +
                      " rows (train.global_batch / data-parallel size / train.grad_accum); set "
                      "microbatch_size = 0 or make them agree");
    }
  }

  // ---- The schedule ----------------------------------------------------------------------------

  // Tags of point-to-point messages: kind (0 activation, 1 gradient, 2 evaluation), the
  // micro-batch and the virtual stage that receives it.
  static int32_t Tag(int32_t kind, int32_t mb, int32_t stage) {
    return (kind << 24) | (mb << 8) | stage;
  }
  // What a stage boundary carries for a micro-batch of `tokens` [B, T]: [B, T, hidden], or
  // [B, T/tp, hidden] under sequence parallelism (this rank's part of the sequence).
  void BoundaryShape(const cai_tensor& tokens, int64_t shape[3]) const {
    shape[0] = tokens.shape[0];
    shape[1] = sequence_parallel_ ? tokens.shape[1] / tp_ : tokens.shape[1] / sp_;
    shape[2] = hidden_;
  }
  static int64_t Elements(const int64_t* shape) { return shape[0] * shape[1] * shape[2]; }
  cai_tensor Tensor3(const Buffer& b, int64_t* shape) const {
    cai_tensor t = sdk::FlatView(b, wire_dtype_, 0, shape);
    t.ndim = 3;
    t.shape = shape;
    t.strides = Strides(shape);
    return t;
  }
  // Contiguous strides for `shape`, kept beside it (shape[3..5] in the caller's array would be
  // neater, but the descriptor only borrows): one table per distinct shape.
  int64_t* Strides(const int64_t* shape) const {
    auto key = std::make_tuple(shape[0], shape[1], shape[2]);
    auto [it, inserted] = strides_.try_emplace(key);
    if (inserted) it->second = {shape[1] * shape[2], shape[2], 1};
    return it->second.data();
  }

  sdk::Work P2P(cai_comm_op op, const cai_tensor& t, int32_t peer, int32_t tag) {
    cai_comm_args a{};
    a.struct_size = CAI_COMM_ARGS_STRUCT_SIZE;
    a.group = pp_group_;
    a.op = op;
    if (op == CAI_COMM_SEND) {
      a.input = &t;
    } else {
      a.output = &t;
    }
    a.peer = peer;
    a.tag = tag;
    a.async = true;
    cai_comm_work* work = nullptr;
    Check(Host().comm->run(&a, &work));
    return sdk::Work(work);
  }

  // The receive `op` needs, posted once: an activation from the previous virtual stage before
  // a forward, a gradient from the next before a backward.
  void PostRecv(const Op& op, const cai_pipeline_args& args) {
    const int32_t v = VirtualStage(op.chunk);
    if (op.weights || (op.forward && v == 0) || (!op.forward && v == last_stage_)) return;
    const int32_t peer = op.forward ? RankOf(v - 1) : RankOf(v + 1);
    if (peer == pp_rank_) return;  // handed over in this process (SendOrHandOver)
    const auto key = std::make_tuple(op.forward, op.mb, op.chunk);
    if (recvs_.count(key)) return;
    Pending& p = recvs_[key];
    BoundaryShape(*args.micro_batches[op.mb].tokens, p.shape);
    p.buffer = sdk::AllocFlat(CAI_MEM_DEVICE, Elements(p.shape), wire_dtype_,
                              op.forward ? "pipeline.activation" : "pipeline.grad");
    p.work =
        P2P(CAI_COMM_RECV, Tensor3(p.buffer, p.shape), peer, Tag(op.forward ? 0 : 1, op.mb, v));
  }

  // The received buffer of `op`, once complete.
  Pending TakeRecv(const Op& op) {
    auto it = recvs_.find(std::make_tuple(op.forward, op.mb, op.chunk));
    Pending p = std::move(it->second);
    recvs_.erase(it);
    p.work.Wait();
    return p;
  }

  // `activation` (or a stage input's gradient in `grad`) in the wire dtype, for sending.
  Buffer ToWire(cai_activation* activation, const int64_t* shape) {
    cai_tensor data{};
    Check(Host().model->activation_data(activation, &data));
    Buffer wire = sdk::AllocFlat(CAI_MEM_DEVICE, Elements(shape), wire_dtype_, "pipeline.send");
    int64_t n = Elements(shape);
    cai_tensor flat = data;
    flat.ndim = 1;
    flat.shape = &n;
    static int64_t one = 1;
    flat.strides = &one;
    sdk::RunKernel(CAI_KERNEL_COPY, &flat, sdk::FlatView(wire, wire_dtype_, 0, &n));
    return wire;
  }

  void Send(Buffer buffer, const int64_t* shape, int32_t peer, int32_t tag) {
    Pending& s = sends_.emplace_back();
    s.buffer = std::move(buffer);
    std::copy(shape, shape + 3, s.shape);
    s.work = P2P(CAI_COMM_SEND, Tensor3(s.buffer, s.shape), peer, tag);
  }
  void DropFinishedSends() {
    while (!sends_.empty() && sends_.front().work.Done()) {
      sends_.pop_front();
    }
  }

  // Returns the micro-batch's weighted loss on the last virtual stage, 0 elsewhere.
  double Forward(const Op& op, const cai_micro_batch& batch) {
    const int32_t v = VirtualStage(op.chunk);
    const Stage& stage = stages_[op.chunk];
    Pending input;
    cai_tensor in{};
    if (v > 0) {
      input = TakeRecv(op);
      in = Tensor3(input.buffer, input.shape);
    }
    cai_stage_forward_args f{};
    f.struct_size = CAI_STAGE_FORWARD_ARGS_STRUCT_SIZE;
    f.first_unit = stage.first_unit;
    f.last_unit = stage.last_unit;
    f.tokens = v == 0 ? batch.tokens : nullptr;
    f.targets = v == last_stage_ ? batch.targets : nullptr;
    f.input = v > 0 ? &in : nullptr;
    cai_activation* out = nullptr;
    f.output = &out;
    double loss = 0;
    f.loss = &loss;
    f.split_backward = zbv_;
    const Clock::time_point start = Clock::now();
    Check(Host().model->stage_forward(model_, &f));
    busy_s_ += std::chrono::duration<double>(Clock::now() - start).count();
    if (v == last_stage_) {
      last_forward_[op.mb] = last_forward_count_++;
      if (batch.loss) *batch.loss = loss;
      return loss * batch.loss_weight;
    }
    int64_t shape[3];
    BoundaryShape(*batch.tokens, shape);
    SendOrHandOver(true, op.mb, v + 1, ToWire(out, shape), shape);
    activations_[{op.mb, op.chunk}] = out;
    return 0;
  }

  void Backward(const Op& op, const cai_micro_batch& batch) {
    const int32_t v = VirtualStage(op.chunk);
    cai_stage_backward_args b{};
    b.struct_size = CAI_STAGE_BACKWARD_ARGS_STRUCT_SIZE;
    Pending grad_out;
    cai_tensor gout{};
    cai_activation* act = nullptr;
    if (v == last_stage_) {
      auto it = last_forward_.find(op.mb);
      b.micro_batch = it->second;
      if (zbv_) last_weights_[op.mb] = it->second;
      last_forward_.erase(it);
      // The micro-batch's share of the global batch, and fp16's loss scale.
      b.loss_scale = batch.loss_weight * epilogue_->loss_scale();
    } else {
      grad_out = TakeRecv(op);
      gout = Tensor3(grad_out.buffer, grad_out.shape);
      b.grad_output = &gout;
      auto it = activations_.find({op.mb, op.chunk});
      act = it->second;
      activations_.erase(it);
      b.activation = act;
    }
    int64_t shape[3];
    BoundaryShape(*batch.tokens, shape);
    Buffer grad_in;
    cai_tensor gin{};
    if (v > 0) {
      grad_in = sdk::AllocFlat(CAI_MEM_DEVICE, Elements(shape), wire_dtype_, "pipeline.send");
      gin = Tensor3(grad_in, shape);
      b.grad_input = &gin;
    }
    const Clock::time_point start = Clock::now();
    cai_status* status = Host().model->stage_backward(model_, &b);
    busy_s_ += std::chrono::duration<double>(Clock::now() - start).count();
    if (zbv_ && status == nullptr) {
      awaiting_weights_[{op.mb, op.chunk}] = act;  // released after its weight pass
    } else if (act) {
      Host().model->activation_release(act);
    }
    Check(status);
    if (v > 0) SendOrHandOver(false, op.mb, v - 1, std::move(grad_in), shape);
  }

  // The weight-gradient pass of a split backward (zbv).
  void Weights(const Op& op) {
    auto it = awaiting_weights_.find({op.mb, op.chunk});
    cai_stage_backward_weights_args w{};
    w.struct_size = CAI_STAGE_BACKWARD_WEIGHTS_ARGS_STRUCT_SIZE;
    w.activation = it->second;
    if (!w.activation) {
      auto last = last_weights_.find(op.mb);
      w.micro_batch = last->second;
      last_weights_.erase(last);
    }
    awaiting_weights_.erase(it);
    const Clock::time_point start = Clock::now();
    cai_status* status = Host().model->stage_backward_weights(model_, &w);
    busy_s_ += std::chrono::duration<double>(Clock::now() - start).count();
    if (w.activation) Host().model->activation_release(w.activation);
    Check(status);
  }

  // What virtual stage `to` receives from this rank (an activation when `forward`, else a
  // gradient): sent, or, where this rank runs `to` too (zbv's turn of the V), handed over as
  // an already received buffer.
  void SendOrHandOver(bool forward, int32_t mb, int32_t to, Buffer buffer, const int64_t* shape) {
    if (RankOf(to) != pp_rank_) {
      Send(std::move(buffer), shape, RankOf(to), Tag(forward ? 0 : 1, mb, to));
      return;
    }
    Pending& p = recvs_[std::make_tuple(forward, mb, ChunkOf(to))];
    p.buffer = std::move(buffer);
    std::copy(shape, shape + 3, p.shape);
  }

  // Virtual stages: chunk c of pipeline rank r runs c·pp + r (1F1B, interleaved), or r and
  // 2·pp − 1 − r (zbv's V).
  int32_t VirtualStage(int32_t chunk) const {
    return zbv_ ? ZbvStage(pp_, pp_rank_, chunk) : chunk * pp_ + pp_rank_;
  }
  int32_t RankOf(int32_t v) const { return RankOf(v, pp_, zbv_); }
  int32_t ChunkOf(int32_t v) const { return zbv_ ? (v >= pp_ ? 1 : 0) : v / pp_; }

  // The tied parameters' gradients summed over the pipeline ranks that use them.
  void SumSharedGrads() {
    for (const Shared& s : shared_) {
      for (uint32_t p : s.params) {
        cai_tensor grad{};
        cai_status* missing = Host().model->param_grad(model_, p, &grad);
        if (missing) {  // no gradient here this step: contribute zeros
          Host().status_destroy(missing);
          throw Error(CAI_FAILED_PRECONDITION,
                      "hybrid_parallel: parameter '" + std::string(sdk::ParamInfo(model_, p).name) +
                          "', shared between pipeline stages, got no gradient on pipeline rank " +
                          std::to_string(pp_rank_));
        }
        sdk::RunCollective(CAI_COMM_ALL_REDUCE, nullptr, grad, false, CAI_REDUCE_SUM, s.group);
      }
    }
  }

  // Configuration.
  const int32_t world_rank_, world_;
  int32_t tp_ = 1, pp_ = 1, dp_ = 1, sp_ = 1, tp_rank_ = 0, pp_rank_ = 0, dp_rank_ = 0,
          sp_rank_ = 0;
  bool parallel_output_ = true;
  bool sequence_parallel_ = false;  // split_gather or ring
  bool ring_ = false;               // ring
  int32_t sp_mode_ = 0;             // cai_sequence_parallel_mode; 0: none or split_gather
  uint64_t kernels_ = 0;            // CAI_MODEL_KERNEL_*
  std::string ckpt_layers_text_;
  double ckpt_ratio_ = 0;
  int64_t vocab_divisible_by_ = 64;
  bool interleaved_ = false;
  bool zbv_ = false;
  int32_t chunks_ = 1;
  int64_t num_microbatches_ = 0, microbatch_size_ = 0;
  std::string layers_per_stage_text_;
  int zero_stage_ = 0;
  bool overlap_p2p_ = true;
  double max_norm_ = 0;
  sdk::BucketReducer::Options ddp_options_;
  sdk::ZeroOptimizer::Options zero_options_;
  cai_loss_scaler_config scaler_config_{};

  // Boost.
  cai_model* model_ = nullptr;
  cai_optimizer* optimizer_ = nullptr;
  cai_precision precision_ = CAI_PRECISION_FP32;
  cai_dtype wire_dtype_ = sdk::kFloat32;
  int32_t microbatches_ = 1;
  int32_t last_stage_ = 0;             // the last virtual stage
  int64_t hidden_ = 0;                 // activation width between stages
  std::vector<Stage> stages_;          // this rank's chunks, in chunk order
  std::vector<Op> schedule_;           // this rank's operations in one execute_pipeline
  std::vector<uint8_t> needed_;        // per model parameter: this rank holds it
  std::vector<uint8_t> counted_;       // per model parameter: this rank counts and writes it
  std::vector<uint32_t> not_counted_;  // held here, counted by another pipeline rank
  std::vector<Shared> shared_;
  std::vector<cai_comm_group*> groups_;  // every group this rank created (NULL: not a member)
  cai_comm_group* tp_group_ = nullptr;
  cai_comm_group* sp_group_ = nullptr;  // all_to_all, ring_attn
  cai_comm_group* pp_group_ = nullptr;
  cai_comm_group* dp_group_ = nullptr;
  std::optional<sdk::DataParallelReplica> replica_;  // zero_stage 0
  std::optional<sdk::ZeroOptimizer> zero_;           // zero_stage 1, 2
  std::optional<sdk::StepEpilogue> epilogue_;
  std::optional<sdk::TensorParallelIo> tp_io_;  // tp_size > 1: checkpoints in the whole shapes

  // Per step.
  bool no_sync_ = false;
  std::map<std::tuple<bool, int32_t, int32_t>, Pending> recvs_;  // (forward, mb, chunk)
  std::deque<Pending> sends_;
  std::map<std::pair<int32_t, int32_t>, cai_activation*> activations_;  // (mb, chunk)
  std::map<int32_t, int32_t> last_forward_;  // mb -> the model's last-stage forward number
  // zbv: back-propagated stages awaiting their weight pass, (mb, chunk) -> activation (NULL:
  // the last stage, whose forward number last_weights_ keeps).
  std::map<std::pair<int32_t, int32_t>, cai_activation*> awaiting_weights_;
  std::map<int32_t, int32_t> last_weights_;
  int32_t last_forward_count_ = 0;
  mutable std::map<std::tuple<int64_t, int64_t, int64_t>, std::array<int64_t, 3>> strides_;
  double busy_s_ = 0, pipeline_s_ = 0;
  int64_t steps_ = 0;
};

}  // namespace

CAI_PLUGIN(HybridParallel)
