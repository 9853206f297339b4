// libcai_low_level_zero: ZeRO stage 1 and stage 2 (Rajbhandari et al., "ZeRO", SC'20), as
// ColossalAI's LowLevelZeroPlugin: every rank keeps the whole model in the compute dtype, and
// owns one even, padded slice of the gradients, the fp32 master weights and the optimizer state.
//
// Layout. Trainable parameters (tied ones once, frozen ones apart) are laid out in the order
// backward finishes them and cut into buckets of at most reduce_bucket_size_in_m·2^20 elements.
// Each bucket is padded to a multiple of the world size N and split into N equal chunks; rank r
// owns chunk r of every bucket (as Megatron-LM's distributed optimizer does), so one bucket is
// one reduce-scatter and one all-gather with no copy. A bucket may hold parameters of several
// optimizer groups: the update runs per run of same-group parameter pieces.
//
// What moves, in order:
//  boost     parameters and buffers broadcast from rank 0; trainable parameters re-homed into
//            one flat buffer (compute dtype) in bucket layout; fp32 masters of this rank's
//            chunks (bf16/fp16, or cpu_offload); optimizer state of the chunks; a GRAD_READY hook.
//  backward  stage 1: .grad is a view of a full flat gradient buffer; under no_sync gradients
//            just accumulate there. On a synchronised backward a bucket whose gradients are all
//            ready is reduce-scattered (SUM, asynchronously with overlap_communication) into this
//            rank's gradient shard, then the full buffer is zeroed.
//            stage 2: each gradient, once ready, is copied into its bucket's staging buffer and
//            released at once; a full bucket is reduce-scattered into the shard and its staging
//            freed. Every micro-batch is reduced (no_sync cannot skip it, there is nowhere to
//            keep a full gradient): accumulating A micro-batches costs A reduce-scatters of Ψ
//            per step instead of one, and the shard accumulates in fp32.
//  step      one SUM all-reduce of [sum of squares of the shard, overflow flag, used flags] —
//            global norm, overflow skip and which parameters got a gradient on any rank, the
//            same on every rank → fused update of this rank's chunks (master → 16-bit copy
//            fused) → all-gather of each bucket in place (asynchronously with
//            overlap_allgather, waited before the next forward, evaluation or checkpoint).
//
// fp16 with accumulation: stage 2 adds each micro-batch's reduced gradient into an fp32 shard,
// where the reference (and stage 1) accumulate .grad in fp16. A scaled sum that overflows
// fp16 there does not overflow here, so stage 2 may skip fewer steps than the reference (seen
// on the tiny test job: 2 skipped steps instead of 4 at an initial scale of 2^20).
//
// Why SUM and not AVG: the host weights each rank's loss by its share of the global batch, so
// the global-mean gradient is the sum of the local gradients (exact also for uneven batches).
//
// Per-rank memory (Ψ trainable elements, N ranks, k optimizer state slots, e = 4 fp32 / 2
// bf16,fp16, shard S = Σ ceil(bucket/N) ≤ Ψ/N + buckets):
//   parameters eΨ + gradients (stage 1: eΨ full + S shard; stage 2: S shard + at most
//   kMaxInFlight staging buckets) + masters 4S (bf16/fp16 or cpu_offload) + state 4kS.
//   With cpu_offload masters and state live on the host tier; the host's fused CPU optimizer
//   updates them from a pinned copy of the gradient shard.
#include <algorithm>
#include <cai/sdk.hpp>
#include <cmath>
#include <deque>
#include <optional>
#include <string>
#include <vector>

namespace {

using cai::sdk::Buffer;
using cai::sdk::Check;
using cai::sdk::ElementSize;
using cai::sdk::Error;
using cai::sdk::FlatView;
using cai::sdk::Host;
using cai::sdk::ParamInfo;
using cai::sdk::RunCollective;
using cai::sdk::RunKernel;
using cai::sdk::SameDtype;

constexpr cai_dtype kF32{CAI_DTYPE_FLOAT, 32, 1};
constexpr cai_dtype kF64{CAI_DTYPE_FLOAT, 64, 1};

// Stage 2 keeps at most this many buckets' staging buffers in flight: the oldest reduction is
// waited for before a further one starts, so gradient memory stays bounded by
// kMaxInFlight buckets plus the shard.
constexpr size_t kMaxInFlight = 2;

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

  explicit LowLevelZero(const cai_create_args& args)
      : rank_(args.rank), world_size_(args.world_size) {
    cai::sdk::Config config(args.config);
    stage_ = static_cast<int>(config.Int("stage"));
    const double bucket_m = config.Float("reduce_bucket_size_in_m");
    bucket_cap_ = static_cast<size_t>(bucket_m * (1 << 20));
    if (bucket_cap_ == 0) {
      throw Error(CAI_INVALID_ARGUMENT,
                  "low_level_zero: reduce_bucket_size_in_m = " + std::to_string(bucket_m) +
                      " is below one element; use at least 1e-6 (the default is 12)");
    }
    overlap_comm_ = config.Bool("overlap_communication");
    comm_dtype_name_ = config.String("communication_dtype");
    overlap_gather_ = config.Bool("overlap_allgather");
    offload_ = config.Bool("cpu_offload");
    master_weights_ = config.Bool("master_weights");
    max_norm_ = config.Float("max_norm");
    scaler_config_ = cai::sdk::LossScalerConfig(config, kName);
    if (offload_ && !master_weights_) {
      throw Error(CAI_INVALID_ARGUMENT,
                  "low_level_zero: cpu_offload keeps fp32 master weights on the host; it "
                  "cannot run with master_weights = false. Set one of them to its default");
    }
  }

  ~LowLevelZero() {
    // Collectives still in flight write into our buffers: finish them before those go.
    gathers_.clear();
    flights_.clear();
    if (hook_id_) Host().status_destroy(Host().model->remove_hook(model_, hook_id_));
  }

  void Boost(const cai_boost_args& args) {
    if (model_) throw Error(CAI_FAILED_PRECONDITION, "low_level_zero: boost was already called");
    model_ = args.model;
    optimizer_ = args.optimizer;
    precision_ = args.precision;
    mixed_ = precision_ != CAI_PRECISION_FP32;
    compute_dtype_ = cai::sdk::ComputeDtype(precision_);
    comm_dtype_ = cai::sdk::DtypeNamed(comm_dtype_name_, compute_dtype_);
    // Several reductions a step accumulate into an fp32 shard (the kernels add into fp32 only).
    const bool accumulates = stage_ == 2 && args.grad_accumulation > 1;
    shard_grad_dtype_ = accumulates ? kF32 : comm_dtype_;
    if (max_norm_ > 0 && Host().optimizer->max_grad_norm(optimizer_) > 0 &&
        max_norm_ != Host().optimizer->max_grad_norm(optimizer_)) {
      throw Error(CAI_INVALID_ARGUMENT,
                  "low_level_zero: plugin.low_level_zero.max_norm = " + std::to_string(max_norm_) +
                      " and optimizer.max_grad_norm = " +
                      std::to_string(Host().optimizer->max_grad_norm(optimizer_)) +
                      " disagree; set only one of them");
    }
    const auto& model = *Host().model;
    const uint32_t num_params = model.num_params(model_);

    // Everything that trains must start from rank 0's values: broadcast in place.
    for (uint32_t i = 0; i < num_params; ++i) {
      const cai_param_info info = ParamInfo(model_, i);
      if (info.tied_to >= 0) continue;
      if (!SameDtype(info.dtype, kF32)) {
        throw Error(CAI_FAILED_PRECONDITION,
                    std::string("low_level_zero: parameter '") + info.name +
                        "' is not fp32 at boost; low_level_zero keeps fp32 masters and casts to "
                        "train.precision itself, so save the model in fp32");
      }
      cai_tensor data{};
      Check(model.param_data(model_, i, &data));
      RunCollective(CAI_COMM_BROADCAST, nullptr, data, false);
    }
    for (uint32_t i = 0; i < model.num_buffers(model_); ++i) {
      cai_tensor data{};
      Check(model.buffer_data(model_, i, &data));
      RunCollective(CAI_COMM_BROADCAST, nullptr, data, false);
    }

    PlanLayout();

    // fp32 masters of this rank's pieces, read straight from the (fp32) model.
    const bool keep_master = (mixed_ && master_weights_) || offload_;
    const cai_mem_tier state_tier = offload_ ? CAI_MEM_HOST : CAI_MEM_DEVICE;
    if (keep_master) {
      master_ = Alloc(state_tier, shard_ * 4, "zero.master");
      for (const Segment& g : segments_) {
        cai_tensor data{};
        Check(model.param_data(model_, slots_[g.slot].param, &data));
        int64_t n = static_cast<int64_t>(g.numel), unit = 1;
        cai_tensor src = data;  // parameters are contiguous at boost
        src.data = static_cast<char*>(data.data) + data.byte_offset + g.param_offset * 4;
        src.byte_offset = 0;
        src.ndim = 1;
        src.shape = &n;
        src.strides = &unit;
        RunKernel(CAI_KERNEL_COPY, &src, FlatView(master_, kF32, g.shard_offset, &n), 0);
      }
    }

    // The model computes on views of one flat buffer in bucket layout (padding zero).
    if (mixed_) Check(model.set_compute_dtype(model_, compute_dtype_));
    params_ = Alloc(CAI_MEM_DEVICE, total_ * ElementSize(compute_dtype_), "zero.param");
    for (const Slot& s : slots_) {
      cai_tensor data{};
      Check(model.param_data(model_, s.param, &data));
      cai_tensor view = SlotView(params_, compute_dtype_, s);
      RunKernel(CAI_KERNEL_COPY, &data, view, 0);
      Check(model.replace_param_storage(model_, s.param, &view));
    }

    if (stage_ == 1) {
      full_grads_ = Alloc(CAI_MEM_DEVICE, total_ * ElementSize(compute_dtype_), "zero.grad");
      for (const Slot& s : slots_) {
        cai_tensor view = SlotView(full_grads_, compute_dtype_, s);
        Check(model.replace_grad_storage(model_, s.param, &view));
      }
    }
    grad_shard_ = Alloc(CAI_MEM_DEVICE, shard_ * ElementSize(shard_grad_dtype_), "zero.grad");

    const uint32_t slots = cai::sdk::MaxStateSlots(optimizer_);
    for (uint32_t k = 0; k < slots; ++k) {
      state_.push_back(Alloc(state_tier, shard_ * 4, "zero.optim_state"));
    }
    if (offload_) {
      // The CPU update reads the gradient shard and writes the 16-bit parameters through
      // pinned copies, which are what moves over PCIe on an accelerator.
      pinned_grad_ = Alloc(CAI_MEM_PINNED_HOST, grad_shard_.size(), "zero.offload_grad");
      if (mixed_) {
        pinned_param_ =
            Alloc(CAI_MEM_PINNED_HOST, shard_ * ElementSize(compute_dtype_), "zero.offload_param");
        int64_t n = static_cast<int64_t>(shard_);
        cai_tensor master = FlatView(master_, kF32, 0, &n);
        RunKernel(CAI_KERNEL_COPY, &master, FlatView(pinned_param_, compute_dtype_, 0, &n), 0);
      }
    }
    if (precision_ == CAI_PRECISION_FP16) scaler_.emplace(scaler_config_);

    local_used_.assign(slots_.size(), 0);
    ready_.assign(slots_.size(), 0);
    update_.assign(slots_.size(), 1);
    hook_id_ = cai::sdk::OnEveryGradReady(model_, &LowLevelZero::OnGradReadyHook, this);

    cai::sdk::Log(CAI_LOG_INFO,
                  "low_level_zero: stage " + std::to_string(stage_) + ", " +
                      std::to_string(slots_.size()) + " trainable tensors, " +
                      std::to_string(numel_) + " elements in " + std::to_string(buckets_.size()) +
                      " buckets; this rank owns " + std::to_string(shard_) + " elements of " +
                      std::to_string(total_) + " (padded) on " + std::to_string(world_size_) +
                      " ranks" + (offload_ ? ", masters and state offloaded to the host" : ""));
  }

  void NoSync(bool enabled) { no_sync_ = enabled; }

  void ForwardBackward(const cai_micro_batch& batch) {
    if (!model_) {
      throw Error(CAI_FAILED_PRECONDITION, "low_level_zero: forward_backward before boost");
    }
    WaitGathers();
    // Stage 2 has no full gradient to accumulate into: every micro-batch is reduced.
    const bool sync = stage_ == 2 || !no_sync_;
    if (sync) BeginReduction();
    in_sync_backward_ = sync;
    cai_status* status = cai::sdk::Guard(
        [&] { cai::sdk::RunMicroBatch(model_, batch, true, scaler_ ? scaler_->scale() : 1.0); });
    in_sync_backward_ = false;
    Check(status);
    if (sync) {
      FinishReduction();
    } else {
      unreduced_ = true;
    }
  }

  void Evaluate(const cai_micro_batch& batch) {
    if (!model_) throw Error(CAI_FAILED_PRECONDITION, "low_level_zero: evaluate before boost");
    WaitGathers();
    cai::sdk::RunMicroBatch(model_, batch, false);
  }

  void Step(cai_step_result& result) {
    if (!model_) throw Error(CAI_FAILED_PRECONDITION, "low_level_zero: step before boost");
    // Stage 1 gradients accumulated under no_sync without a synchronised last micro-batch are
    // reduced here, so a step never applies a rank-local gradient.
    if (unreduced_ || reductions_ == 0) {
      BeginReduction();
      FinishReduction();
    }

    // One all-reduce settles everything the ranks must agree on: [Σ g² of the shards,
    // overflow flag, per-tensor "got a gradient"]. The shard's padding is zero.
    std::vector<double> agreed(2 + slots_.size());
    int64_t n = static_cast<int64_t>(shard_);
    const cai_tensor grads = FlatView(grad_shard_, shard_grad_dtype_, 0, &n);
    RunKernel(CAI_KERNEL_SUM_SQUARES, nullptr, grads, 0, &agreed[0]);
    if (scaler_) {
      double ok = 0;
      RunKernel(CAI_KERNEL_ALL_FINITE, nullptr, grads, 0, &ok);
      agreed[1] = ok == 1.0 ? 0 : 1;
    }
    for (size_t s = 0; s < slots_.size(); ++s) agreed[2 + s] = local_used_[s];
    if (world_size_ > 1) {
      // The values travel in the communicator's memory (device memory under NCCL).
      Buffer wire = Alloc(CAI_MEM_DEVICE, agreed.size() * 8, "zero.control");
      Check(Host().mempool->copy(wire.data(), agreed.data(), wire.size(), nullptr));
      int64_t count = static_cast<int64_t>(agreed.size());
      RunCollective(CAI_COMM_ALL_REDUCE, nullptr, FlatView(wire, kF64, 0, &count), false);
      Check(Host().mempool->copy(agreed.data(), wire.data(), wire.size(), nullptr));
    }
    const double scale = scaler_ ? scaler_->scale() : 1.0;
    result.loss_scale = scale;
    if (scaler_ && scaler_->Update(agreed[1] > 0)) {
      result.skipped = true;
      result.grad_norm = INFINITY;
      result.loss_scale = scaler_->scale();
      result.lr = Host().optimizer->lr_at(optimizer_, 0, step_ + 1);
      cai::sdk::Log(CAI_LOG_INFO,
                    "low_level_zero: inf/nan in the fp16 gradients; step skipped, loss scale " +
                        std::to_string(scale) + " -> " + std::to_string(scaler_->scale()));
      return;
    }
    // torch.optim semantics: a parameter no rank produced a gradient for is not updated.
    for (size_t s = 0; s < slots_.size(); ++s) update_[s] = agreed[2 + s] > 0;
    const double norm = std::sqrt(agreed[0]) / scale;
    const double grad_scale = ClipCoefficient(norm) / scale;
    ++step_;

    if (offload_) {
      Check(Host().mempool->copy(pinned_grad_.data(), grad_shard_.data(), grad_shard_.size(),
                                 nullptr));
    }
    for (size_t b = 0; b < buckets_.size(); ++b) {
      UpdateBucket(b, grad_scale);
      Gather(b);
    }
    if (!overlap_gather_) WaitGathers();
    result.skipped = false;
    result.grad_norm = norm;
    result.loss_scale = scaler_ ? scaler_->scale() : 1.0;
    result.lr = Host().optimizer->lr_at(optimizer_, 0, step_);
  }

  void ZeroGrad() {
    if (!model_) throw Error(CAI_FAILED_PRECONDITION, "low_level_zero: zero_grad before boost");
    // Gradients accumulated under no_sync and never stepped are dropped as asked.
    if (stage_ == 1 && unreduced_) {
      int64_t n = static_cast<int64_t>(total_);
      RunKernel(CAI_KERNEL_FILL, nullptr, FlatView(full_grads_, compute_dtype_, 0, &n), 0);
    }
    if (stage_ == 2) Check(Host().model->zero_grad(model_, true));
    std::fill(local_used_.begin(), local_used_.end(), 0);
    unreduced_ = false;
    reductions_ = 0;
  }

  // The canonical full layout (what the single-process reference writes), so a checkpoint
  // saved on N ranks loads on M: "model/<name>" fp32 in the parameter's shape and
  // "optim/<name>/<slot>" fp32 flat. Sharded values are all-gathered one bucket at a time and
  // rank 0 writes them.
  void Save(const cai_checkpoint_args& args) {
    WaitGathers();
    const bool writer = rank_ == 0;
    const auto& ckpt = *Host().checkpoint;
    if (args.model) {
      if (master_.get()) {
        ForEachGathered(master_, [&](const Buffer& full, size_t b) {
          for (size_t s = buckets_[b].first_slot; s < buckets_[b].end_slot; ++s) {
            if (writer)
              WriteModelTensor(args.checkpoint, full, kF32, buckets_[b].offset, slots_[s]);
          }
        });
      } else if (writer) {
        // Without masters the full parameters are the weights (fp32, or the 16-bit values
        // master_weights = false trains).
        for (const Slot& s : slots_) {
          WriteModelTensor(args.checkpoint, params_, compute_dtype_, 0, s);
        }
      }
      if (writer) {
        ForEachFrozen([&](uint32_t index, const cai_tensor& data) {
          cai::sdk::WriteAsFp32(args.checkpoint, "model/" + Name(index), data);
        });
      }
    }
    if (args.optimizer) {
      for (size_t k = 0; k < state_.size(); ++k) {
        ForEachGathered(state_[k], [&](const Buffer& full, size_t b) {
          if (!writer) return;
          for (size_t s = buckets_[b].first_slot; s < buckets_[b].end_slot; ++s) {
            if (k >= StateSlots(slots_[s].group)) continue;
            int64_t n = slots_[s].numel;
            cai_tensor t = FlatView(full, kF32, slots_[s].offset - buckets_[b].offset, &n);
            Check(ckpt.write_tensor(args.checkpoint,
                                    ("optim/" + slots_[s].name + "/" + std::to_string(k)).c_str(),
                                    &t));
          }
        });
      }
      if (writer) {
        Check(
            ckpt.write_meta(args.checkpoint, "low_level_zero.step", std::to_string(step_).c_str()));
        if (scaler_) {
          cai::sdk::SaveLossScalerState(*scaler_, args.checkpoint, "low_level_zero.loss_scaler");
        }
      }
    }
  }

  // Every rank reads the full parameters and just its own pieces of masters and state, at
  // whatever world size the checkpoint was written.
  void Load(const cai_checkpoint_args& args) {
    WaitGathers();
    const auto& ckpt = *Host().checkpoint;
    if (args.model) {
      for (const Slot& s : slots_) {
        cai_tensor t = SlotView(params_, compute_dtype_, s);
        Check(ckpt.read_tensor(args.checkpoint, ("model/" + s.name).c_str(), 0, 0, &t));
      }
      if (master_.get()) {
        for (const Segment& g : segments_) {
          int64_t n = static_cast<int64_t>(g.numel);
          cai_tensor t = FlatView(master_, kF32, g.shard_offset, &n);
          Check(ckpt.read_tensor(args.checkpoint, ("model/" + slots_[g.slot].name).c_str(),
                                 static_cast<int64_t>(g.param_offset), n, &t));
        }
        if (pinned_param_.get()) {
          int64_t n = static_cast<int64_t>(shard_);
          cai_tensor master = FlatView(master_, kF32, 0, &n);
          RunKernel(CAI_KERNEL_COPY, &master, FlatView(pinned_param_, compute_dtype_, 0, &n), 0);
        }
      }
      ForEachFrozen([&](uint32_t index, const cai_tensor& data) {
        Check(ckpt.read_tensor(args.checkpoint, ("model/" + Name(index)).c_str(), 0, 0, &data));
      });
    }
    if (args.optimizer) {
      for (const Segment& g : segments_) {
        const Slot& s = slots_[g.slot];
        for (size_t k = 0; k < StateSlots(s.group); ++k) {
          int64_t n = static_cast<int64_t>(g.numel);
          cai_tensor t = FlatView(state_[k], kF32, g.shard_offset, &n);
          Check(ckpt.read_tensor(args.checkpoint,
                                 ("optim/" + s.name + "/" + std::to_string(k)).c_str(),
                                 static_cast<int64_t>(g.param_offset), n, &t));
        }
      }
      const char* step = nullptr;
      Check(ckpt.read_meta(args.checkpoint, "low_level_zero.step", &step));
      step_ = std::stoll(step);
      if (scaler_) {
        cai::sdk::LoadLossScalerState(*scaler_, args.checkpoint, "low_level_zero.loss_scaler");
      }
    }
  }

  void Stats(cai_strategy_stats& stats) {
    stats.param_bytes = params_.size() + pinned_param_.size();
    ForEachFrozen([&](uint32_t, const cai_tensor& data) {
      int64_t n = 1;
      for (int32_t d = 0; d < data.ndim; ++d) n *= data.shape[d];
      stats.param_bytes += static_cast<uint64_t>(n) * ElementSize(data.dtype);
    });
    stats.grad_bytes = full_grads_.size() + grad_shard_.size() + pinned_grad_.size();
    for (const auto& s : state_) stats.optimizer_state_bytes += s.size();
    stats.master_bytes = master_.size();
    stats.overlap_ratio = 0;
  }

  static void EstimateMemory(const cai_memory_estimate_args& args, cai_memory_estimate& out) {
    cai::sdk::Config config(args.config);
    const bool stage2 = args.config && config.Int("stage") == 2;
    const bool offload = args.config && config.Bool("cpu_offload");
    const bool masters = !args.config || config.Bool("master_weights");
    const bool mixed = args.precision != CAI_PRECISION_FP32;
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
    out.formula = stage2 ? (mixed ? "2Ψ + (2 + 4 + 4k)Ψ/N (ZeRO-2)" : "4Ψ + (4 + 4k)Ψ/N (ZeRO-2)")
                         : (mixed ? "(2 + 2)Ψ + (2 + 4 + 4k)Ψ/N (ZeRO-1)"
                                  : "(4 + 4)Ψ + (4 + 4k)Ψ/N (ZeRO-1)");
  }

 private:
  // A trainable parameter's place in the flat full buffers.
  struct Slot {
    uint32_t param;
    uint32_t group;
    int64_t numel;
    size_t offset;  // elements into the full buffers
    size_t bucket;
    std::vector<int64_t> shape;
    std::string name;
  };
  // Parameters [first_slot, end_slot), padded to `chunk` elements per rank.
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
    cai::sdk::Work work;
  };

  static Buffer Alloc(cai_mem_tier tier, size_t bytes, const char* tag) {
    return Buffer::Alloc(tier, std::max<size_t>(bytes, 1), tag, /*zero_fill=*/true);
  }
  static cai_tensor SlotView(const Buffer& base, cai_dtype dtype, const Slot& s) {
    return FlatView(base, dtype, s.offset, const_cast<int64_t*>(&s.numel));
  }
  std::string Name(uint32_t index) const { return ParamInfo(model_, index).name; }
  uint32_t StateSlots(uint32_t group) const { return cai::sdk::StateSlots(optimizer_, group); }
  double ClipCoefficient(double norm) const {
    if (max_norm_ <= 0) return Host().optimizer->clip_coefficient(optimizer_, norm);
    return norm <= max_norm_ ? 1 : max_norm_ / (norm + 1e-6);  // the host's formula
  }
  template <class F>
  void ForEachFrozen(F&& fn) {
    for (uint32_t i = 0; i < slot_of_param_.size(); ++i) {
      if (slot_of_param_[i] >= 0 || ParamInfo(model_, i).tied_to >= 0) continue;
      cai_tensor data{};
      Check(Host().model->param_data(model_, i, &data));
      fn(i, data);
    }
  }

  // Buckets in backward order, their padding, and this rank's pieces of each parameter.
  void PlanLayout() {
    const uint32_t num_params = Host().model->num_params(model_);
    slot_of_param_.assign(num_params, -1);
    const size_t n = static_cast<size_t>(world_size_);
    const size_t r = static_cast<size_t>(rank_);
    size_t offset = 0;
    for (uint32_t i = num_params; i-- > 0;) {
      const cai_param_info info = ParamInfo(model_, i);
      if (info.tied_to >= 0 || !(info.flags & CAI_PARAM_REQUIRES_GRAD)) continue;
      const size_t numel = static_cast<size_t>(info.numel);
      // ColossalAI's bucket rule: a parameter that would overflow the bucket starts a new one.
      if (buckets_.empty() ||
          (buckets_.back().numel > 0 && buckets_.back().numel + numel > bucket_cap_)) {
        if (!buckets_.empty()) offset += buckets_.back().chunk * n - buckets_.back().numel;
        Bucket& b = buckets_.emplace_back();
        b.first_slot = b.end_slot = slots_.size();
        b.offset = offset;
      }
      Bucket& b = buckets_.back();
      slot_of_param_[i] = static_cast<int32_t>(slots_.size());
      slots_.push_back({i, info.group, info.numel, offset, buckets_.size() - 1,
                        std::vector<int64_t>(info.shape, info.shape + info.ndim), info.name});
      offset += numel;
      b.numel += numel;
      b.end_slot = slots_.size();
      b.chunk = (b.numel + n - 1) / n;
    }
    if (slots_.empty()) {
      throw Error(CAI_FAILED_PRECONDITION,
                  "low_level_zero: the model has no trainable parameters; unfreeze some "
                  "(model.freeze)");
    }
    offset += buckets_.back().chunk * n - buckets_.back().numel;
    total_ = offset;
    for (Bucket& b : buckets_) {
      b.shard_offset = shard_;
      shard_ += b.chunk;
      numel_ += b.numel;
      const size_t lo = b.offset + r * b.chunk, hi = lo + b.chunk;
      for (size_t s = b.first_slot; s < b.end_slot; ++s) {
        const size_t begin = std::max(lo, slots_[s].offset);
        const size_t end = std::min(hi, slots_[s].offset + static_cast<size_t>(slots_[s].numel));
        if (begin >= end) continue;
        segments_.push_back({s, static_cast<size_t>(&b - buckets_.data()), begin - slots_[s].offset,
                             b.shard_offset + (begin - lo), end - begin});
      }
    }
  }

  // ---- Reduction: armed before a synchronised backward, driven by GRAD_READY ---------------

  void BeginReduction() {
    std::fill(ready_.begin(), ready_.end(), 0);
    pending_.assign(buckets_.size(), 0);
    for (size_t b = 0; b < buckets_.size(); ++b) {
      pending_[b] = buckets_[b].end_slot - buckets_[b].first_slot;
    }
    staging_.clear();
    staging_.resize(buckets_.size());
    next_launch_ = 0;
  }

  static cai_status* OnGradReadyHook(void* self, const cai_hook_event* event) {
    return cai::sdk::Guard([&] { static_cast<LowLevelZero*>(self)->OnGradReady(event->param); });
  }

  void OnGradReady(int32_t param) {
    if (param < 0 || static_cast<size_t>(param) >= slot_of_param_.size()) return;
    const int32_t slot = slot_of_param_[param];
    if (slot < 0) return;
    local_used_[slot] = 1;
    if (!in_sync_backward_ || ready_[slot]) return;
    MarkReady(static_cast<size_t>(slot));
    if (overlap_comm_) LaunchReadyBuckets();
  }

  // The slot's gradient is final for this reduction. Stage 2 moves it into its bucket's
  // staging buffer (zero where the parameter got no gradient) and frees the model's copy.
  void MarkReady(size_t slot) {
    const Slot& s = slots_[slot];
    if (stage_ == 2) {
      Buffer& staging = staging_[s.bucket];
      if (!staging.get()) {
        staging =
            Alloc(CAI_MEM_DEVICE, buckets_[s.bucket].chunk * world_size_ * ElementSize(comm_dtype_),
                  "zero.bucket");
      }
      cai_tensor grad{};
      cai_status* missing = Host().model->param_grad(model_, s.param, &grad);
      if (missing) {
        Host().status_destroy(missing);
      } else {
        int64_t n = s.numel;
        RunKernel(CAI_KERNEL_COPY, &grad,
                  FlatView(staging, comm_dtype_, s.offset - buckets_[s.bucket].offset, &n), 0);
        Check(Host().model->release_grad(model_, s.param));
      }
    }
    ready_[slot] = 1;
    --pending_[s.bucket];
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
    int64_t whole = static_cast<int64_t>(bucket.chunk * world_size_);
    int64_t chunk = static_cast<int64_t>(bucket.chunk);
    if (stage_ == 2) {
      f.staging = std::move(staging_[b]);
    } else if (!SameDtype(comm_dtype_, compute_dtype_)) {
      f.staging = Alloc(CAI_MEM_DEVICE, bucket.chunk * world_size_ * ElementSize(comm_dtype_),
                        "zero.bucket");
      cai_tensor full = FlatView(full_grads_, compute_dtype_, bucket.offset, &whole);
      RunKernel(CAI_KERNEL_COPY, &full, FlatView(f.staging, comm_dtype_, 0, &whole), 0);
    }
    const cai_tensor input = f.staging.get()
                                 ? FlatView(f.staging, comm_dtype_, 0, &whole)
                                 : FlatView(full_grads_, compute_dtype_, bucket.offset, &whole);
    cai_tensor output{};
    if (!f.accumulate && SameDtype(comm_dtype_, shard_grad_dtype_)) {
      output = FlatView(grad_shard_, shard_grad_dtype_, bucket.shard_offset, &chunk);
    } else {
      f.out = Alloc(CAI_MEM_DEVICE, bucket.chunk * ElementSize(comm_dtype_), "zero.bucket");
      output = FlatView(f.out, comm_dtype_, 0, &chunk);
    }
    f.work = RunCollective(CAI_COMM_REDUCE_SCATTER, &input, output, overlap_comm_);
    flights_.push_back(std::move(f));
    // Bounded gradient memory: finish the oldest reduction before starting more.
    while (stage_ == 2 && flights_.size() > kMaxInFlight) Complete();
  }

  // Waits for the oldest reduction and lands its result in the shard.
  void Complete() {
    Flight& f = flights_.front();
    f.work.Wait();
    if (f.out.get()) {
      const Bucket& bucket = buckets_[f.bucket];
      int64_t chunk = static_cast<int64_t>(bucket.chunk);
      cai_tensor out = FlatView(f.out, comm_dtype_, 0, &chunk);
      cai_tensor shard = FlatView(grad_shard_, shard_grad_dtype_, bucket.shard_offset, &chunk);
      RunKernel(f.accumulate ? CAI_KERNEL_AXPY : CAI_KERNEL_COPY, &out, shard, 1.0);
    }
    flights_.pop_front();
  }

  // After backward: the buckets that wait on parameters without gradient are completed and
  // launched, every reduction is waited for.
  void FinishReduction() {
    if (reductions_ > 0 && !SameDtype(shard_grad_dtype_, kF32)) {
      throw Error(CAI_FAILED_PRECONDITION,
                  "low_level_zero: a second gradient reduction in one step, but boost was told "
                  "of no gradient accumulation (train.grad_accum); accumulate with no_sync or "
                  "declare the accumulation");
    }
    for (size_t slot = 0; slot < slots_.size(); ++slot) {
      if (!ready_[slot]) MarkReady(slot);
    }
    LaunchReadyBuckets();
    while (!flights_.empty()) Complete();
    if (stage_ == 1) {
      int64_t n = static_cast<int64_t>(total_);
      RunKernel(CAI_KERNEL_FILL, nullptr, FlatView(full_grads_, compute_dtype_, 0, &n), 0);
    }
    unreduced_ = false;
    ++reductions_;
  }

  // ---- Update and gather --------------------------------------------------------------------

  // One fused update per run of this bucket's segments that share a group and are updated.
  void UpdateBucket(size_t b, double grad_scale) {
    const Bucket& bucket = buckets_[b];
    const size_t chunk_start = bucket.offset + static_cast<size_t>(rank_) * bucket.chunk;
    // master_weights = false under bf16/fp16: the 16-bit values are updated through a
    // transient fp32 copy of this chunk.
    Buffer transient;
    if (mixed_ && !master_.get()) {
      transient = Alloc(CAI_MEM_DEVICE, bucket.chunk * 4, "zero.transient_master");
      int64_t c = static_cast<int64_t>(bucket.chunk);
      cai_tensor lowp = FlatView(params_, compute_dtype_, chunk_start, &c);
      RunKernel(CAI_KERNEL_COPY, &lowp, FlatView(transient, kF32, 0, &c), 0);
    }
    for (size_t i = 0; i < segments_.size();) {
      if (segments_[i].bucket != b || !update_[segments_[i].slot]) {
        ++i;
        continue;
      }
      size_t j = i + 1;
      const uint32_t group = slots_[segments_[i].slot].group;
      while (j < segments_.size() && segments_[j].bucket == b && update_[segments_[j].slot] &&
             slots_[segments_[j].slot].group == group &&
             segments_[j].shard_offset == segments_[j - 1].shard_offset + segments_[j - 1].numel) {
        ++j;
      }
      const size_t first = segments_[i].shard_offset;
      const size_t count = segments_[j - 1].shard_offset + segments_[j - 1].numel - first;
      const size_t in_chunk = first - bucket.shard_offset;
      int64_t n = static_cast<int64_t>(count);
      cai_tensor param;
      if (master_.get()) {
        param = FlatView(master_, kF32, first, &n);
      } else if (transient.get()) {
        param = FlatView(transient, kF32, in_chunk, &n);
      } else {
        param = FlatView(params_, kF32, chunk_start + in_chunk, &n);
      }
      cai_optim_update_args u{};
      u.struct_size = CAI_OPTIM_UPDATE_ARGS_STRUCT_SIZE;
      u.optimizer = optimizer_;
      u.group = group;
      u.param = static_cast<float*>(param.data);
      u.grad = FlatView(offload_ ? pinned_grad_ : grad_shard_, shard_grad_dtype_, first, &n).data;
      u.grad_dtype = shard_grad_dtype_;
      for (size_t k = 0; k < StateSlots(group); ++k) {
        u.state[k] = static_cast<float*>(FlatView(state_[k], kF32, first, &n).data);
      }
      if (mixed_) {
        u.param_lowp = offload_
                           ? FlatView(pinned_param_, compute_dtype_, first, &n).data
                           : FlatView(params_, compute_dtype_, chunk_start + in_chunk, &n).data;
        u.param_lowp_dtype = compute_dtype_;
      }
      u.numel = count;
      u.step = step_;
      u.lr = Host().optimizer->lr_at(optimizer_, group, step_);
      u.grad_scale = grad_scale;
      u.device = param.device;
      Check(Host().optimizer->update(&u));
      i = j;
    }
    if (offload_) {  // the updated chunk back to the device
      const Buffer& src = mixed_ ? pinned_param_ : master_;
      const size_t e = ElementSize(compute_dtype_);
      Check(Host().mempool->copy(static_cast<char*>(params_.data()) + chunk_start * e,
                                 static_cast<const char*>(src.data()) + bucket.shard_offset * e,
                                 bucket.chunk * e, nullptr));
    }
  }

  // All-gathers bucket b's updated chunks in place: chunk r is already where rank r's lands.
  void Gather(size_t b) {
    const Bucket& bucket = buckets_[b];
    int64_t whole = static_cast<int64_t>(bucket.chunk * world_size_);
    int64_t chunk = static_cast<int64_t>(bucket.chunk);
    const cai_tensor output = FlatView(params_, compute_dtype_, bucket.offset, &whole);
    const cai_tensor input = FlatView(
        params_, compute_dtype_, bucket.offset + static_cast<size_t>(rank_) * bucket.chunk, &chunk);
    gathers_.push_back(RunCollective(CAI_COMM_ALL_GATHER, &input, output, overlap_gather_));
  }

  void WaitGathers() {
    for (cai::sdk::Work& w : gathers_) w.Wait();
    gathers_.clear();
  }

  // Calls fn(full, b) for each bucket with `shard` (fp32, shard layout) all-gathered into
  // `full` (bucket layout, bucket b only); collective.
  template <class F>
  void ForEachGathered(const Buffer& shard, F&& fn) {
    for (size_t b = 0; b < buckets_.size(); ++b) {
      const Bucket& bucket = buckets_[b];
      Buffer full = Alloc(CAI_MEM_DEVICE, bucket.chunk * world_size_ * 4, "zero.checkpoint");
      int64_t whole = static_cast<int64_t>(bucket.chunk * world_size_);
      int64_t chunk = static_cast<int64_t>(bucket.chunk);
      const cai_tensor input = FlatView(shard, kF32, bucket.shard_offset, &chunk);
      RunCollective(CAI_COMM_ALL_GATHER, &input, FlatView(full, kF32, 0, &whole), false);
      fn(full, b);
    }
  }

  // Writes slot s as fp32 in its shape from `base` (of `dtype`), whose element 0 is element
  // `base_offset` of the full layout.
  void WriteModelTensor(cai_checkpoint* checkpoint, const Buffer& base, cai_dtype dtype,
                        size_t base_offset, const Slot& s) {
    int64_t n = s.numel;
    cai::sdk::WriteAsFp32(checkpoint, "model/" + s.name,
                          FlatView(base, dtype, s.offset - base_offset, &n), s.shape);
  }

  const int32_t rank_;
  const int32_t world_size_;
  int stage_ = 1;
  size_t bucket_cap_ = 0;  // elements
  bool overlap_comm_ = true;
  std::string comm_dtype_name_;
  bool overlap_gather_ = false;
  bool offload_ = false;
  bool master_weights_ = true;
  double max_norm_ = 0;
  cai_loss_scaler_config scaler_config_{};

  cai_model* model_ = nullptr;
  cai_optimizer* optimizer_ = nullptr;
  cai_precision precision_ = CAI_PRECISION_FP32;
  bool mixed_ = false;
  cai_dtype compute_dtype_ = kF32;
  cai_dtype comm_dtype_ = kF32;
  cai_dtype shard_grad_dtype_ = kF32;
  uint64_t hook_id_ = 0;

  std::vector<Slot> slots_;             // trainable parameters in backward order
  std::vector<int32_t> slot_of_param_;  // model parameter index -> slot, -1 if not trainable
  std::vector<Bucket> buckets_;
  std::vector<Segment> segments_;  // this rank's pieces, in shard order
  size_t numel_ = 0;               // Ψ: trainable elements
  size_t total_ = 0;               // Ψ plus every bucket's padding
  size_t shard_ = 0;               // elements this rank owns

  Buffer params_;      // full parameters, compute dtype, bucket layout: what the model reads
  Buffer full_grads_;  // stage 1: full gradients (.grad views), compute dtype
  Buffer grad_shard_;  // this rank's reduced gradients
  Buffer master_;      // fp32 masters of the shard (bf16/fp16 with master_weights, or offload)
  std::vector<Buffer> state_;  // optimizer state slots of the shard
  Buffer pinned_grad_;         // cpu_offload: the gradient shard as the CPU update reads it
  Buffer pinned_param_;        // cpu_offload, bf16/fp16: the updated 16-bit shard
  std::optional<cai::sdk::LossScaler> scaler_;

  // Per step.
  bool no_sync_ = false;
  bool in_sync_backward_ = false;
  bool unreduced_ = false;           // stage 1: gradients accumulated since the last reduction
  int reductions_ = 0;               // reductions into the shard since zero_grad
  std::vector<uint8_t> local_used_;  // slot got a gradient on this rank since zero_grad
  std::vector<uint8_t> ready_;       // slot is final for the current reduction
  std::vector<uint8_t> update_;      // slot is updated by this step (used on some rank)
  std::vector<size_t> pending_;      // per bucket: slots not yet ready
  std::vector<Buffer> staging_;      // stage 2: per bucket, filled as gradients arrive
  size_t next_launch_ = 0;
  std::deque<Flight> flights_;
  std::vector<cai::sdk::Work> gathers_;
  int64_t step_ = 0;
};

}  // namespace

CAI_PLUGIN(LowLevelZero)
