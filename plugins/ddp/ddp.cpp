// libcai_ddp: data parallelism with a full replica per rank, as PyTorch's
// DistributedDataParallel and ColossalAI's TorchDDPPlugin.
//
// What moves, in order:
//  boost     parameters (and buffers) broadcast from rank 0; trainable parameters re-homed into
//            one flat buffer laid out in bucket order, gradients into another (the buckets);
//            a GRAD_READY hook on every trainable parameter.
//  backward  each gradient, once ready, marks its slot in its bucket (copied into the bucket
//            unless gradient_as_bucket_view made .grad a view of it); a bucket whose last
//            gradient is ready is all-reduced asynchronously (SUM) while backward goes on.
//            Buckets are launched strictly in bucket order, so every rank issues the same
//            collectives in the same order. Under no_sync nothing is communicated.
//  end of    the buckets still pending (parameters that got no gradient) are completed and
//  backward  launched, then every bucket is waited for: when forward_backward returns, the
//            gradients hold the global-batch gradient, as after PyTorch DDP's backward.
//  step      (fp16: overflow check of the reduced buckets) → global norm → clip coefficient →
//            one fused update per run of same-group slots on the flat buffers.
//
// Why SUM and not AVG: the host weights each rank's loss by its share of the global batch
// (rows_on_rank / global_batch / accumulation), so the global-mean gradient is the sum of the
// local gradients. With equal local batches this equals PyTorch's division by world size; with
// 3 ranks splitting a batch unevenly it stays exact where averaging would not.
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
#include <chrono>
#include <cmath>
#include <optional>
#include <string>
#include <vector>

#include "bucket_plan.h"

namespace {

using cai::sdk::Check;
using cai::sdk::ElementSize;
using cai::sdk::Error;
using cai::sdk::FlatView;
using cai::sdk::Host;
using cai::sdk::ParamInfo;
using cai::sdk::RunCollective;
using cai::sdk::RunKernel;
using cai::sdk::SameDtype;
using Clock = std::chrono::steady_clock;

constexpr cai_dtype kF32{CAI_DTYPE_FLOAT, 32, 1};

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
    bucket_cap_bytes_ = static_cast<size_t>(config.Float("bucket_cap_mb") * 1024 * 1024);
    find_unused_ = config.Bool("find_unused_parameters");
    bucket_view_ = config.Bool("gradient_as_bucket_view");
    static_graph_ = config.Bool("static_graph");
    scaler_config_ = cai::sdk::LossScalerConfig(config, kName);
  }

  ~Ddp() {
    // Collectives still in flight write into our buffers: finish them before those go.
    for (Bucket& b : buckets_) b.work = cai::sdk::Work();
    if (hook_id_) Host().status_destroy(Host().model->remove_hook(model_, hook_id_));
  }

  void Boost(const cai_boost_args& args) {
    if (model_) throw Error(CAI_FAILED_PRECONDITION, "ddp: boost was already called");
    model_ = args.model;
    optimizer_ = args.optimizer;
    precision_ = args.precision;
    compute_dtype_ = cai::sdk::ComputeDtype(precision_);
    const auto& model = *Host().model;
    const uint32_t num_params = model.num_params(model_);

    // Trainable parameters, in the order backward is expected to finish them.
    std::vector<uint32_t> ready_order;
    for (uint32_t i = num_params; i-- > 0;) {
      const cai_param_info info = ParamInfo(model_, i);
      if (!SameDtype(info.dtype, kF32)) {
        throw Error(CAI_FAILED_PRECONDITION,
                    std::string("ddp: parameter '") + info.name +
                        "' is not fp32 at boost; ddp keeps fp32 weights and casts them to "
                        "train.precision itself, so save the model in fp32");
      }
      if (info.tied_to >= 0 || !(info.flags & CAI_PARAM_REQUIRES_GRAD)) continue;
      ready_order.push_back(i);
    }
    std::vector<size_t> bytes;
    for (uint32_t i : ready_order) {
      bytes.push_back(static_cast<size_t>(ParamInfo(model_, i).numel) *
                      ElementSize(compute_dtype_));
    }
    slot_of_param_.assign(num_params, -1);
    size_t offset = 0;
    for (const auto& [first, last] : cai::ddp::PlanBuckets(bytes, bucket_cap_bytes_)) {
      Bucket& b = buckets_.emplace_back();
      b.first_slot = slots_.size();
      b.offset = offset;
      for (size_t k = first; k < last; ++k) {
        const cai_param_info info = ParamInfo(model_, ready_order[k]);
        slot_of_param_[ready_order[k]] = static_cast<int32_t>(slots_.size());
        slots_.push_back({ready_order[k], info.group, info.numel, offset, buckets_.size() - 1,
                          std::vector<int64_t>(info.shape, info.shape + info.ndim)});
        offset += static_cast<size_t>(info.numel);
      }
      b.end_slot = slots_.size();
      b.numel = static_cast<int64_t>(offset - b.offset);
    }
    numel_ = offset;
    if (numel_ == 0) {
      throw Error(CAI_FAILED_PRECONDITION,
                  "ddp: the model has no trainable parameters; unfreeze some (model.freeze)");
    }

    // fp32 weights in bucket layout (the masters under mixed precision), filled from the
    // model and broadcast from rank 0 in one collective.
    const bool mixed = precision_ != CAI_PRECISION_FP32;
    weights_ = Alloc(numel_ * 4, mixed ? "ddp.master" : "ddp.param");
    for (Slot& s : slots_) {
      cai_tensor data{};
      Check(model.param_data(model_, s.param, &data));
      cai_tensor dst = SlotView(weights_, kF32, s);
      RunKernel(CAI_KERNEL_COPY, &data, dst, 0);
    }
    int64_t all = static_cast<int64_t>(numel_);
    cai_tensor flat = FlatView(weights_, kF32, 0, &all);
    RunCollective(CAI_COMM_BROADCAST, nullptr, flat, /*async=*/false);
    for (uint32_t i = 0; i < num_params; ++i) {  // frozen parameters must agree as well
      if (slot_of_param_[i] >= 0 || ParamInfo(model_, i).tied_to >= 0) continue;
      cai_tensor data{};
      Check(model.param_data(model_, i, &data));
      RunCollective(CAI_COMM_BROADCAST, nullptr, data, false);
    }
    BroadcastBuffers();

    // The model's parameters become views of the flat buffer (fp32), or of a 16-bit copy of
    // it that the fused update rewrites after each step (bf16/fp16).
    if (mixed) {
      Check(model.set_compute_dtype(model_, compute_dtype_));
      lowp_ = Alloc(numel_ * 2, "ddp.param");
      cai_tensor lowp = FlatView(lowp_, compute_dtype_, 0, &all);
      RunKernel(CAI_KERNEL_COPY, &flat, lowp, 0);
    }
    const cai::sdk::Buffer& params = mixed ? lowp_ : weights_;
    for (Slot& s : slots_) {
      cai_tensor view = SlotView(params, compute_dtype_, s);
      Check(model.replace_param_storage(model_, s.param, &view));
    }

    grads_ = Alloc(numel_ * ElementSize(compute_dtype_), bucket_view_ ? "ddp.grad" : "ddp.bucket");
    if (bucket_view_) {
      for (Slot& s : slots_) {
        cai_tensor view = SlotView(grads_, compute_dtype_, s);
        Check(model.replace_grad_storage(model_, s.param, &view));
      }
    }
    for (Bucket& b : buckets_) b.view = FlatView(grads_, compute_dtype_, b.offset, &b.numel);

    const uint32_t slots = cai::sdk::MaxStateSlots(optimizer_);
    for (uint32_t k = 0; k < slots; ++k) state_.push_back(Alloc(numel_ * 4, "ddp.optim_state"));
    if (precision_ == CAI_PRECISION_FP16) scaler_.emplace(scaler_config_);

    local_used_.assign(slots_.size(), 0);
    ready_.assign(slots_.size(), 0);
    update_.assign(slots_.size(), 1);
    hook_id_ = cai::sdk::OnEveryGradReady(model_, &Ddp::OnGradReadyHook, this);

    std::string sizes;
    for (const Bucket& b : buckets_) {
      sizes += (sizes.empty() ? "" : " ") + std::to_string(b.numel * ElementSize(compute_dtype_));
    }
    cai::sdk::Log(CAI_LOG_INFO, "ddp: " + std::to_string(slots_.size()) + " trainable tensors, " +
                                    std::to_string(numel_) + " elements in " +
                                    std::to_string(buckets_.size()) + " buckets of bytes [" +
                                    sizes + "] on " + std::to_string(world_size_) + " ranks");
  }

  void NoSync(bool enabled) { no_sync_ = enabled; }

  void ForwardBackward(const cai_micro_batch& batch) {
    if (!model_) throw Error(CAI_FAILED_PRECONDITION, "ddp: forward_backward before boost");
    if (broadcast_buffers_) BroadcastBuffers();
    if (reduced_) {
      // Reduced sums mixed with further local gradients cannot be reduced again exactly.
      throw Error(CAI_FAILED_PRECONDITION,
                  "ddp: backward after this step's gradients were already all-reduced; call "
                  "zero_grad after step, and run all but the last micro-batch of a step under "
                  "no_sync(true)");
    }
    const bool sync = !no_sync_;
    if (sync) BeginReduction();
    in_sync_backward_ = sync;
    cai_forward_backward_args args{};
    args.struct_size = CAI_FORWARD_BACKWARD_ARGS_STRUCT_SIZE;
    args.tokens = batch.tokens;
    args.targets = batch.targets;
    args.backward = true;
    args.loss_scale = scaler_ ? scaler_->scale() : 1.0;
    args.loss_weight = batch.loss_weight;
    args.loss = batch.loss;
    cai_status* status = Host().model->forward_backward(model_, &args);
    in_sync_backward_ = false;
    Check(status);
    if (sync) FinishReduction();
  }

  // Forward only. Buffers follow rank 0 first, as PyTorch DDP syncs them before any forward.
  void Evaluate(const cai_micro_batch& batch) {
    if (!model_) throw Error(CAI_FAILED_PRECONDITION, "ddp: evaluate before boost");
    if (broadcast_buffers_) BroadcastBuffers();
    cai_forward_backward_args args{};
    args.struct_size = CAI_FORWARD_BACKWARD_ARGS_STRUCT_SIZE;
    args.tokens = batch.tokens;
    args.targets = batch.targets;
    args.backward = false;
    args.loss = batch.loss;
    Check(Host().model->forward_backward(model_, &args));
  }

  void Step(cai_step_result& result) {
    if (!model_) throw Error(CAI_FAILED_PRECONDITION, "ddp: step before boost");
    // Gradients accumulated under no_sync without a synchronised last micro-batch are reduced
    // here, so a step never applies a rank-local gradient.
    if (!reduced_) {
      BeginReduction();
      FinishReduction();
    }
    const double scale = scaler_ ? scaler_->scale() : 1.0;
    bool finite = true;
    double sum_squares = 0;
    for (Bucket& b : buckets_) {
      if (scaler_) {
        double ok = 0;
        RunKernel(CAI_KERNEL_ALL_FINITE, nullptr, b.view, 0, &ok);
        finite = finite && ok == 1.0;
      }
      double sq = 0;
      RunKernel(CAI_KERNEL_SUM_SQUARES, nullptr, b.view, 0, &sq);
      sum_squares += sq;
    }
    result.loss_scale = scale;
    if (scaler_ && scaler_->Update(!finite)) {
      result.skipped = true;
      result.grad_norm = INFINITY;
      result.loss_scale = scaler_->scale();
      result.lr = Host().optimizer->lr_at(optimizer_, 0, step_ + 1);
      cai::sdk::Log(CAI_LOG_INFO, "ddp: inf/nan in the fp16 gradients; step skipped, loss scale " +
                                      std::to_string(scale) + " -> " +
                                      std::to_string(scaler_->scale()));
      return;
    }
    const double norm = std::sqrt(sum_squares) / scale;
    const double grad_scale = Host().optimizer->clip_coefficient(optimizer_, norm) / scale;
    ++step_;
    // One fused update per run of consecutive slots of one group that are updated this step.
    for (size_t first = 0; first < slots_.size();) {
      if (!update_[first]) {
        ++first;
        continue;
      }
      size_t last = first + 1;
      while (last < slots_.size() && update_[last] && slots_[last].group == slots_[first].group) {
        ++last;
      }
      Update(first, last, grad_scale);
      first = last;
    }
    result.skipped = false;
    result.grad_norm = norm;
    result.loss_scale = scaler_ ? scaler_->scale() : 1.0;
    result.lr = Host().optimizer->lr_at(optimizer_, 0, step_);
  }

  void ZeroGrad() {
    if (!model_) throw Error(CAI_FAILED_PRECONDITION, "ddp: zero_grad before boost");
    for (Bucket& b : buckets_) b.work = cai::sdk::Work();
    if (bucket_view_) {
      int64_t all = static_cast<int64_t>(numel_);
      RunKernel(CAI_KERNEL_FILL, nullptr, FlatView(grads_, compute_dtype_, 0, &all), 0);
    } else {
      // PyTorch's default (set_to_none): the next backward allocates them afresh.
      Check(Host().model->zero_grad(model_, true));
    }
    std::fill(local_used_.begin(), local_used_.end(), 0);
    reduced_ = false;
  }

  // The canonical full layout (what the single-process reference writes): "model/<name>" fp32
  // in the parameter's shape, "optim/<name>/<slot>" fp32 flat; rank 0 writes, every rank
  // reads the same tensors.
  void Save(const cai_checkpoint_args& args) {
    if (Host().comm->rank(nullptr) != 0) return;
    const auto& ckpt = *Host().checkpoint;
    if (args.model) {
      for (const Slot& s : slots_) {
        cai::sdk::WriteAsFp32(args.checkpoint, "model/" + Name(s.param),
                              SlotView(weights_, kF32, s), s.shape);
      }
      ForEachFrozen([&](uint32_t index, const cai_tensor& data) {
        // Frozen weights are model state too; fp32 as the layout says, whatever they compute in.
        cai::sdk::WriteAsFp32(args.checkpoint, "model/" + Name(index), data);
      });
    }
    if (args.optimizer) {
      for (const Slot& s : slots_) {
        for (size_t k = 0; k < StateSlots(s.group); ++k) {
          cai_tensor t = SlotView(state_[k], kF32, s);
          Check(ckpt.write_tensor(
              args.checkpoint, ("optim/" + Name(s.param) + "/" + std::to_string(k)).c_str(), &t));
        }
      }
      Check(ckpt.write_meta(args.checkpoint, "ddp.step", std::to_string(step_).c_str()));
      if (scaler_) cai::sdk::SaveLossScalerState(*scaler_, args.checkpoint, "ddp.loss_scaler");
    }
  }

  void Load(const cai_checkpoint_args& args) {
    const auto& ckpt = *Host().checkpoint;
    if (args.model) {
      for (const Slot& s : slots_) {
        cai_tensor t = SlotView(weights_, kF32, s);
        Check(ckpt.read_tensor(args.checkpoint, ("model/" + Name(s.param)).c_str(), 0, 0, &t));
      }
      if (precision_ != CAI_PRECISION_FP32) {  // the 16-bit parameters follow the masters
        int64_t all = static_cast<int64_t>(numel_);
        cai_tensor master = FlatView(weights_, kF32, 0, &all);
        RunKernel(CAI_KERNEL_COPY, &master, FlatView(lowp_, compute_dtype_, 0, &all), 0);
      }
      ForEachFrozen([&](uint32_t index, const cai_tensor& data) {
        Check(ckpt.read_tensor(args.checkpoint, ("model/" + Name(index)).c_str(), 0, 0, &data));
      });
    }
    if (args.optimizer) {
      for (const Slot& s : slots_) {
        for (size_t k = 0; k < StateSlots(s.group); ++k) {
          cai_tensor t = SlotView(state_[k], kF32, s);
          Check(ckpt.read_tensor(args.checkpoint,
                                 ("optim/" + Name(s.param) + "/" + std::to_string(k)).c_str(), 0, 0,
                                 &t));
        }
      }
      const char* step = nullptr;
      Check(ckpt.read_meta(args.checkpoint, "ddp.step", &step));
      step_ = std::stoll(step);
      if (scaler_) cai::sdk::LoadLossScalerState(*scaler_, args.checkpoint, "ddp.loss_scaler");
    }
  }

  void Stats(cai_strategy_stats& stats) {
    const uint64_t e = ElementSize(compute_dtype_);
    stats.param_bytes = e * numel_;
    ForEachFrozen([&](uint32_t, const cai_tensor& data) {
      int64_t n = 1;
      for (int32_t d = 0; d < data.ndim; ++d) n *= data.shape[d];
      stats.param_bytes += static_cast<uint64_t>(n) * ElementSize(data.dtype);
    });
    // Without bucket views the model's .grad tensors exist beside the buckets.
    stats.grad_bytes = grads_.size() + (bucket_view_ ? 0 : e * numel_);
    for (const auto& s : state_) stats.optimizer_state_bytes += s.size();
    stats.master_bytes = precision_ == CAI_PRECISION_FP32 ? 0 : weights_.size();
    // Share of the communication window (first launch to last completion) that backward
    // compute covered: 1 - (time waited after backward) / (window).
    const double window = (hidden_s_ + exposed_s_);
    stats.overlap_ratio = window > 0 ? hidden_s_ / window : 0;
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
  // A trainable parameter's place in the flat buffers (all laid out alike, in bucket order).
  struct Slot {
    uint32_t param;
    uint32_t group;
    int64_t numel;
    size_t offset;  // elements
    size_t bucket;
    std::vector<int64_t> shape;
  };
  struct Bucket {
    size_t first_slot = 0, end_slot = 0;
    size_t offset = 0;  // elements into the flat buffers
    int64_t numel = 0;
    cai_tensor view{};   // the bucket's slice of grads_
    size_t pending = 0;  // slots not yet ready in this reduction
    bool launched = false;
    cai::sdk::Work work;
  };

  static cai::sdk::Buffer Alloc(size_t bytes, const char* tag) {
    return cai::sdk::Buffer::Alloc(CAI_MEM_DEVICE, bytes, tag, /*zero_fill=*/true);
  }
  static cai_tensor SlotView(const cai::sdk::Buffer& base, cai_dtype dtype, const Slot& s) {
    return FlatView(base, dtype, s.offset, const_cast<int64_t*>(&s.numel));
  }
  std::string Name(uint32_t index) const { return ParamInfo(model_, index).name; }
  size_t StateSlots(uint32_t group) const { return cai::sdk::StateSlots(optimizer_, group); }
  template <class F>
  void ForEachFrozen(F&& fn) {
    for (uint32_t i = 0; i < slot_of_param_.size(); ++i) {
      if (slot_of_param_[i] >= 0 || ParamInfo(model_, i).tied_to >= 0) continue;
      cai_tensor data{};
      Check(Host().model->param_data(model_, i, &data));
      fn(i, data);
    }
  }

  void BroadcastBuffers() {
    const auto& model = *Host().model;
    for (uint32_t i = 0; i < model.num_buffers(model_); ++i) {
      cai_tensor data{};
      Check(model.buffer_data(model_, i, &data));
      RunCollective(CAI_COMM_BROADCAST, nullptr, data, false);
    }
  }

  // ---- Reduction: armed before a synchronised backward, driven by GRAD_READY ---------------

  void BeginReduction() {
    std::fill(ready_.begin(), ready_.end(), 0);
    for (Bucket& b : buckets_) {
      b.pending = b.end_slot - b.first_slot;
      b.launched = false;
    }
    next_launch_ = 0;
    launch_time_.reset();
    // A static graph leaves the same parameters unused every step: mark them at once so their
    // buckets are not held back until the end of backward.
    for (size_t s : static_unused_) MarkReady(s);
  }

  static cai_status* OnGradReadyHook(void* self, const cai_hook_event* event) {
    return cai::sdk::Guard([&] { static_cast<Ddp*>(self)->OnGradReady(event->param); });
  }

  void OnGradReady(int32_t param) {
    if (param < 0 || static_cast<size_t>(param) >= slot_of_param_.size()) return;
    const int32_t slot = slot_of_param_[param];
    if (slot < 0) return;
    local_used_[slot] = 1;
    if (!in_sync_backward_) return;
    if (ready_[slot]) {
      throw Error(CAI_FAILED_PRECONDITION,
                  "ddp: parameter '" + Name(slots_[slot].param) +
                      "' got a gradient although static_graph marked it unused in the first "
                      "step; the set of used parameters changes, so set static_graph = false");
    }
    MarkReady(static_cast<size_t>(slot));
    LaunchReadyBuckets();
  }

  // The slot's gradient is final for this reduction: bring it into the bucket (a copy unless
  // .grad is a view of the bucket already; zeros for a parameter without gradient).
  void MarkReady(size_t slot) {
    const Slot& s = slots_[slot];
    if (!bucket_view_) {
      cai_tensor dst = SlotView(grads_, compute_dtype_, s);
      cai_tensor grad{};
      cai_status* missing = Host().model->param_grad(model_, s.param, &grad);
      if (missing) {
        Host().status_destroy(missing);
        RunKernel(CAI_KERNEL_FILL, nullptr, dst, 0);
      } else {
        RunKernel(CAI_KERNEL_COPY, &grad, dst, 0);
      }
    }
    ready_[slot] = 1;
    --buckets_[s.bucket].pending;
  }

  // Launches, in bucket order, every bucket whose gradients are all ready.
  void LaunchReadyBuckets() {
    while (next_launch_ < buckets_.size() && buckets_[next_launch_].pending == 0) {
      Bucket& b = buckets_[next_launch_++];
      if (!launch_time_) launch_time_ = Clock::now();
      b.work = RunCollective(CAI_COMM_ALL_REDUCE, nullptr, b.view, /*async=*/true);
      b.launched = true;
    }
  }

  // After backward: completes the buckets that wait on parameters without gradient, waits for
  // every all-reduce, settles which parameters the step updates.
  void FinishReduction() {
    const Clock::time_point backward_end = Clock::now();
    std::string unused;
    for (size_t slot = 0; slot < slots_.size(); ++slot) {
      if (ready_[slot]) continue;
      if (!local_used_[slot] && !find_unused_) {
        unused += (unused.empty() ? "'" : ", '") + Name(slots_[slot].param) + "'";
        continue;
      }
      MarkReady(slot);
    }
    if (!unused.empty()) {
      throw Error(CAI_FAILED_PRECONDITION,
                  "ddp: parameters received no gradient in this step: " + unused +
                      ". Set plugin.ddp.find_unused_parameters = true if the model leaves "
                      "parameters unused, or freeze them (model.freeze)");
    }
    LaunchReadyBuckets();
    for (Bucket& b : buckets_) b.work.Wait();
    const Clock::time_point done = Clock::now();
    if (launch_time_) {
      const Clock::time_point start = std::max(*launch_time_, backward_end);
      hidden_s_ += std::chrono::duration<double>(start - *launch_time_).count();
      exposed_s_ += std::chrono::duration<double>(done - start).count();
    }
    if (find_unused_) SettleUnused();
    if (!bucket_view_) CopyBucketsToGrads();
    reduced_ = true;
  }

  // Which parameters got a gradient on some rank (one MAX all-reduce of the local flags, as
  // PyTorch DDP's local_used_map); those unused on every rank are not updated (torch.optim
  // skips a parameter without .grad). A static graph learns this once.
  void SettleUnused() {
    if (static_graph_ && settled_) return;
    // The flags travel in the communicator's memory (device memory under NCCL).
    cai::sdk::Buffer used = Alloc(slots_.size(), "ddp.used");
    Check(Host().mempool->copy(used.data(), local_used_.data(), slots_.size(), nullptr));
    int64_t n = static_cast<int64_t>(slots_.size());
    RunCollective(CAI_COMM_ALL_REDUCE, nullptr, FlatView(used, {CAI_DTYPE_UINT, 8, 1}, 0, &n),
                  false, CAI_REDUCE_MAX);
    Check(Host().mempool->copy(update_.data(), used.data(), slots_.size(), nullptr));
    if (static_graph_) {
      for (size_t s = 0; s < slots_.size(); ++s) {
        if (!local_used_[s]) static_unused_.push_back(s);
      }
      settled_ = true;
    }
  }

  // PyTorch DDP semantics without bucket views: after backward .grad holds the reduced
  // gradient. A parameter this rank left without .grad keeps none.
  void CopyBucketsToGrads() {
    for (const Slot& s : slots_) {
      cai_tensor grad{};
      cai_status* missing = Host().model->param_grad(model_, s.param, &grad);
      if (missing) {
        Host().status_destroy(missing);
        continue;
      }
      cai_tensor src = SlotView(grads_, compute_dtype_, s);
      RunKernel(CAI_KERNEL_COPY, &src, grad, 0);
    }
  }

  void Update(size_t first, size_t last, double grad_scale) {
    const Slot& a = slots_[first];
    const Slot& z = slots_[last - 1];
    const size_t n = z.offset + static_cast<size_t>(z.numel) - a.offset;
    const int64_t count = static_cast<int64_t>(n);
    int64_t numel = count;
    cai_tensor params = FlatView(weights_, kF32, a.offset, &numel);
    cai_tensor grads = FlatView(grads_, compute_dtype_, a.offset, &numel);
    cai_optim_update_args u{};
    u.struct_size = CAI_OPTIM_UPDATE_ARGS_STRUCT_SIZE;
    u.optimizer = optimizer_;
    u.group = a.group;
    u.param = static_cast<float*>(params.data);
    u.grad = grads.data;
    u.grad_dtype = compute_dtype_;
    for (size_t k = 0; k < StateSlots(a.group); ++k) {
      u.state[k] = static_cast<float*>(FlatView(state_[k], kF32, a.offset, &numel).data);
    }
    if (precision_ != CAI_PRECISION_FP32) {
      u.param_lowp = FlatView(lowp_, compute_dtype_, a.offset, &numel).data;
      u.param_lowp_dtype = compute_dtype_;
    }
    u.numel = n;
    u.step = step_;
    u.lr = Host().optimizer->lr_at(optimizer_, a.group, step_);
    u.grad_scale = grad_scale;
    u.device = params.device;
    Check(Host().optimizer->update(&u));
  }

  const int32_t world_size_;
  bool broadcast_buffers_ = true;
  size_t bucket_cap_bytes_ = 0;
  bool find_unused_ = false;
  bool bucket_view_ = false;
  bool static_graph_ = false;
  cai_loss_scaler_config scaler_config_{};

  cai_model* model_ = nullptr;
  cai_optimizer* optimizer_ = nullptr;
  cai_precision precision_ = CAI_PRECISION_FP32;
  cai_dtype compute_dtype_ = kF32;
  uint64_t hook_id_ = 0;

  std::vector<Slot> slots_;             // trainable parameters in bucket order
  std::vector<int32_t> slot_of_param_;  // model parameter index -> slot, -1 if not trainable
  std::vector<Bucket> buckets_;
  size_t numel_ = 0;  // Ψ: trainable elements

  // Flat buffers, Ψ elements each, in slot order.
  cai::sdk::Buffer weights_;             // fp32 parameters (masters under bf16/fp16)
  cai::sdk::Buffer lowp_;                // bf16/fp16 parameters the model computes with
  cai::sdk::Buffer grads_;               // the buckets (and .grad with gradient_as_bucket_view)
  std::vector<cai::sdk::Buffer> state_;  // optimizer state slots
  std::optional<cai::sdk::LossScaler> scaler_;

  // Per step.
  bool no_sync_ = false;
  bool in_sync_backward_ = false;
  bool reduced_ = false;             // the buckets hold this step's reduced gradients
  std::vector<uint8_t> local_used_;  // slot got a gradient on this rank since zero_grad
  std::vector<uint8_t> ready_;       // slot is in its bucket for the current reduction
  std::vector<uint8_t> update_;      // slot is updated by this step (used on some rank)
  size_t next_launch_ = 0;
  std::optional<Clock::time_point> launch_time_;
  bool settled_ = false;
  std::vector<size_t> static_unused_;
  int64_t step_ = 0;
  double hidden_s_ = 0, exposed_s_ = 0;
};

}  // namespace

CAI_PLUGIN(Ddp)
