// libcai_low_level_zero: ZeRO stage 1 and stage 2 (Rajbhandari et al., "ZeRO", SC'20), as
// ColossalAI's LowLevelZeroPlugin: every rank keeps the whole model in the compute dtype, and
// owns one even, padded slice of the gradients, the fp32 master weights and the optimizer state.
// The partitioned optimizer itself is the SDK's ZeroOptimizer (cai/sdk/zero.hpp, which says
// what moves when and what it costs); this plugin maps LowLevelZeroPlugin's keys onto it over
// the world group and ends each step with the SDK's StepEpilogue: one SUM all-reduce of
// [Σ g² of the shards, overflow flag, used flags].
//
// fp16 with accumulation: stage 2 adds each micro-batch's reduced gradient into an fp32 shard,
// where the reference (and stage 1) accumulate .grad in fp16. A scaled sum that overflows
// fp16 there does not overflow here, so stage 2 may skip fewer steps than the reference (seen
// on the tiny test job: 2 skipped steps instead of 4 at an initial scale of 2^20).
#include <cai/sdk.hpp>
#include <cai/sdk/collectives.hpp>
#include <cai/sdk/flat.hpp>
#include <cai/sdk/sharding.hpp>
#include <cai/sdk/step.hpp>
#include <cai/sdk/zero.hpp>
#include <optional>
#include <string>
#include <vector>

namespace {

using cai::sdk::Error;
using cai::sdk::Host;

class LowLevelZero {
 public:
  static constexpr const char* kName = "low_level_zero";
  static constexpr const char* kVersion = "0.1.0";
  static constexpr uint64_t kCapabilities = CAI_CAP_PRECISION_FP32 | CAI_CAP_PRECISION_BF16 |
                                            CAI_CAP_PRECISION_FP16 | CAI_CAP_NO_SYNC |
                                            CAI_CAP_CPU_OFFLOAD;

  // The keys of ColossalAI's LowLevelZeroPlugin, with its defaults
  // (colossalai/booster/plugin/low_level_zero_plugin.py).
  static std::span<const cai_config_key> ConfigKeys() {
    using cai::sdk::BoolKey;
    using cai::sdk::FloatKey;
    using cai::sdk::IntKey;
    using cai::sdk::StringKey;
    static constexpr const char* kCommDtypes[] = {"compute", "fp32", "bf16", "fp16", nullptr};
    static constexpr auto kKeys = cai::sdk::JoinKeys(
        std::array{
            IntKey("stage", "1",
                   "1: optimizer states (and fp32 masters) sharded, full gradients kept so no_sync "
                   "accumulates without communication; 2: gradients sharded too, reduce-scattered "
                   "every micro-batch.",
                   1, 2, CAI_CONFIG_HAS_MIN | CAI_CONFIG_HAS_MAX),
            FloatKey(
                "reduce_bucket_size_in_m", "12",
                "Gradient bucket size in millions (2^20) of elements; each bucket is "
                "reduce-scattered as soon as its last gradient is ready and all-gathered after "
                "the step.",
                0, 0, CAI_CONFIG_HAS_MIN),
            BoolKey("overlap_communication", "true",
                    "Reduce-scatter each bucket asynchronously during backward; off: all buckets "
                    "after backward, one at a time."),
            StringKey(
                "communication_dtype", "\"compute\"",
                "dtype gradients are reduced in: compute (the training precision), fp32, bf16 "
                "or fp16.",
                kCommDtypes),
            BoolKey("overlap_allgather", "false",
                    "All-gather the updated parameters asynchronously after the step and wait for "
                    "them before the next forward (or evaluation, or checkpoint)."),
            BoolKey(
                "cpu_offload", "false",
                "Keep fp32 master weights and optimizer state on the host tier; the host's fused "
                "CPU optimizer updates them from a pinned copy of the gradient shard."),
            BoolKey("master_weights", "true",
                    "bf16/fp16: keep fp32 master weights of the shard. false: update the 16-bit "
                    "parameters in place (less memory, rounding every step)."),
        },
        cai::sdk::LossScalerKeys("4294967296.0", "fp16: initial loss scale (2^32)."),
        std::array{
            FloatKey("max_norm", "0.0",
                     "Clip gradients to this global L2 norm, computed across shards (0 = use "
                     "optimizer.max_grad_norm).",
                     0, 0, CAI_CONFIG_HAS_MIN),
        });
    return kKeys;
  }

  explicit LowLevelZero(const cai_create_args& args) {
    cai::sdk::Config config(args.config);
    options_.stage = static_cast<int>(config.Int("stage"));
    const double bucket_m = config.Float("reduce_bucket_size_in_m");
    options_.bucket_cap = static_cast<size_t>(bucket_m * (1 << 20));
    if (options_.bucket_cap == 0) {
      throw Error(CAI_INVALID_ARGUMENT,
                  "low_level_zero: reduce_bucket_size_in_m = " + std::to_string(bucket_m) +
                      " is below one element; use at least 1e-6 (the default is 12)");
    }
    options_.overlap_communication = config.Bool("overlap_communication");
    comm_dtype_name_ = config.String("communication_dtype");
    options_.overlap_allgather = config.Bool("overlap_allgather");
    options_.cpu_offload = config.Bool("cpu_offload");
    options_.master_weights = config.Bool("master_weights");
    max_norm_ = config.Float("max_norm");
    scaler_config_ = cai::sdk::LossScalerConfig(config, kName);
    if (options_.cpu_offload && !options_.master_weights) {
      throw Error(CAI_INVALID_ARGUMENT,
                  "low_level_zero: cpu_offload keeps fp32 master weights on the host; it "
                  "cannot run with master_weights = false. Set one of them to its default");
    }
  }

  void Boost(const cai_boost_args& args) {
    if (model_) throw Error(CAI_FAILED_PRECONDITION, "low_level_zero: boost was already called");
    const double configured = Host().optimizer->max_grad_norm(args.optimizer);
    if (max_norm_ > 0 && configured > 0 && max_norm_ != configured) {
      throw Error(CAI_INVALID_ARGUMENT,
                  "low_level_zero: plugin.low_level_zero.max_norm = " + std::to_string(max_norm_) +
                      " and optimizer.max_grad_norm = " + std::to_string(configured) +
                      " disagree; set only one of them");
    }
    model_ = args.model;
    cai::sdk::RequireFp32Params(model_, kName);
    // Everything that trains must start from rank 0's values.
    cai::sdk::BroadcastModel(model_);
    options_.precision = args.precision;
    options_.comm_dtype =
        cai::sdk::DtypeNamed(comm_dtype_name_, cai::sdk::ComputeDtype(args.precision));
    options_.grad_accumulation = args.grad_accumulation;
    zero_.emplace(model_, args.optimizer, cai::sdk::OwnedParams(model_, /*trainable=*/true),
                  options_);
    epilogue_.emplace(args.optimizer, max_norm_);
    if (args.precision == CAI_PRECISION_FP16) epilogue_->EnableLossScaling(scaler_config_);
    cai::sdk::Log(CAI_LOG_INFO, "low_level_zero: " + zero_->Describe());
  }

  void NoSync(bool enabled) { no_sync_ = enabled; }

  void ForwardBackward(const cai_micro_batch& batch) {
    if (!model_) {
      throw Error(CAI_FAILED_PRECONDITION, "low_level_zero: forward_backward before boost");
    }
    zero_->BeginBackward(/*reduce=*/!no_sync_);
    cai::sdk::RunMicroBatch(model_, batch, true, epilogue_->loss_scale());
    zero_->EndBackward();
  }

  void Evaluate(const cai_micro_batch& batch) {
    if (!model_) throw Error(CAI_FAILED_PRECONDITION, "low_level_zero: evaluate before boost");
    zero_->WaitGathers();
    cai::sdk::RunMicroBatch(model_, batch, false);
  }

  void Step(cai_step_result& result) {
    if (!model_) throw Error(CAI_FAILED_PRECONDITION, "low_level_zero: step before boost");
    cai::sdk::StepSums sums =
        zero_->LocalSums(Host().model->num_params(model_), epilogue_->loss_scaling());
    const cai::sdk::StepDecision d = epilogue_->Decide(sums, result);
    zero_->Apply(d, sums.used);
  }

  void ZeroGrad() {
    if (!model_) throw Error(CAI_FAILED_PRECONDITION, "low_level_zero: zero_grad before boost");
    zero_->ZeroGrad();
  }

  // The canonical full layout (what the single-process reference writes), so a checkpoint
  // saved on N ranks loads on M: rank 0 writes what the shards gather into.
  void Save(const cai_checkpoint_args& args) {
    const bool writer = Host().comm->rank(nullptr) == 0;
    zero_->Save(args, writer);
    if (!writer) return;
    if (args.model) cai::sdk::SaveFrozenParams(model_, args.checkpoint);
    if (args.optimizer) epilogue_->Save(args.checkpoint, kName);
  }

  void Load(const cai_checkpoint_args& args) {
    zero_->Load(args);
    if (args.model) cai::sdk::LoadFrozenParams(model_, args.checkpoint);
    if (args.optimizer) epilogue_->Load(args.checkpoint, kName);
  }

  void Stats(cai_strategy_stats& stats) {
    stats.param_bytes = cai::sdk::FrozenParamBytes(model_);
    zero_->AddStats(stats);
    stats.overlap_ratio = zero_->overlap_ratio();
  }

  static void EstimateMemory(const cai_memory_estimate_args& args, cai_memory_estimate& out) {
    cai::sdk::Config config(args.config);
    const bool stage2 = args.config && config.Int("stage") == 2;
    const bool offload = args.config && config.Bool("cpu_offload");
    const bool masters = !args.config || config.Bool("master_weights");
    const bool mixed = args.precision != CAI_PRECISION_FP32;
    if (args.config && cai::sdk::HasLayout(args)) {
      cai::sdk::ZeroOptimizer::Options o;
      o.stage = stage2 ? 2 : 1;
      o.bucket_cap = static_cast<size_t>(config.Float("reduce_bucket_size_in_m") * (1 << 20));
      o.cpu_offload = offload;
      o.master_weights = masters;
      o.precision = args.precision;
      o.comm_dtype = cai::sdk::DtypeNamed(config.String("communication_dtype"),
                                          cai::sdk::ComputeDtype(args.precision));
      cai::sdk::ZeroOptimizer::EstimateMemory(
          {args.param_numel, args.num_layout_params}, args.world_size, o,
          args.optimizer_state_slots,
          cai::sdk::StepEpilogue::AgreementBytes(args.num_layout_params, args.world_size))
          .Fill(out);
      out.formula =
          "this model's buckets as boost lays them out: parameters e·P (P = Σ N·ceil(Ψ_b/N), "
          "buckets padded), gradients (ZeRO-1: e·P full +) e_comm·S shard (S = P/N), masters 4S "
          "(bf16/fp16, or cpu_offload), state 4k·S (on the host with cpu_offload, beside pinned "
          "copies of the gradient shard and the 16-bit shard), plus the device's largest "
          "passing buffer: three consecutive buckets' gradients staged in the communication "
          "dtype (ZeRO-2, or a communication dtype other than the compute dtype), the step's "
          "all-reduce of flags, or a bucket gathered in fp32 for a checkpoint. One micro-batch "
          "per step: ZeRO-2 with train.grad_accum > 1 keeps an fp32 gradient shard (2S more "
          "in bf16/fp16) and passes each reduced chunk through a buffer";
      return;
    }
    const uint64_t psi = static_cast<uint64_t>(args.num_params);
    const uint64_t n = static_cast<uint64_t>(std::max(1, args.world_size));
    const uint64_t shard = (psi + n - 1) / n;
    const uint64_t e = mixed ? 2 : 4;
    out.param_bytes = e * psi;
    out.grad_bytes = (stage2 ? 0 : e * psi) + e * shard;
    out.master_bytes = ((mixed && masters) || offload) ? 4 * shard : 0;
    out.optimizer_state_bytes = 4ull * args.optimizer_state_slots * shard;
    const uint64_t offloaded = offload ? out.master_bytes + out.optimizer_state_bytes : 0;
    out.host_bytes = offloaded;
    out.device_bytes =
        out.param_bytes + out.grad_bytes + out.master_bytes + out.optimizer_state_bytes - offloaded;
    out.formula =
        stage2
            ? (mixed ? "2Ψ + (2 + 4 + 4k)Ψ/N (ZeRO-2; without the model's layout, bucket "
                       "staging not counted)"
                     : "4Ψ + (4 + 4k)Ψ/N (ZeRO-2; without the model's layout, bucket staging "
                       "not counted)")
            : (mixed ? "(2 + 2)Ψ + (2 + 4 + 4k)Ψ/N (ZeRO-1)" : "(4 + 4)Ψ + (4 + 4k)Ψ/N (ZeRO-1)");
  }

 private:
  cai::sdk::ZeroOptimizer::Options options_;
  std::string comm_dtype_name_;
  double max_norm_ = 0;
  cai_loss_scaler_config scaler_config_{};

  cai_model* model_ = nullptr;
  std::optional<cai::sdk::ZeroOptimizer> zero_;
  std::optional<cai::sdk::StepEpilogue> epilogue_;
  bool no_sync_ = false;
};

}  // namespace

CAI_PLUGIN(LowLevelZero)
