// cai SDK: the ZeRO stage 1 and 2 partitioned optimizer (Rajbhandari et al., "ZeRO", SC'20) over
// any communicator group, as ColossalAI's LowLevelZeroOptimizer: every rank of the group keeps
// the whole model in the compute dtype, and owns one even, padded slice of the gradients, the
// fp32 master weights and the optimizer state.
//
// Layout. The given trainable parameters are laid out in the order backward finishes them and
// cut into buckets of at most bucket_cap elements. Each bucket is padded to a multiple of the
// group size N and split into N equal chunks; group rank r owns chunk r of every bucket (as
// Megatron-LM's distributed optimizer does), so one bucket is one reduce-scatter and one
// all-gather with no copy. A bucket may hold parameters of several optimizer groups: the update
// runs per run of same-group pieces.
//
// What moves, in order:
//  construction  fp32 masters of this rank's chunks (bf16/fp16, or cpu_offload) read from the
//            model, which is then cast to the compute dtype and re-homed into one flat buffer
//            in bucket layout; optimizer state of the chunks; a GRAD_READY hook.
//  backward  stage 1: .grad is a view of a full flat gradient buffer; without a reduction
//            (no_sync) gradients just accumulate there. In a reduced backward a bucket whose
//            gradients are all ready is reduce-scattered (SUM, asynchronously with
//            overlap_communication) into this rank's gradient shard, then the full buffer is
//            zeroed.
//            stage 2: each gradient, once ready, is copied into its bucket's staging buffer
//            and released at once; a full bucket is reduce-scattered into the shard and its
//            staging freed. Every backward is reduced (there is nowhere to keep a full
//            gradient): accumulating A micro-batches costs A reduce-scatters of Ψ per step,
//            and the shard accumulates in fp32.
//  step      LocalSums (Σ g² of the shard, overflow, used flags) → the owner's StepEpilogue
//            agrees on them → Apply: fused update of this rank's chunks (master → 16-bit copy
//            fused) → all-gather of each bucket in place (asynchronously with
//            overlap_allgather, waited before the next forward, evaluation or checkpoint).
//
// SUM: the host weights each micro-batch's loss by its share of the global batch
// (cai_micro_batch.loss_weight), so the global-batch gradient is the sum of the local ones.
//
// Per-rank memory (Ψ the parameters given, N the group size, k optimizer state slots, e = 4
// fp32 / 2 bf16,fp16, shard S = Σ ceil(bucket/N) ≤ Ψ/N + buckets): parameters eΨ + gradients
// (stage 1: eΨ full + S shard; stage 2: S shard + the staging of at most kMaxInFlight + 1
// consecutive buckets) + masters 4S (bf16/fp16 or cpu_offload) + state 4kS. With cpu_offload
// masters and state live on the host tier; the host's fused CPU optimizer updates them from a
// pinned copy of the gradient shard. EstimateMemory replays this for a layout.
//
// Not thread-safe; the grad-ready hook runs while the owner waits in the model's backward.
#ifndef CAI_SDK_ZERO_HPP_
#define CAI_SDK_ZERO_HPP_

#include <algorithm>
#include <deque>
#include <span>
#include <string>
#include <vector>

#include "cai/sdk.hpp"
#include "cai/sdk/collectives.hpp"
#include "cai/sdk/flat.hpp"
#include "cai/sdk/overlap.hpp"
#include "cai/sdk/step.hpp"

namespace cai::sdk {

class ZeroOptimizer {
 public:
  struct Options {
    int stage = 1;
    size_t bucket_cap = size_t{12} << 20;  // elements per bucket
    bool overlap_communication = true;     // reduce-scatter during backward
    bool overlap_allgather = false;        // all-gather after step, waited before next use
    bool cpu_offload = false;              // masters and optimizer state on the host tier
    bool master_weights = true;            // bf16/fp16: keep fp32 masters of the shard
    cai_precision precision = CAI_PRECISION_FP32;
    cai_dtype comm_dtype = kFloat32;       // dtype gradients are reduced in
    int32_t grad_accumulation = 1;         // micro-batches per step (stage 2 accumulates in fp32)
    cai_comm_group* group = nullptr;       // NULL: the world
    std::string owner = "low_level_zero";  // names the strategy in errors and logs
  };

  // Takes charge of `params` (trainable, owned — see OwnedParams — in registration order),
  // whose values must already agree across the group. Casts the model to the compute dtype.
  ZeroOptimizer(cai_model* model, cai_optimizer* optimizer, std::span<const uint32_t> params,
                const Options& options)
      : model_(model),
        optimizer_(optimizer),
        o_(options),
        rank_(GroupRank(options.group)),
        size_(GroupSize(options.group)),
        mixed_(options.precision != CAI_PRECISION_FP32),
        compute_dtype_(ComputeDtype(options.precision)) {
    if (o_.cpu_offload && !o_.master_weights) {
      throw Error(CAI_INVALID_ARGUMENT,
                  o_.owner +
                      ": cpu_offload keeps fp32 master weights on the host; it cannot "
                      "run with master_weights = false. Set one of them to its default");
    }
    if (o_.bucket_cap == 0) {
      throw Error(CAI_INVALID_ARGUMENT, o_.owner + ": a bucket must hold at least one element");
    }
    // Several reductions a step accumulate into an fp32 shard (the kernels add into fp32 only).
    shard_grad_dtype_ = o_.stage == 2 && o_.grad_accumulation > 1 ? kFloat32 : o_.comm_dtype;
    PlanLayout(params);

    // fp32 masters of this rank's pieces, read straight from the (fp32) model.
    const cai_mem_tier state_tier = o_.cpu_offload ? CAI_MEM_HOST : CAI_MEM_DEVICE;
    if ((mixed_ && o_.master_weights) || o_.cpu_offload) {
      master_ = AllocFlat(state_tier, shard_, kFloat32, "zero.master");
      for (const Segment& g : segments_) {
        cai_tensor data{};
        Check(Host().model->param_data(model_, layout_[g.slot].param, &data));
        int64_t n = static_cast<int64_t>(g.numel), unit = 1;
        cai_tensor src = data;  // parameters are contiguous at boost
        src.data = static_cast<char*>(data.data) + data.byte_offset + g.param_offset * 4;
        src.byte_offset = 0;
        src.ndim = 1;
        src.shape = &n;
        src.strides = &unit;
        RunKernel(CAI_KERNEL_COPY, &src, FlatView(master_, kFloat32, g.shard_offset, &n));
      }
    }

    // The model computes on views of one flat buffer in bucket layout (padding zero).
    if (mixed_) Check(Host().model->set_compute_dtype(model_, compute_dtype_));
    params_ = AllocFlat(CAI_MEM_DEVICE, layout_.numel(), compute_dtype_, "zero.param");
    CopyParamsInto(model_, layout_, params_, compute_dtype_);
    PointParamsAt(model_, layout_, params_, compute_dtype_);
    if (o_.stage == 1) {
      full_grads_ = AllocFlat(CAI_MEM_DEVICE, layout_.numel(), compute_dtype_, "zero.grad");
      PointGradsAt(model_, layout_, full_grads_, compute_dtype_);
    }
    grad_shard_ = AllocFlat(CAI_MEM_DEVICE, shard_, shard_grad_dtype_, "zero.grad");
    optim_ = FlatOptimizer(optimizer_, shard_, state_tier, "zero.optim_state");
    if (o_.cpu_offload) {
      // The CPU update reads the gradient shard and writes the 16-bit parameters through
      // pinned copies, which are what moves over PCIe on an accelerator.
      pinned_grad_ = AllocFlat(CAI_MEM_PINNED_HOST, shard_, shard_grad_dtype_, "zero.offload_grad");
      if (mixed_) {
        pinned_param_ =
            AllocFlat(CAI_MEM_PINNED_HOST, shard_, compute_dtype_, "zero.offload_param");
        int64_t n = static_cast<int64_t>(shard_);
        cai_tensor master = FlatView(master_, kFloat32, 0, &n);
        RunKernel(CAI_KERNEL_COPY, &master, FlatView(pinned_param_, compute_dtype_, 0, &n));
      }
    }
    local_used_.assign(layout_.size(), 0);
    ready_.assign(layout_.size(), 0);
    hook_id_ = OnEveryGradReady(model_, &ZeroOptimizer::OnGradReadyHook, this);
  }
  ZeroOptimizer(const ZeroOptimizer&) = delete;
  ZeroOptimizer& operator=(const ZeroOptimizer&) = delete;
  ~ZeroOptimizer() {
    // Collectives still in flight write into our buffers: finish them before those go.
    gathers_.clear();
    flights_.clear();
    if (hook_id_) Host().status_destroy(Host().model->remove_hook(model_, hook_id_));
  }

  // "stage 1, 12 trainable tensors, ... this rank owns S elements of T (padded) on N ranks".
  std::string Describe() const {
    return "stage " + std::to_string(o_.stage) + ", " + std::to_string(layout_.size()) +
           " trainable tensors, " + std::to_string(numel_) + " elements in " +
           std::to_string(buckets_.size()) + " buckets; this rank owns " + std::to_string(shard_) +
           " elements of " + std::to_string(layout_.numel()) + " (padded) on " +
           std::to_string(size_) + " ranks" +
           (o_.cpu_offload ? ", masters and state offloaded to the host" : "");
  }

  // Before a forward (or evaluation, or checkpoint): the updated parameters are in place.
  void WaitGathers() {
    for (Work& w : gathers_) w.Wait();
    gathers_.clear();
  }

  // Around one backward. `reduce` false (no_sync) accumulates locally under stage 1; stage 2
  // reduces every backward regardless.
  void BeginBackward(bool reduce) {
    WaitGathers();
    in_reduced_backward_ = o_.stage == 2 || reduce;
    if (in_reduced_backward_) BeginReduction();
  }
  void EndBackward() {
    if (in_reduced_backward_) {
      in_reduced_backward_ = false;
      FinishReduction();
    } else {
      unreduced_ = true;
    }
  }

  // This rank's part of the step's agreement: Σ g² of its gradient shard (the shards
  // partition the gradient, so the group's sum is the global one; padding is zero), overflow
  // under loss scaling, and which of `num_params` model parameters got a gradient here.
  // Reduces first what no_sync left unreduced.
  StepSums LocalSums(uint32_t num_params, bool check_overflow) {
    if (unreduced_ || reductions_ == 0) {
      BeginReduction();
      FinishReduction();
    }
    StepSums sums;
    int64_t n = static_cast<int64_t>(shard_);
    const cai_tensor grads = FlatView(grad_shard_, shard_grad_dtype_, 0, &n);
    RunKernel(CAI_KERNEL_SUM_SQUARES, nullptr, grads, 0, &sums.sum_squares);
    if (check_overflow) {
      double ok = 0;
      RunKernel(CAI_KERNEL_ALL_FINITE, nullptr, grads, 0, &ok);
      sums.overflow = ok != 1.0;
    }
    sums.used.assign(num_params, 0);
    for (size_t s = 0; s < layout_.size(); ++s) sums.used[layout_[s].param] = local_used_[s];
    return sums;
  }

  // Σ g² of this rank's pieces of the given model parameters' reduced gradients: what to take
  // off LocalSums' for parameters another rank counts (a pipeline's tied embedding). Call after
  // LocalSums.
  double SumSquaresOf(std::span<const uint32_t> params) const {
    double total = 0;
    for (const Segment& g : segments_) {
      if (std::find(params.begin(), params.end(), layout_[g.slot].param) == params.end()) continue;
      int64_t n = static_cast<int64_t>(g.numel);
      double sq = 0;
      RunKernel(CAI_KERNEL_SUM_SQUARES, nullptr,
                FlatView(grad_shard_, shard_grad_dtype_, g.shard_offset, &n), 0, &sq);
      total += sq;
    }
    return total;
  }

  // Updates this rank's chunks as decided (`used`: the agreed flags of LocalSums; a
  // parameter no rank produced a gradient for is not updated, as in torch.optim) and
  // all-gathers the buckets.
  void Apply(const StepDecision& d, const std::vector<double>& used) {
    if (d.skipped) return;
    update_.resize(layout_.size());
    for (size_t s = 0; s < layout_.size(); ++s) update_[s] = used[layout_[s].param] > 0;
    if (o_.cpu_offload) {
      Check(Host().mempool->copy(pinned_grad_.data(), grad_shard_.data(), grad_shard_.size(),
                                 nullptr));
    }
    for (size_t b = 0; b < buckets_.size(); ++b) {
      UpdateBucket(b, d);
      Gather(b);
    }
    if (!o_.overlap_allgather) WaitGathers();
  }

  void ZeroGrad() {
    // Gradients accumulated under no_sync and never stepped are dropped as asked.
    if (o_.stage == 1 && unreduced_) {
      int64_t n = static_cast<int64_t>(layout_.numel());
      RunKernel(CAI_KERNEL_FILL, nullptr, FlatView(full_grads_, compute_dtype_, 0, &n), 0);
    }
    if (o_.stage == 2) {
      for (const FlatSlot& s : layout_.slots()) Check(Host().model->release_grad(model_, s.param));
    }
    std::fill(local_used_.begin(), local_used_.end(), 0);
    unreduced_ = false;
    reductions_ = 0;
  }

  // The canonical full layout, so a checkpoint saved on N ranks loads on M and under any
  // strategy: "model/<name>" fp32 in the parameter's shape and "optim/<name>/<slot>" fp32
  // flat. Sharded values are all-gathered one bucket at a time; the ranks with `writer` set
  // write those of the parameters `writes` accepts (all by default). Collective over the group.
  template <class Writes = bool (*)(uint32_t)>
  void Save(
      const cai_checkpoint_args& args, bool writer, Writes writes = [](uint32_t) { return true; },
      const ParamIo& io = DirectIo()) {
    WaitGathers();
    if (args.model) {
      if (master_.get()) {
        ForEachGathered(master_, [&](const Buffer& full, size_t b) {
          for (size_t s = buckets_[b].first_slot; s < buckets_[b].end_slot && writer; ++s) {
            if (writes(layout_[s].param)) {
              WriteModelTensor(args.checkpoint, full, kFloat32, buckets_[b].offset, s, io);
            }
          }
        });
      } else if (writer) {
        // Without masters the full parameters are the weights (fp32, or the 16-bit values
        // master_weights = false trains).
        for (size_t s = 0; s < layout_.size(); ++s) {
          if (writes(layout_[s].param)) {
            WriteModelTensor(args.checkpoint, params_, compute_dtype_, 0, s, io);
          }
        }
      }
    }
    if (args.optimizer) {
      for (size_t k = 0; k < optim_.num_slots(); ++k) {
        ForEachGathered(optim_.state(k), [&](const Buffer& full, size_t b) {
          if (!writer) return;
          for (size_t s = buckets_[b].first_slot; s < buckets_[b].end_slot; ++s) {
            if (k >= optim_.SlotsOf(layout_[s].group) || !writes(layout_[s].param)) continue;
            int64_t n = layout_[s].numel;
            io.Write(args.checkpoint, OptimStateName(layout_[s].name, static_cast<uint32_t>(k)),
                     layout_[s].param,
                     FlatView(full, kFloat32, layout_[s].offset - buckets_[b].offset, &n), {});
          }
        });
      }
    }
  }

  // Every rank reads the full parameters and just its own pieces of masters and state, at
  // whatever world size the checkpoint was written.
  void Load(const cai_checkpoint_args& args, const ParamIo& io = DirectIo()) {
    WaitGathers();
    if (args.model) {
      for (size_t s = 0; s < layout_.size(); ++s) {
        io.Read(args.checkpoint, "model/" + layout_[s].name, layout_[s].param, 0, 0,
                layout_.View(params_, compute_dtype_, s));
      }
      if (master_.get()) {
        for (const Segment& g : segments_) {
          int64_t n = static_cast<int64_t>(g.numel);
          io.Read(args.checkpoint, "model/" + layout_[g.slot].name, layout_[g.slot].param,
                  static_cast<int64_t>(g.param_offset), n,
                  FlatView(master_, kFloat32, g.shard_offset, &n));
        }
        if (pinned_param_.get()) {
          int64_t n = static_cast<int64_t>(shard_);
          cai_tensor master = FlatView(master_, kFloat32, 0, &n);
          RunKernel(CAI_KERNEL_COPY, &master, FlatView(pinned_param_, compute_dtype_, 0, &n));
        }
      }
    }
    if (args.optimizer) {
      for (const Segment& g : segments_) {
        const FlatSlot& s = layout_[g.slot];
        for (uint32_t k = 0; k < optim_.SlotsOf(s.group); ++k) {
          int64_t n = static_cast<int64_t>(g.numel);
          io.Read(args.checkpoint, OptimStateName(s.name, k), s.param,
                  static_cast<int64_t>(g.param_offset), n, optim_.View(k, g.shard_offset, &n));
        }
      }
    }
  }

  // Adds what this optimizer holds to `stats`.
  void AddStats(cai_strategy_stats& stats) const {
    stats.param_bytes += params_.size() + pinned_param_.size();
    stats.grad_bytes += full_grads_.size() + grad_shard_.size() + pinned_grad_.size();
    stats.optimizer_state_bytes += optim_.bytes();
    stats.master_bytes += master_.size();
  }

  // What a ZeroOptimizer over parameters of `numel` elements (registration order, as the
  // constructor takes them) on `group_size` ranks holds per rank, with `state_slots` fp32
  // optimizer state slots per element, its owner's step agreement all-reducing `flags_bytes`
  // (StepEpilogue::AgreementBytes): its
  // buffers, and the most each tier's pool holds at once over construction, steps and a
  // checkpoint.
  // Exact when gradients become ready bucket by bucket (a tied weight's a bucket early
  // included); o.grad_accumulation > 1 adds stage 2's fp32 shard and reduced-chunk buffers.
  struct Memory {
    uint64_t params = 0, grads = 0, masters = 0, state = 0;  // held throughout
    uint64_t transient = 0;  // the device's largest passing buffers (staging, flags, checkpoint)
    uint64_t device = 0;     // peak
    uint64_t host = 0;       // peak of the host tiers (cpu_offload), pinned copies included
    // Into estimate_memory's answer (`formula` left alone): the passing buffers count as
    // gradients.
    void Fill(cai_memory_estimate& out) const {
      out.param_bytes = params;
      out.grad_bytes = grads + transient;
      out.master_bytes = masters;
      out.optimizer_state_bytes = state;
      out.device_bytes = device;
      out.host_bytes = host;
    }
  };
  static Memory EstimateMemory(std::span<const int64_t> numel, int32_t group_size, const Options& o,
                               uint32_t state_slots, uint64_t flags_bytes) {
    const uint64_t n = static_cast<uint64_t>(std::max(group_size, 1));
    const std::vector<int64_t> backward(numel.rbegin(), numel.rend());
    std::vector<uint64_t> chunk;
    size_t i = 0;
    for (const size_t end : BucketEnds(backward, o.bucket_cap)) {
      uint64_t sum = 0;
      for (; i < end; ++i) sum += static_cast<uint64_t>(backward[i]);
      chunk.push_back((sum + n - 1) / n);
    }
    uint64_t shard = 0, largest = 0;
    for (const uint64_t c : chunk) {
      shard += c;
      largest = std::max(largest, c);
    }
    const bool mixed = o.precision != CAI_PRECISION_FP32;
    const cai_dtype compute = ComputeDtype(o.precision);
    const uint64_t e = ElementSize(compute), c = ElementSize(o.comm_dtype);
    const bool accumulates = o.stage == 2 && o.grad_accumulation > 1;
    const uint64_t g = accumulates ? 4 : c;  // the gradient shard's element
    Memory m;
    m.params = e * shard * n;
    m.grads = (o.stage == 1 ? e * shard * n : 0) + g * shard;
    m.masters = (mixed && o.master_weights) || o.cpu_offload ? 4 * shard : 0;
    m.state = 4ull * state_slots * shard;
    // Staged buckets: at most kMaxInFlight + 1 consecutive ones, each with its reduced chunk's
    // buffer when reductions accumulate.
    uint64_t window = 0;
    if (o.stage == 2 || !SameDtype(o.comm_dtype, compute)) {
      const size_t w = std::min(kMaxInFlight + 1, chunk.size());
      for (size_t b = 0; b + w <= chunk.size(); ++b) {
        uint64_t sum = 0;
        for (size_t j = b; j < b + w; ++j) {
          sum += c * chunk[j] * n + (accumulates ? c * chunk[j] : 0);
        }
        window = std::max(window, sum);
      }
    }
    const uint64_t transient_master = mixed && !o.master_weights ? 4 * largest : 0;
    const uint64_t checkpoint = m.masters > 0 || state_slots > 0 ? 4 * largest * n : 0;
    m.transient = std::max({window, flags_bytes, transient_master, checkpoint});
    const uint64_t states = m.masters + m.state;
    m.device = m.params + m.grads + (o.cpu_offload ? 0 : states) + m.transient;
    m.host = o.cpu_offload ? states + g * shard + (mixed ? e * shard : 0) : 0;
    return m;
  }

  // Share of the gradient reductions' windows that compute covered (OverlapMeter): 0 without
  // overlap_communication, where every reduce-scatter runs synchronously after backward.
  double overlap_ratio() const { return overlap_.ratio(); }

 private:
  // Buckets whose gradients are staged (stage 2, or a communication dtype other than the
  // compute dtype) keep at most this many reductions in flight: the oldest is waited for before
  // a further one starts, and before a bucket more than this many ahead of it starts collecting
  // (a tied weight's gradient can be ready a bucket early). Staging then lies within
  // kMaxInFlight + 1 consecutive buckets, which bounds gradient memory beyond the shard.
  static constexpr size_t kMaxInFlight = 2;

  // ColossalAI's bucket rule over parameters in backward order (`numel`): a parameter that
  // would overflow the bucket starts a new one. Each bucket's end (exclusive) in `numel`.
  static std::vector<size_t> BucketEnds(std::span<const int64_t> numel, size_t cap) {
    std::vector<size_t> ends;
    size_t filled = 0;
    for (size_t i = 0; i < numel.size(); ++i) {
      const auto n = static_cast<size_t>(numel[i]);
      if (filled > 0 && filled + n > cap) {
        ends.push_back(i);
        filled = 0;
      }
      filled += n;
    }
    ends.push_back(numel.size());
    return ends;
  }

  // Slots [first_slot, end_slot), padded to `chunk` elements per rank.
  struct Bucket {
    size_t first_slot = 0, end_slot = 0;
    size_t offset = 0;        // elements into the full buffers
    size_t numel = 0;         // unpadded
    size_t chunk = 0;         // elements each rank owns: ceil(numel / N)
    size_t shard_offset = 0;  // where this rank's chunk starts in its shard
  };
  // The piece of a parameter that lies in this rank's chunk of its bucket.
  struct Segment {
    size_t slot;
    size_t bucket;
    size_t param_offset;  // elements into the parameter
    size_t shard_offset;  // elements into this rank's shard
    size_t numel;
  };
  // A bucket's reduce-scatter in flight and where its result goes.
  struct Flight {
    size_t bucket;
    Buffer staging;  // the bucket's gradients in comm dtype (none: reduced from full_grads_)
    Buffer out;      // the reduced chunk before it is added (none: written into the shard)
    bool accumulate;
    Work work;
  };

  // Buckets in backward order, their padding, and this rank's pieces of each parameter.
  void PlanLayout(std::span<const uint32_t> params) {
    if (params.empty()) {
      throw Error(CAI_FAILED_PRECONDITION,
                  o_.owner +
                      ": the model has no trainable parameters; unfreeze some "
                      "(model.freeze)");
    }
    const size_t n = static_cast<size_t>(size_);
    std::vector<int64_t> numel(params.size());  // backward order
    for (size_t i = 0; i < params.size(); ++i) {
      numel[i] = ParamInfo(model_, params[params.size() - 1 - i]).numel;
    }
    size_t i = 0;
    for (const size_t end : BucketEnds(numel, o_.bucket_cap)) {
      Bucket& b = buckets_.emplace_back();
      b.first_slot = layout_.size();
      b.offset = layout_.numel();
      for (; i < end; ++i) {
        bucket_of_slot_.push_back(buckets_.size() - 1);
        layout_.Add(model_, params[params.size() - 1 - i]);
        b.numel += static_cast<size_t>(numel[i]);
      }
      b.end_slot = layout_.size();
      b.chunk = (b.numel + n - 1) / n;
      layout_.Pad(b.chunk * n - b.numel);
    }
    const size_t r = static_cast<size_t>(rank_);
    for (Bucket& b : buckets_) {
      b.shard_offset = shard_;
      shard_ += b.chunk;
      numel_ += b.numel;
      const size_t lo = b.offset + r * b.chunk, hi = lo + b.chunk;
      for (size_t s = b.first_slot; s < b.end_slot; ++s) {
        const size_t begin = std::max(lo, layout_[s].offset);
        const size_t end = std::min(hi, layout_[s].offset + static_cast<size_t>(layout_[s].numel));
        if (begin >= end) continue;
        segments_.push_back({s, static_cast<size_t>(&b - buckets_.data()),
                             begin - layout_[s].offset, b.shard_offset + (begin - lo),
                             end - begin});
      }
    }
  }

  // ---- Reduction: armed before a reduced backward, driven by GRAD_READY ---------------------

  void BeginReduction() {
    std::fill(ready_.begin(), ready_.end(), 0);
    pending_.assign(buckets_.size(), 0);
    for (size_t b = 0; b < buckets_.size(); ++b) {
      pending_[b] = buckets_[b].end_slot - buckets_[b].first_slot;
    }
    staging_.clear();
    staging_.resize(buckets_.size());
    top_ = 0;
    next_launch_ = 0;
    overlap_.Discard();
  }

  static cai_status* OnGradReadyHook(void* self, const cai_hook_event* event) {
    return Guard([&] { static_cast<ZeroOptimizer*>(self)->OnGradReady(event->param); });
  }

  void OnGradReady(int32_t param) {
    if (param < 0) return;
    const int32_t slot = layout_.SlotOf(static_cast<uint32_t>(param));
    if (slot < 0) return;
    local_used_[slot] = 1;
    if (!in_reduced_backward_ || ready_[slot]) return;
    MarkReady(static_cast<size_t>(slot));
    if (o_.overlap_communication) LaunchReadyBuckets();
  }

  // The slot's gradient is final for this reduction. Stage 2 moves it into its bucket's
  // staging buffer (zero where the parameter got no gradient) and frees the model's copy.
  void MarkReady(size_t slot) {
    const FlatSlot& s = layout_[slot];
    const size_t b = bucket_of_slot_[slot];
    if (o_.stage == 2) {
      Buffer& staging = staging_[b];
      if (!staging.get()) {
        top_ = std::max(top_, b);
        while (!flights_.empty() && flights_.front().bucket + kMaxInFlight < top_) Complete();
        staging =
            AllocFlat(CAI_MEM_DEVICE, buckets_[b].chunk * size_, o_.comm_dtype, "zero.bucket");
      }
      cai_tensor grad{};
      cai_status* missing = Host().model->param_grad(model_, s.param, &grad);
      if (missing) {
        Host().status_destroy(missing);
      } else {
        int64_t n = s.numel;
        RunKernel(CAI_KERNEL_COPY, &grad,
                  FlatView(staging, o_.comm_dtype, s.offset - buckets_[b].offset, &n));
        Check(Host().model->release_grad(model_, s.param));
      }
    }
    ready_[slot] = 1;
    --pending_[b];
  }

  void LaunchReadyBuckets() {
    while (next_launch_ < buckets_.size() && pending_[next_launch_] == 0) Launch(next_launch_++);
  }

  // Reduce-scatters bucket b into this rank's gradient shard: straight into it on the step's
  // first reduction (when dtypes agree), else through `out` and an add.
  void Launch(size_t b) {
    const Bucket& bucket = buckets_[b];
    Flight f;
    f.bucket = b;
    f.accumulate = reductions_ > 0;
    int64_t whole = static_cast<int64_t>(bucket.chunk * size_);
    int64_t chunk = static_cast<int64_t>(bucket.chunk);
    if (o_.stage == 2) {
      f.staging = std::move(staging_[b]);
    } else if (!SameDtype(o_.comm_dtype, compute_dtype_)) {
      f.staging = AllocFlat(CAI_MEM_DEVICE, bucket.chunk * size_, o_.comm_dtype, "zero.bucket");
      cai_tensor full = FlatView(full_grads_, compute_dtype_, bucket.offset, &whole);
      RunKernel(CAI_KERNEL_COPY, &full, FlatView(f.staging, o_.comm_dtype, 0, &whole));
    }
    const cai_tensor input = f.staging.get()
                                 ? FlatView(f.staging, o_.comm_dtype, 0, &whole)
                                 : FlatView(full_grads_, compute_dtype_, bucket.offset, &whole);
    cai_tensor output{};
    if (!f.accumulate && SameDtype(o_.comm_dtype, shard_grad_dtype_)) {
      output = FlatView(grad_shard_, shard_grad_dtype_, bucket.shard_offset, &chunk);
    } else {
      f.out = AllocFlat(CAI_MEM_DEVICE, bucket.chunk, o_.comm_dtype, "zero.bucket");
      output = FlatView(f.out, o_.comm_dtype, 0, &chunk);
    }
    if (o_.overlap_communication) {
      overlap_.Launched();
      f.work =
          RunCollective(CAI_COMM_REDUCE_SCATTER, &input, output, true, CAI_REDUCE_SUM, o_.group);
    } else {
      overlap_.Wait([&] {
        f.work =
            RunCollective(CAI_COMM_REDUCE_SCATTER, &input, output, false, CAI_REDUCE_SUM, o_.group);
      });
    }
    const bool staged = f.staging.get() != nullptr;
    flights_.push_back(std::move(f));
    // Bounded gradient memory: finish the oldest reduction before starting more.
    while (staged && flights_.size() > kMaxInFlight) Complete();
  }

  // Waits for the oldest reduction and lands its result in the shard.
  void Complete() {
    Flight& f = flights_.front();
    overlap_.Wait([&] { f.work.Wait(); });
    if (f.out.get()) {
      const Bucket& bucket = buckets_[f.bucket];
      int64_t chunk = static_cast<int64_t>(bucket.chunk);
      cai_tensor out = FlatView(f.out, o_.comm_dtype, 0, &chunk);
      cai_tensor shard = FlatView(grad_shard_, shard_grad_dtype_, bucket.shard_offset, &chunk);
      RunKernel(f.accumulate ? CAI_KERNEL_AXPY : CAI_KERNEL_COPY, &out, shard, 1.0);
    }
    flights_.pop_front();
  }

  // After backward: the buckets that wait on parameters without gradient are completed and
  // launched, every reduction is waited for.
  void FinishReduction() {
    if (reductions_ > 0 && !SameDtype(shard_grad_dtype_, kFloat32)) {
      throw Error(CAI_FAILED_PRECONDITION,
                  o_.owner +
                      ": a second gradient reduction in one step, but boost was told of "
                      "no gradient accumulation (train.grad_accum); accumulate with "
                      "no_sync or declare the accumulation");
    }
    for (size_t slot = 0; slot < layout_.size(); ++slot) {
      if (!ready_[slot]) MarkReady(slot);
    }
    LaunchReadyBuckets();
    while (!flights_.empty()) Complete();
    overlap_.Completed();
    if (o_.stage == 1) {
      int64_t n = static_cast<int64_t>(layout_.numel());
      RunKernel(CAI_KERNEL_FILL, nullptr, FlatView(full_grads_, compute_dtype_, 0, &n), 0);
    }
    unreduced_ = false;
    ++reductions_;
  }

  // ---- Update and gather --------------------------------------------------------------------

  // One fused update per run of this bucket's segments that share a group and are updated.
  void UpdateBucket(size_t b, const StepDecision& d) {
    const Bucket& bucket = buckets_[b];
    const size_t chunk_start = bucket.offset + static_cast<size_t>(rank_) * bucket.chunk;
    const size_t e = ElementSize(compute_dtype_);
    // master_weights = false under bf16/fp16: the 16-bit values are updated through a
    // transient fp32 copy of this chunk.
    Buffer transient;
    if (mixed_ && !master_.get()) {
      transient = AllocFlat(CAI_MEM_DEVICE, bucket.chunk, kFloat32, "zero.transient_master");
      int64_t c = static_cast<int64_t>(bucket.chunk);
      cai_tensor lowp = FlatView(params_, compute_dtype_, chunk_start, &c);
      RunKernel(CAI_KERNEL_COPY, &lowp, FlatView(transient, kFloat32, 0, &c));
    }
    for (size_t i = 0; i < segments_.size();) {
      if (segments_[i].bucket != b || !update_[segments_[i].slot]) {
        ++i;
        continue;
      }
      size_t j = i + 1;
      const uint32_t group = layout_[segments_[i].slot].group;
      while (j < segments_.size() && segments_[j].bucket == b && update_[segments_[j].slot] &&
             layout_[segments_[j].slot].group == group &&
             segments_[j].shard_offset == segments_[j - 1].shard_offset + segments_[j - 1].numel) {
        ++j;
      }
      FlatOptimizer::Piece p;
      p.group = group;
      p.offset = segments_[i].shard_offset;
      p.count = segments_[j - 1].shard_offset + segments_[j - 1].numel - p.offset;
      const size_t in_chunk = p.offset - bucket.shard_offset;
      if (master_.get()) {
        p.param = static_cast<float*>(master_.data()) + p.offset;
      } else if (transient.get()) {
        p.param = static_cast<float*>(transient.data()) + in_chunk;
      } else {
        p.param = static_cast<float*>(params_.data()) + chunk_start + in_chunk;
      }
      p.grad = static_cast<const char*>((o_.cpu_offload ? pinned_grad_ : grad_shard_).data()) +
               p.offset * ElementSize(shard_grad_dtype_);
      p.grad_dtype = shard_grad_dtype_;
      if (mixed_) {
        p.lowp = o_.cpu_offload ? static_cast<char*>(pinned_param_.data()) + p.offset * e
                                : static_cast<char*>(params_.data()) + (chunk_start + in_chunk) * e;
        p.lowp_dtype = compute_dtype_;
      }
      optim_.Update(p, d.step, d.grad_scale);
      i = j;
    }
    if (o_.cpu_offload) {  // the updated chunk back to the device
      const Buffer& src = mixed_ ? pinned_param_ : master_;
      Check(Host().mempool->copy(static_cast<char*>(params_.data()) + chunk_start * e,
                                 static_cast<const char*>(src.data()) + bucket.shard_offset * e,
                                 bucket.chunk * e, nullptr));
    }
  }

  // All-gathers bucket b's updated chunks in place: chunk r is already where rank r's lands.
  void Gather(size_t b) {
    const Bucket& bucket = buckets_[b];
    int64_t whole = static_cast<int64_t>(bucket.chunk * size_);
    int64_t chunk = static_cast<int64_t>(bucket.chunk);
    const cai_tensor output = FlatView(params_, compute_dtype_, bucket.offset, &whole);
    const cai_tensor input = FlatView(
        params_, compute_dtype_, bucket.offset + static_cast<size_t>(rank_) * bucket.chunk, &chunk);
    gathers_.push_back(RunCollective(CAI_COMM_ALL_GATHER, &input, output, o_.overlap_allgather,
                                     CAI_REDUCE_SUM, o_.group));
  }

  // Calls fn(full, b) for each bucket with `shard` (fp32, shard layout) all-gathered into
  // `full` (bucket layout, bucket b only); collective.
  template <class F>
  void ForEachGathered(const Buffer& shard, F&& fn) {
    for (size_t b = 0; b < buckets_.size(); ++b) {
      const Bucket& bucket = buckets_[b];
      Buffer full = AllocFlat(CAI_MEM_DEVICE, bucket.chunk * size_, kFloat32, "zero.checkpoint");
      int64_t whole = static_cast<int64_t>(bucket.chunk * size_);
      int64_t chunk = static_cast<int64_t>(bucket.chunk);
      const cai_tensor input = FlatView(shard, kFloat32, bucket.shard_offset, &chunk);
      RunCollective(CAI_COMM_ALL_GATHER, &input, FlatView(full, kFloat32, 0, &whole), false,
                    CAI_REDUCE_SUM, o_.group);
      fn(full, b);
    }
  }

  // Writes slot s as fp32 in its shape from `base` (of `dtype`), whose element 0 is element
  // `base_offset` of the full layout.
  void WriteModelTensor(cai_checkpoint* checkpoint, const Buffer& base, cai_dtype dtype,
                        size_t base_offset, size_t s, const ParamIo& io) {
    int64_t n = layout_[s].numel;
    io.Write(checkpoint, "model/" + layout_[s].name, layout_[s].param,
             FlatView(base, dtype, layout_[s].offset - base_offset, &n), layout_[s].shape);
  }

  cai_model* model_;
  cai_optimizer* optimizer_;
  const Options o_;
  const int32_t rank_;  // in the group
  const int32_t size_;
  const bool mixed_;
  const cai_dtype compute_dtype_;
  cai_dtype shard_grad_dtype_ = kFloat32;
  uint64_t hook_id_ = 0;

  FlatLayout layout_;  // trainable parameters in backward order, buckets padded
  std::vector<size_t> bucket_of_slot_;
  std::vector<Bucket> buckets_;
  std::vector<Segment> segments_;  // this rank's pieces, in shard order
  size_t numel_ = 0;               // Ψ: parameter elements (unpadded)
  size_t shard_ = 0;               // elements this rank owns

  Buffer params_;        // full parameters, compute dtype, bucket layout: what the model reads
  Buffer full_grads_;    // stage 1: full gradients (.grad views), compute dtype
  Buffer grad_shard_;    // this rank's reduced gradients
  Buffer master_;        // fp32 masters of the shard (bf16/fp16 with master_weights, or offload)
  FlatOptimizer optim_;  // optimizer state slots of the shard
  Buffer pinned_grad_;   // cpu_offload: the gradient shard as the CPU update reads it
  Buffer pinned_param_;  // cpu_offload, bf16/fp16: the updated 16-bit shard

  // Per step.
  bool in_reduced_backward_ = false;
  bool unreduced_ = false;           // stage 1: gradients accumulated since the last reduction
  int reductions_ = 0;               // reductions into the shard since ZeroGrad
  std::vector<uint8_t> local_used_;  // slot got a gradient on this rank since ZeroGrad
  std::vector<uint8_t> ready_;       // slot is final for the current reduction
  std::vector<uint8_t> update_;      // slot is updated by this step (used on some rank)
  std::vector<size_t> pending_;      // per bucket: slots not yet ready
  std::vector<Buffer> staging_;      // stage 2: per bucket, filled as gradients arrive
  size_t top_ = 0;                   // stage 2: the furthest bucket that has begun collecting
  size_t next_launch_ = 0;
  std::deque<Flight> flights_;
  OverlapMeter overlap_;
  std::vector<Work> gathers_;
};

}  // namespace cai::sdk

#endif  // CAI_SDK_ZERO_HPP_
