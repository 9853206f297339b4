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
#include <cai/sdk.hpp>
#include <cai/sdk/bucket_reducer.hpp>
#include <cai/sdk/collectives.hpp>
#include <cai/sdk/flat.hpp>
#include <cai/sdk/step.hpp>
#include <optional>
#include <string>
#include <vector>

namespace {

using cai::sdk::Error;
using cai::sdk::Host;

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
    cai::sdk::RequireFp32Params(model_, kName);
    const std::vector<uint32_t> params = cai::sdk::OwnedParams(model_, /*trainable=*/true);
    if (params.empty()) {
      throw Error(CAI_FAILED_PRECONDITION,
                  "ddp: the model has no trainable parameters; unfreeze some (model.freeze)");
    }
    // Rank 0's trainable weights (one collective), frozen parameters and buffers.
    replica_.emplace(model_, args.optimizer, params, args.precision, reducer_options_,
                     /*broadcast=*/true);
    cai::sdk::BroadcastParams(model_, cai::sdk::OwnedParams(model_, false));
    cai::sdk::BroadcastBuffers(model_);
    epilogue_.emplace(args.optimizer);
    if (args.precision == CAI_PRECISION_FP16) epilogue_->EnableLossScaling(scaler_config_);
    const cai::sdk::FlatLayout& layout = replica_->layout();
    cai::sdk::Log(CAI_LOG_INFO, "ddp: " + std::to_string(layout.size()) + " trainable tensors, " +
                                    std::to_string(layout.numel()) + " elements in " +
                                    replica_->reducer().DescribeBuckets() + " on " +
                                    std::to_string(world_size_) + " ranks");
  }

  void NoSync(bool enabled) { no_sync_ = enabled; }

  void ForwardBackward(const cai_micro_batch& batch) {
    if (!model_) throw Error(CAI_FAILED_PRECONDITION, "ddp: forward_backward before boost");
    if (broadcast_buffers_) cai::sdk::BroadcastBuffers(model_);
    cai::sdk::BucketReducer& reducer = replica_->reducer();
    reducer.ExpectUnreduced();
    if (!no_sync_) reducer.Begin();
    cai::sdk::RunMicroBatch(model_, batch, /*backward=*/true, epilogue_->loss_scale());
    if (!no_sync_) reducer.Finish();
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
    cai::sdk::StepSums sums = replica_->LocalSums(Host().model->num_params(model_),
                                                  epilogue_->loss_scaling(), /*contribute=*/true);
    replica_->Update(epilogue_->Decide(sums, result, nullptr, /*agree=*/false));
  }

  void ZeroGrad() {
    if (!model_) throw Error(CAI_FAILED_PRECONDITION, "ddp: zero_grad before boost");
    replica_->reducer().Reset();
  }

  // The canonical full layout (what the single-process reference writes); rank 0 writes,
  // every rank reads the same tensors.
  void Save(const cai_checkpoint_args& args) {
    if (Host().comm->rank(nullptr) != 0) return;
    replica_->Save(args);
    if (args.model) cai::sdk::SaveFrozenParams(model_, args.checkpoint);
    if (args.optimizer) epilogue_->Save(args.checkpoint, kName);
  }

  void Load(const cai_checkpoint_args& args) {
    replica_->Load(args);
    if (args.model) cai::sdk::LoadFrozenParams(model_, args.checkpoint);
    if (args.optimizer) epilogue_->Load(args.checkpoint, kName);
  }

  void Stats(cai_strategy_stats& stats) {
    stats.param_bytes = cai::sdk::FrozenParamBytes(model_);
    replica_->AddStats(stats);
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
  std::optional<cai::sdk::DataParallelReplica> replica_;
  std::optional<cai::sdk::StepEpilogue> epilogue_;
  bool no_sync_ = false;
};

}  // namespace

CAI_PLUGIN(Ddp)
