// libcai_ddp: data parallelism with a full replica per rank, as PyTorch's
// DistributedDataParallel and ColossalAI's TorchDDPPlugin.
//
// What moves, in order:
//  boost     parameters (and buffers) broadcast from rank 0; trainable parameters re-homed into
//            one flat buffer laid out in bucket order, gradients into another (the buckets);
//            a GRAD_READY hook on every trainable parameter.
//  backward  the SDK's BucketReducer (cai/sdk/bucket_reducer.hpp) all-reduces each bucket
//            (SUM) as soon as its gradients are ready, overlapped with backward; when
//            forward_backward returns the gradients hold the global-batch gradient, as after
//            PyTorch DDP's backward. Under no_sync nothing is communicated.
//  step      (fp16: overflow check of the reduced buckets) → global norm → clip coefficient →
//            one fused update per run of same-group slots on the flat buffers.
//
// Why SUM and not AVG: the host weights each micro-batch's loss by its rows / the global batch
// (cai_micro_batch.loss_weight), so the global-mean gradient is the sum of the local gradients.
// With equal local batches this equals PyTorch's division by world size; with 3 ranks
// splitting a batch unevenly it stays exact where averaging would not.
//
// Overflow decisions need no extra collective: an inf/NaN on any rank reaches every rank
// through the all-reduce, and the ring result is bit-identical everywhere, so every rank sees
// the same finite check, the same norm and makes the same skip/scale decision.
//
// Per-rank memory (Ψ trainable elements, k optimizer state slots, e = 4 fp32 / 2 bf16,fp16):
//   parameters eΨ + gradients eΨ (+ eΨ of buckets without gradient_as_bucket_view)
//   + fp32 masters 4Ψ under bf16/fp16 + optimizer state 4kΨ.
#include <algorithm>
#include <cai/sdk.hpp>
#include <cai/sdk/bucket_reducer.hpp>
#include <cai/sdk/collectives.hpp>
#include <cai/sdk/flat.hpp>
#include <cai/sdk/step.hpp>
#include <optional>
#include <string>
#include <vector>

namespace {

using cai::sdk::Check;
using cai::sdk::Error;
using cai::sdk::FlatView;
using cai::sdk::Host;
using cai::sdk::kFloat32;

class Ddp {
 public:
  static constexpr const char* kName = "ddp";
  static constexpr const char* kVersion = "0.1.0";
  static constexpr uint64_t kCapabilities =
      CAI_CAP_PRECISION_FP32 | CAI_CAP_PRECISION_BF16 | CAI_CAP_PRECISION_FP16 | CAI_CAP_NO_SYNC;

  // TorchDDPPlugin's keys with PyTorch DDP's defaults, plus the fp16 loss scaler with
  // ColossalAI's defaults (the same as the single-process reference's, so fp16 runs compare).
  static std::span<const cai_config_key> ConfigKeys() {
    using cai::sdk::BoolKey;
    using cai::sdk::FloatKey;
    using cai::sdk::IntKey;
    static constexpr auto kKeys = cai::sdk::JoinKeys(
        std::array{
            BoolKey("broadcast_buffers", "true",
                    "Broadcast rank 0's buffers (running statistics) before every forward."),
            FloatKey("bucket_cap_mb", "25",
                     "Gradient bucket size in MiB; each bucket is all-reduced as soon as its last "
                     "gradient is ready (the first bucket is capped at 1 MiB to start early).",
                     0, 0, CAI_CONFIG_HAS_MIN),
            BoolKey("find_unused_parameters", "false",
                    "Allow parameters that get no gradient in a step: their bucket slots count as "
                    "zero and a parameter unused on every rank is not updated."),
            BoolKey(
                "gradient_as_bucket_view", "false",
                "Make each .grad a view into its bucket: no copy into or out of the buckets and "
                "one gradient-sized buffer less."),
            BoolKey("static_graph", "false",
                    "The set of used parameters never changes: learn the unused ones in the first "
                    "step and mark them ready at the start of backward, so their buckets overlap."),
        },
        cai::sdk::LossScalerKeys("65536.0", "fp16: initial loss scale."));
    return kKeys;
  }

  explicit Ddp(const cai_create_args& args) : world_size_(args.world_size) {
    cai::sdk::Config config(args.config);
    broadcast_buffers_ = config.Bool("broadcast_buffers");
    reducer_options_.bucket_cap_bytes =
        static_cast<size_t>(config.Float("bucket_cap_mb") * 1024 * 1024);
    reducer_options_.find_unused_parameters = config.Bool("find_unused_parameters");
    reducer_options_.gradient_as_bucket_view = config.Bool("gradient_as_bucket_view");
    reducer_options_.static_graph = config.Bool("static_graph");
    scaler_config_ = cai::sdk::LossScalerConfig(config, kName);
  }

  void Boost(const cai_boost_args& args) {
    if (model_) throw Error(CAI_FAILED_PRECONDITION, "ddp: boost was already called");
    model_ = args.model;
    precision_ = args.precision;
    compute_dtype_ = cai::sdk::ComputeDtype(precision_);
    cai::sdk::RequireFp32Params(model_, kName);
    std::vector<uint32_t> ready_order = cai::sdk::OwnedParams(model_, /*trainable=*/true);
    if (ready_order.empty()) {
      throw Error(CAI_FAILED_PRECONDITION,
                  "ddp: the model has no trainable parameters; unfreeze some (model.freeze)");
    }
    std::reverse(ready_order.begin(), ready_order.end());  // backward finishes the last first
    reducer_options_.grad_dtype = compute_dtype_;
    reducer_.emplace(model_, ready_order, reducer_options_);
    const cai::sdk::FlatLayout& layout = reducer_->layout();

    // fp32 weights in bucket layout (the masters under mixed precision), filled from the
    // model and broadcast from rank 0 in one collective; frozen parameters and buffers too.
    const bool mixed = precision_ != CAI_PRECISION_FP32;
    weights_ = cai::sdk::AllocFlat(CAI_MEM_DEVICE, layout.numel(), kFloat32,
                                   mixed ? "ddp.master" : "ddp.param");
    cai::sdk::CopyParamsInto(model_, layout, weights_, kFloat32);
    int64_t all = static_cast<int64_t>(layout.numel());
    cai_tensor flat = FlatView(weights_, kFloat32, 0, &all);
    if (world_size_ > 1) cai::sdk::Broadcast(flat);
    cai::sdk::BroadcastParams(model_, cai::sdk::OwnedParams(model_, false));
    cai::sdk::BroadcastBuffers(model_);

    // The model's parameters become views of the flat buffer (fp32), or of a 16-bit copy of
    // it that the fused update rewrites after each step (bf16/fp16).
    if (mixed) {
      Check(Host().model->set_compute_dtype(model_, compute_dtype_));
      lowp_ = cai::sdk::AllocFlat(CAI_MEM_DEVICE, layout.numel(), compute_dtype_, "ddp.param");
      cai::sdk::RunKernel(CAI_KERNEL_COPY, &flat, FlatView(lowp_, compute_dtype_, 0, &all));
    }
    cai::sdk::PointParamsAt(model_, layout, mixed ? lowp_ : weights_, compute_dtype_);
    reducer_->Start();
    optim_ =
        cai::sdk::FlatOptimizer(args.optimizer, layout.numel(), CAI_MEM_DEVICE, "ddp.optim_state");
    epilogue_.emplace(args.optimizer);
    if (precision_ == CAI_PRECISION_FP16) epilogue_->EnableLossScaling(scaler_config_);
    cai::sdk::Log(CAI_LOG_INFO, "ddp: " + std::to_string(layout.size()) + " trainable tensors, " +
                                    std::to_string(layout.numel()) + " elements in " +
                                    reducer_->DescribeBuckets() + " on " +
                                    std::to_string(world_size_) + " ranks");
  }

  void NoSync(bool enabled) { no_sync_ = enabled; }

  void ForwardBackward(const cai_micro_batch& batch) {
    if (!model_) throw Error(CAI_FAILED_PRECONDITION, "ddp: forward_backward before boost");
    if (broadcast_buffers_) cai::sdk::BroadcastBuffers(model_);
    reducer_->ExpectUnreduced();
    if (!no_sync_) reducer_->Begin();
    cai::sdk::RunMicroBatch(model_, batch, /*backward=*/true, epilogue_->loss_scale());
    if (!no_sync_) reducer_->Finish();
  }

  // Forward only. Buffers follow rank 0 first, as PyTorch DDP syncs them before any forward.
  void Evaluate(const cai_micro_batch& batch) {
    if (!model_) throw Error(CAI_FAILED_PRECONDITION, "ddp: evaluate before boost");
    if (broadcast_buffers_) cai::sdk::BroadcastBuffers(model_);
    cai::sdk::RunMicroBatch(model_, batch, /*backward=*/false);
  }

  // The reduced buckets are the same on every rank (the ring result is bit-identical), so the
  // norm and the overflow verdict need no further collective.
  void Step(cai_step_result& result) {
    if (!model_) throw Error(CAI_FAILED_PRECONDITION, "ddp: step before boost");
    reducer_->EnsureReduced();
    cai::sdk::StepSums sums;
    sums.sum_squares = reducer_->SumSquares();
    sums.overflow = epilogue_->loss_scaling() && !reducer_->AllFinite();
    const cai::sdk::StepDecision d = epilogue_->Decide(sums, result, nullptr, /*agree=*/false);
    if (d.skipped) return;
    // One fused update per run of consecutive slots of one group that the step updates.
    const size_t e = cai::sdk::ElementSize(compute_dtype_);
    cai::sdk::ForEachGroupRun(
        reducer_->layout(), reducer_->updated(), [&](size_t at, size_t count, uint32_t group) {
          cai::sdk::FlatOptimizer::Piece piece;
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

  void ZeroGrad() {
    if (!model_) throw Error(CAI_FAILED_PRECONDITION, "ddp: zero_grad before boost");
    reducer_->Reset();
  }

  // The canonical full layout (what the single-process reference writes); rank 0 writes,
  // every rank reads the same tensors.
  void Save(const cai_checkpoint_args& args) {
    if (Host().comm->rank(nullptr) != 0) return;
    cai::sdk::SaveFlatReplica(model_, args, reducer_->layout(), weights_, optim_);
    if (args.optimizer) epilogue_->Save(args.checkpoint, kName);
  }

  void Load(const cai_checkpoint_args& args) {
    cai::sdk::LoadFlatReplica(model_, args, reducer_->layout(), weights_, optim_);
    if (args.model && lowp_.get()) {  // the 16-bit parameters follow the masters
      int64_t all = static_cast<int64_t>(reducer_->layout().numel());
      cai_tensor master = FlatView(weights_, kFloat32, 0, &all);
      cai::sdk::RunKernel(CAI_KERNEL_COPY, &master, FlatView(lowp_, compute_dtype_, 0, &all));
    }
    if (args.optimizer) epilogue_->Load(args.checkpoint, kName);
  }

  void Stats(cai_strategy_stats& stats) {
    stats.param_bytes =
        (lowp_.get() ? lowp_.size() : weights_.size()) + cai::sdk::FrozenParamBytes(model_);
    stats.grad_bytes = reducer_->grad_bytes();
    stats.optimizer_state_bytes = optim_.bytes();
    stats.master_bytes = lowp_.get() ? weights_.size() : 0;
    stats.overlap_ratio = reducer_->overlap_ratio();
  }

  static void EstimateMemory(const cai_memory_estimate_args& args, cai_memory_estimate& out) {
    const bool view = args.config && cai::sdk::Config(args.config).Bool("gradient_as_bucket_view");
    const bool mixed = args.precision != CAI_PRECISION_FP32;
    const uint64_t psi = static_cast<uint64_t>(args.num_params);
    const uint64_t e = mixed ? 2 : 4;
    out.param_bytes = e * psi;
    out.grad_bytes = (view ? 1 : 2) * e * psi;
    out.master_bytes = mixed ? 4 * psi : 0;
    out.optimizer_state_bytes = 4ull * args.optimizer_state_slots * psi;
    out.device_bytes =
        out.param_bytes + out.grad_bytes + out.master_bytes + out.optimizer_state_bytes;
    out.formula = mixed ? (view ? "(2 + 2 + 4 + 4k)Ψ: 16-bit params and bucket-view grads, fp32 "
                                  "masters, k state slots"
                                : "(2 + 2 + 2 + 4 + 4k)Ψ: 16-bit params, grads and buckets, "
                                  "fp32 masters, k state slots")
                        : (view ? "(4 + 4 + 4k)Ψ: params, bucket-view grads, k state slots"
                                : "(4 + 4 + 4 + 4k)Ψ: params, grads, buckets, k state slots");
  }

 private:
  const int32_t world_size_;
  bool broadcast_buffers_ = true;
  cai::sdk::BucketReducer::Options reducer_options_;
  cai_loss_scaler_config scaler_config_{};

  cai_model* model_ = nullptr;
  cai_precision precision_ = CAI_PRECISION_FP32;
  cai_dtype compute_dtype_ = kFloat32;
  std::optional<cai::sdk::BucketReducer> reducer_;  // the buckets; their layout is ours
  cai::sdk::Buffer weights_;  // fp32 parameters (masters under bf16/fp16), bucket layout
  cai::sdk::Buffer lowp_;     // bf16/fp16 parameters the model computes with
  cai::sdk::FlatOptimizer optim_;
  std::optional<cai::sdk::StepEpilogue> epilogue_;
  bool no_sync_ = false;
};

}  // namespace

CAI_PLUGIN(Ddp)
