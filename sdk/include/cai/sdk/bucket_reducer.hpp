// cai SDK: data parallelism's gradient reducer, as PyTorch DistributedDataParallel's Reducer,
// over any communicator group.
//
// Gradients are taken in the order backward is expected to finish them and packed into
// buckets (PlanBuckets). During a synchronised backward each gradient, once the model service
// reports it ready (GRAD_READY), is brought into its bucket (copied, or already there when
// .grad is a view of the bucket); a bucket whose gradients are all ready is all-reduced (SUM)
// asynchronously while backward goes on. Buckets launch strictly in bucket order, so every
// rank of the group issues the same collectives in the same order. After backward the buckets
// still waiting on parameters that got no gradient are completed (zeros) and launched, and all
// are waited for: the buckets then hold the sum of the group's gradients. That sum is the
// global-batch gradient because the host weights each rank's loss by its share of the global
// batch (cai_micro_batch.loss_weight); an average would train at 1/N of the learning rate.
//
// Memory: the buckets, numel × the gradient dtype's bytes (the .grad tensors themselves unless
// gradient_as_bucket_view makes them views of the buckets).
//
// Not thread-safe; the grad-ready hook may run on an autograd thread while the owner waits in
// the model's backward, which is the only time it touches the reducer.
#ifndef CAI_SDK_BUCKET_REDUCER_HPP_
#define CAI_SDK_BUCKET_REDUCER_HPP_

#include <algorithm>
#include <optional>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "cai/sdk.hpp"
#include "cai/sdk/flat.hpp"
#include "cai/sdk/overlap.hpp"
#include "cai/sdk/step.hpp"

namespace cai::sdk {

// PyTorch's _DEFAULT_FIRST_BUCKET_BYTES: a small first bucket starts communication early.
inline constexpr size_t kFirstBucketBytes = size_t{1} << 20;

// PyTorch DDP's compute_bucket_assignment_by_size: `bytes[i]` is the size of the i-th gradient
// in ready order; a bucket closes as soon as it holds at least its limit (first_cap_bytes for
// the first, cap_bytes after), so a gradient larger than the cap gets a bucket of its own.
// Returns each bucket as a half-open range [first, last) of indices, in launch order; every
// index lies in exactly one bucket and no bucket is empty.
inline std::vector<std::pair<size_t, size_t>> PlanBuckets(
    std::span<const size_t> bytes, size_t cap_bytes, size_t first_cap_bytes = kFirstBucketBytes) {
  std::vector<std::pair<size_t, size_t>> buckets;
  size_t first = 0, filled = 0;
  for (size_t i = 0; i < bytes.size(); ++i) {
    filled += bytes[i];
    const size_t limit = buckets.empty() ? std::min(first_cap_bytes, cap_bytes) : cap_bytes;
    if (filled >= limit) {
      buckets.emplace_back(first, i + 1);
      first = i + 1;
      filled = 0;
    }
  }
  if (first < bytes.size()) buckets.emplace_back(first, bytes.size());
  return buckets;
}

class BucketReducer {
 public:
  struct Options {
    size_t bucket_cap_bytes = size_t{25} << 20;
    size_t first_bucket_cap_bytes = kFirstBucketBytes;
    // Allow parameters without gradient in a step (their slots count as zero); off, such a
    // parameter is an error naming it.
    bool find_unused_parameters = false;
    bool gradient_as_bucket_view = false;  // .grad tensors are views of the buckets
    // The used parameters never change: learn the unused ones in the first step and mark them
    // ready at the start of later backwards.
    bool static_graph = false;
    cai_dtype grad_dtype = kFloat32;  // the model's gradient dtype (its compute dtype)
    cai_comm_group* group = nullptr;  // NULL: the world
    // Names the strategy in errors and its config table in their advice ("ddp" refers to
    // plugin.ddp.find_unused_parameters).
    std::string owner = "ddp";
  };

  // Plans buckets over `ready_order` (trainable parameters, in the order backward is expected
  // to finish them: reverse registration order). The layout (bucket order) is what the owner
  // lays its other flat buffers out by; Start() then allocates the buckets.
  BucketReducer(cai_model* model, std::span<const uint32_t> ready_order, Options options)
      : model_(model), options_(std::move(options)) {
    const size_t e = ElementSize(options_.grad_dtype);
    std::vector<size_t> bytes;
    for (uint32_t p : ready_order)
      bytes.push_back(static_cast<size_t>(ParamInfo(model, p).numel) * e);
    for (const auto& [first, last] :
         PlanBuckets(bytes, options_.bucket_cap_bytes, options_.first_bucket_cap_bytes)) {
      Bucket& b = buckets_.emplace_back();
      b.first_slot = layout_.size();
      b.offset = layout_.numel();
      for (size_t k = first; k < last; ++k) {
        layout_.Add(model, ready_order[k]);
        bucket_of_slot_.push_back(buckets_.size() - 1);
      }
      b.end_slot = layout_.size();
      b.numel = static_cast<int64_t>(layout_.numel() - b.offset);
    }
    local_used_.assign(layout_.size(), 0);
    ready_.assign(layout_.size(), 0);
    update_.assign(layout_.size(), 1);
  }

  // Allocates the buckets, makes .grad views of them with gradient_as_bucket_view and starts
  // listening for ready gradients. Call once the model computes in grad_dtype.
  void Start() {
    grads_ = AllocFlat(CAI_MEM_DEVICE, layout_.numel(), options_.grad_dtype,
                       options_.gradient_as_bucket_view ? "ddp.grad" : "ddp.bucket");
    if (options_.gradient_as_bucket_view) {
      PointGradsAt(model_, layout_, grads_, options_.grad_dtype);
    }
    for (Bucket& b : buckets_) b.view = FlatView(grads_, options_.grad_dtype, b.offset, &b.numel);
    hook_id_ = OnEveryGradReady(model_, &BucketReducer::OnGradReadyHook, this);
  }
  BucketReducer(const BucketReducer&) = delete;
  BucketReducer& operator=(const BucketReducer&) = delete;
  ~BucketReducer() {
    // Collectives still in flight write into the buckets: finish them before those go.
    for (Bucket& b : buckets_) b.work = Work();
    if (hook_id_) Host().status_destroy(Host().model->remove_hook(model_, hook_id_));
  }

  const FlatLayout& layout() const { return layout_; }
  const Buffer& grads() const { return grads_; }  // the buckets, laid out like layout()
  cai_dtype grad_dtype() const { return options_.grad_dtype; }
  // True once this step's gradients are reduced (until Reset).
  bool reduced() const { return reduced_; }
  // Per slot of layout(): whether the step updates it (it got a gradient on some rank). All
  // slots without find_unused_parameters.
  const std::vector<uint8_t>& updated() const { return update_; }
  // Share of the communication windows (first launch to last completion) that backward
  // compute covered (OverlapMeter).
  double overlap_ratio() const { return overlap_.ratio(); }
  // "[b0 b1 ...]" bucket sizes in bytes, for the owner's log line.
  std::string DescribeBuckets() const {
    std::string sizes;
    for (const Bucket& b : buckets_) {
      sizes += (sizes.empty() ? "" : " ") +
               std::to_string(b.numel * static_cast<int64_t>(ElementSize(options_.grad_dtype)));
    }
    return std::to_string(buckets_.size()) + " buckets of bytes [" + sizes + "]";
  }

  // Fails once this step's gradients are reduced: further local gradients mixed with reduced
  // sums cannot be reduced again exactly.
  void ExpectUnreduced() const {
    if (reduced_) {
      throw Error(CAI_FAILED_PRECONDITION,
                  options_.owner +
                      ": backward after this step's gradients were already all-reduced; call "
                      "zero_grad after step, and run all but the last micro-batch of a step "
                      "under no_sync(true)");
    }
  }

  // Before a backward whose gradients are to be reduced (not under no_sync).
  void Begin() {
    ExpectUnreduced();
    std::fill(ready_.begin(), ready_.end(), 0);
    for (Bucket& b : buckets_) b.pending = b.end_slot - b.first_slot;
    next_launch_ = 0;
    overlap_.Discard();
    armed_ = true;
    // A static graph leaves the same parameters unused every step: mark them at once so their
    // buckets are not held back until the end of backward.
    for (size_t s : static_unused_) MarkReady(s);
  }

  // After that backward: completes the buckets that wait on parameters without gradient,
  // waits for every all-reduce, settles which parameters the step updates, and (without
  // bucket views) copies the reduced sums back into .grad, as after PyTorch DDP's backward.
  void Finish() {
    armed_ = false;
    std::string unused;
    for (size_t slot = 0; slot < layout_.size(); ++slot) {
      if (ready_[slot]) continue;
      if (!local_used_[slot] && !options_.find_unused_parameters) {
        unused += (unused.empty() ? "'" : ", '") + layout_[slot].name + "'";
        continue;
      }
      MarkReady(slot);
    }
    if (!unused.empty()) {
      throw Error(CAI_FAILED_PRECONDITION,
                  options_.owner + ": parameters received no gradient in this step: " + unused +
                      ". Set plugin." + options_.owner +
                      ".find_unused_parameters = true if the model leaves parameters unused, or "
                      "freeze them (model.freeze)");
    }
    LaunchReadyBuckets();
    overlap_.Wait([&] {
      for (Bucket& b : buckets_) b.work.Wait();
    });
    overlap_.Completed();
    if (options_.find_unused_parameters) SettleUnused();
    if (!options_.gradient_as_bucket_view) CopyBucketsToGrads();
    reduced_ = true;
  }

  // Reduces what no_sync accumulated when the step comes without a synchronised backward, so
  // a step never applies a rank-local gradient.
  void EnsureReduced() {
    if (reduced_) return;
    Begin();
    Finish();
  }

  // Σ g² over the reduced buckets: the same on every rank of the group.
  double SumSquares() const {
    double total = 0;
    for (const Bucket& b : buckets_) {
      double sq = 0;
      RunKernel(CAI_KERNEL_SUM_SQUARES, nullptr, b.view, 0, &sq);
      total += sq;
    }
    return total;
  }
  // Σ g² of the reduced gradients of the given model parameters (those this reducer holds): what
  // to take off SumSquares() for parameters another rank counts (a pipeline's tied embedding).
  double SumSquaresOf(std::span<const uint32_t> params) const {
    double total = 0;
    for (uint32_t p : params) {
      const int32_t slot = layout_.SlotOf(p);
      if (slot < 0) continue;
      double sq = 0;
      RunKernel(CAI_KERNEL_SUM_SQUARES, nullptr, layout_.View(grads_, options_.grad_dtype, slot), 0,
                &sq);
      total += sq;
    }
    return total;
  }
  // Whether every reduced gradient is finite (an inf/NaN on any rank reaches every rank through
  // the all-reduce).
  bool AllFinite() const {
    for (const Bucket& b : buckets_) {
      double ok = 0;
      RunKernel(CAI_KERNEL_ALL_FINITE, nullptr, b.view, 0, &ok);
      if (ok != 1.0) return false;
    }
    return true;
  }

  // zero_grad: drops the step's gradients (PyTorch's set_to_none, or zeros in the buckets
  // that .grad views).
  void Reset() {
    for (Bucket& b : buckets_) b.work = Work();
    if (options_.gradient_as_bucket_view) {
      int64_t all = static_cast<int64_t>(layout_.numel());
      RunKernel(CAI_KERNEL_FILL, nullptr, FlatView(grads_, options_.grad_dtype, 0, &all), 0);
    } else {
      for (const FlatSlot& s : layout_.slots()) Check(Host().model->release_grad(model_, s.param));
    }
    std::fill(local_used_.begin(), local_used_.end(), 0);
    reduced_ = false;
  }

  // Bytes of gradients: the buckets, plus the .grad tensors beside them without bucket views.
  uint64_t grad_bytes() const {
    return grads_.size() + (options_.gradient_as_bucket_view
                                ? 0
                                : layout_.numel() * ElementSize(options_.grad_dtype));
  }

 private:
  struct Bucket {
    size_t first_slot = 0, end_slot = 0;
    size_t offset = 0;  // elements into the flat buffers
    int64_t numel = 0;
    cai_tensor view{};   // the bucket's slice of grads_
    size_t pending = 0;  // slots not yet ready in this reduction
    Work work;
  };

  static cai_status* OnGradReadyHook(void* self, const cai_hook_event* event) {
    return Guard([&] { static_cast<BucketReducer*>(self)->OnGradReady(event->param); });
  }

  void OnGradReady(int32_t param) {
    if (param < 0) return;
    const int32_t slot = layout_.SlotOf(static_cast<uint32_t>(param));
    if (slot < 0) return;
    local_used_[slot] = 1;
    if (!armed_) return;
    if (ready_[slot]) {
      throw Error(CAI_FAILED_PRECONDITION,
                  options_.owner + ": parameter '" + layout_[slot].name +
                      "' got a gradient although static_graph marked it unused in the first "
                      "step; the set of used parameters changes, so set static_graph = false");
    }
    MarkReady(static_cast<size_t>(slot));
    LaunchReadyBuckets();
  }

  // The slot's gradient is final for this reduction: bring it into the bucket (a copy unless
  // .grad is a view of the bucket already; zeros for a parameter without gradient).
  void MarkReady(size_t slot) {
    if (!options_.gradient_as_bucket_view) {
      cai_tensor dst = layout_.View(grads_, options_.grad_dtype, slot);
      cai_tensor grad{};
      cai_status* missing = Host().model->param_grad(model_, layout_[slot].param, &grad);
      if (missing) {
        Host().status_destroy(missing);
        RunKernel(CAI_KERNEL_FILL, nullptr, dst, 0);
      } else {
        RunKernel(CAI_KERNEL_COPY, &grad, dst, 0);
      }
    }
    ready_[slot] = 1;
    --buckets_[bucket_of_slot_[slot]].pending;
  }

  // Launches, in bucket order, every bucket whose gradients are all ready.
  void LaunchReadyBuckets() {
    while (next_launch_ < buckets_.size() && buckets_[next_launch_].pending == 0) {
      Bucket& b = buckets_[next_launch_++];
      overlap_.Launched();
      b.work = RunCollective(CAI_COMM_ALL_REDUCE, nullptr, b.view, /*async=*/true, CAI_REDUCE_SUM,
                             options_.group);
    }
  }

  // Which parameters got a gradient on some rank (one MAX all-reduce of the local flags, as
  // PyTorch DDP's local_used_map); those unused on every rank are not updated (torch.optim
  // skips a parameter without .grad). A static graph learns this once.
  void SettleUnused() {
    if (options_.static_graph && settled_) return;
    // The flags travel in the communicator's memory (device memory under NCCL).
    Buffer used = AllocFlat(CAI_MEM_DEVICE, layout_.size(), {CAI_DTYPE_UINT, 8, 1}, "ddp.used");
    Check(Host().mempool->copy(used.data(), local_used_.data(), layout_.size(), nullptr));
    int64_t n = static_cast<int64_t>(layout_.size());
    RunCollective(CAI_COMM_ALL_REDUCE, nullptr, FlatView(used, {CAI_DTYPE_UINT, 8, 1}, 0, &n),
                  false, CAI_REDUCE_MAX, options_.group);
    Check(Host().mempool->copy(update_.data(), used.data(), layout_.size(), nullptr));
    if (options_.static_graph) {
      for (size_t s = 0; s < layout_.size(); ++s) {
        if (!local_used_[s]) static_unused_.push_back(s);
      }
      settled_ = true;
    }
  }

  // A parameter this rank left without .grad keeps none.
  void CopyBucketsToGrads() {
    for (size_t slot = 0; slot < layout_.size(); ++slot) {
      cai_tensor grad{};
      cai_status* missing = Host().model->param_grad(model_, layout_[slot].param, &grad);
      if (missing) {
        Host().status_destroy(missing);
        continue;
      }
      cai_tensor src = layout_.View(grads_, options_.grad_dtype, slot);
      RunKernel(CAI_KERNEL_COPY, &src, grad, 0);
    }
  }

  cai_model* model_;
  Options options_;
  FlatLayout layout_;  // trainable parameters in bucket order
  std::vector<size_t> bucket_of_slot_;
  std::vector<Bucket> buckets_;
  Buffer grads_;
  uint64_t hook_id_ = 0;

  bool armed_ = false;               // a synchronised backward is running
  bool reduced_ = false;             // the buckets hold this step's reduced gradients
  std::vector<uint8_t> local_used_;  // slot got a gradient on this rank since Reset
  std::vector<uint8_t> ready_;       // slot is in its bucket for the current reduction
  std::vector<uint8_t> update_;      // slot is updated by this step (used on some rank)
  size_t next_launch_ = 0;
  OverlapMeter overlap_;
  bool settled_ = false;
  std::vector<size_t> static_unused_;
};

// Data parallelism over a group with a full replica per rank, as PyTorch DDP: the given
// trainable parameters re-homed into fp32 flat weights in bucket order (the masters under
// bf16/fp16, with a 16-bit copy the model computes on and the fused update rewrites), their
// gradients reduced by a BucketReducer, the optimizer state beside them. What libcai_ddp is,
// and what a pipeline stage runs over its data-parallel group.
// Memory (Ψ the parameters given, k state slots, e = 4 fp32 / 2 bf16,fp16): weights 4Ψ
// (+ eΨ 16-bit copy), buckets eΨ (+ the .grad tensors without gradient_as_bucket_view),
// optimizer state 4kΨ.
class DataParallelReplica {
 public:
  // `params`: trainable parameters that own storage, in registration order. With
  // `broadcast`, group rank 0's values of them are broadcast first (one collective). Casts the
  // model to the compute dtype under bf16/fp16.
  DataParallelReplica(cai_model* model, cai_optimizer* optimizer, std::span<const uint32_t> params,
                      cai_precision precision, BucketReducer::Options options, bool broadcast)
      : compute_dtype_(ComputeDtype(precision)) {
    std::vector<uint32_t> ready_order(params.rbegin(), params.rend());  // last finishes first
    options.grad_dtype = compute_dtype_;
    group_ = options.group;
    reducer_.emplace(model, ready_order, options);
    const FlatLayout& layout = reducer_->layout();
    const bool mixed = precision != CAI_PRECISION_FP32;
    weights_ =
        AllocFlat(CAI_MEM_DEVICE, layout.numel(), kFloat32, mixed ? "ddp.master" : "ddp.param");
    CopyParamsInto(model, layout, weights_, kFloat32);
    numel_ = static_cast<int64_t>(layout.numel());
    const cai_tensor flat = FlatView(weights_, kFloat32, 0, &numel_);
    if (broadcast && Host().comm->size(group_) > 1) {
      cai_comm_args args{};
      args.struct_size = CAI_COMM_ARGS_STRUCT_SIZE;
      args.group = group_;
      args.op = CAI_COMM_BROADCAST;
      args.output = &flat;
      Check(Host().comm->run(&args, nullptr));
    }
    if (mixed) {
      Check(Host().model->set_compute_dtype(model, compute_dtype_));
      lowp_ = AllocFlat(CAI_MEM_DEVICE, layout.numel(), compute_dtype_, "ddp.param");
      RunKernel(CAI_KERNEL_COPY, &flat, FlatView(lowp_, compute_dtype_, 0, &numel_));
    }
    PointParamsAt(model, layout, mixed ? lowp_ : weights_, compute_dtype_);
    reducer_->Start();
    optim_ = FlatOptimizer(optimizer, layout.numel(), CAI_MEM_DEVICE, "ddp.optim_state");
  }

  BucketReducer& reducer() { return *reducer_; }
  const FlatLayout& layout() const { return reducer_->layout(); }

  // This rank's part of the step's agreement: the reduced gradients are the same on every
  // rank of the group, so Σ g² (less `not_counted`, parameters another rank counts) is
  // contributed by `contribute` ranks only (group rank 0, when the agreement spans several
  // groups); overflow under loss scaling; used flags per model parameter.
  StepSums LocalSums(uint32_t num_params, bool check_overflow, bool contribute,
                     std::span<const uint32_t> not_counted = {}) {
    reducer_->EnsureReduced();
    StepSums sums;
    if (contribute) sums.sum_squares = reducer_->SumSquares() - reducer_->SumSquaresOf(not_counted);
    sums.overflow = check_overflow && !reducer_->AllFinite();
    sums.used.assign(num_params, 0);
    const FlatLayout& layout = reducer_->layout();
    for (size_t s = 0; s < layout.size(); ++s) {
      sums.used[layout[s].param] = reducer_->updated()[s];
    }
    return sums;
  }

  // One fused update per run of consecutive same-group slots the step updates.
  void Update(const StepDecision& d) {
    if (d.skipped) return;
    const size_t e = ElementSize(compute_dtype_);
    ForEachGroupRun(layout(), reducer_->updated(), [&](size_t at, size_t count, uint32_t group) {
      FlatOptimizer::Piece piece;
      piece.group = group;
      piece.offset = at;
      piece.count = count;
      piece.param = static_cast<float*>(weights_.data()) + at;
      piece.grad = static_cast<const char*>(reducer_->grads().data()) + at * e;
      piece.grad_dtype = compute_dtype_;
      if (lowp_.get()) {
        piece.lowp = static_cast<char*>(lowp_.data()) + at * e;
        piece.lowp_dtype = compute_dtype_;
      }
      optim_.Update(piece, d.step, d.grad_scale);
    });
  }

  // The canonical layout of the parameters `writes` accepts (all by default); call on the
  // ranks that write (one per group: the others hold the same values).
  template <class Writes = bool (*)(uint32_t)>
  void Save(
      const cai_checkpoint_args& args, Writes writes = [](uint32_t) { return true; },
      const ParamIo& io = DirectIo()) const {
    const FlatLayout& layout = reducer_->layout();
    for (size_t i = 0; i < layout.size(); ++i) {
      if (!writes(layout[i].param)) continue;
      if (args.model) {
        io.Write(args.checkpoint, "model/" + layout[i].name, layout[i].param,
                 layout.View(weights_, kFloat32, i), layout[i].shape);
      }
      for (uint32_t k = 0; args.optimizer && k < optim_.SlotsOf(layout[i].group); ++k) {
        io.Write(args.checkpoint, OptimStateName(layout[i].name, k), layout[i].param,
                 optim_.View(k, layout[i].offset, &layout[i].numel), {});
      }
    }
  }
  // Reads the canonical layout of every parameter it holds, on every rank.
  void Load(const cai_checkpoint_args& args, const ParamIo& io = DirectIo()) {
    const FlatLayout& layout = reducer_->layout();
    for (size_t i = 0; i < layout.size(); ++i) {
      if (args.model) {
        io.Read(args.checkpoint, "model/" + layout[i].name, layout[i].param, 0, 0,
                layout.View(weights_, kFloat32, i));
      }
      for (uint32_t k = 0; args.optimizer && k < optim_.SlotsOf(layout[i].group); ++k) {
        io.Read(args.checkpoint, OptimStateName(layout[i].name, k), layout[i].param, 0, 0,
                optim_.View(k, layout[i].offset, &layout[i].numel));
      }
    }
    if (args.model && lowp_.get()) {  // the 16-bit parameters follow the masters
      const cai_tensor master = FlatView(weights_, kFloat32, 0, &numel_);
      RunKernel(CAI_KERNEL_COPY, &master, FlatView(lowp_, compute_dtype_, 0, &numel_));
    }
  }

  void AddStats(cai_strategy_stats& stats) const {
    stats.param_bytes += lowp_.get() ? lowp_.size() : weights_.size();
    stats.grad_bytes += reducer_->grad_bytes();
    stats.optimizer_state_bytes += optim_.bytes();
    stats.master_bytes += lowp_.get() ? weights_.size() : 0;
    stats.overlap_ratio = reducer_->overlap_ratio();
  }

 private:
  cai_dtype compute_dtype_;
  cai_comm_group* group_ = nullptr;
  std::optional<BucketReducer> reducer_;
  int64_t numel_ = 0;
  Buffer weights_;  // fp32 parameters (masters under bf16/fp16), bucket layout
  Buffer lowp_;     // bf16/fp16 parameters the model computes with
  FlatOptimizer optim_;
};

}  // namespace cai::sdk

#endif  // CAI_SDK_BUCKET_REDUCER_HPP_
