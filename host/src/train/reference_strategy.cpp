#include "train/reference_strategy.h"

#include <cmath>
#include <cstdio>
#include <optional>
#include <string>
#include <vector>

#include "cai/sdk.hpp"

namespace cai {
namespace {

using sdk::Check;
using sdk::Host;

cai_tensor Flat(void* data, int64_t* numel, int64_t* stride, cai_dtype dtype) {
  return cai_tensor{data, {CAI_DEVICE_CPU, 0}, 1, dtype, numel, stride, 0};
}

// Single-process training: forward/backward through the model, then (mixed precision aside)
// exactly what every data-parallel strategy must reproduce: unscale, global-norm clip, fused
// update. Under bf16/fp16 it keeps fp32 master weights and writes the low-precision copy back
// through the fused update; under fp16 it scales the loss dynamically and skips overflowing
// steps.
class Reference {
 public:
  static constexpr const char* kName = "none";
  static constexpr const char* kVersion = CAI_VERSION;
  static constexpr uint64_t kCapabilities =
      CAI_CAP_PRECISION_FP32 | CAI_CAP_PRECISION_BF16 | CAI_CAP_PRECISION_FP16 | CAI_CAP_NO_SYNC;
  static std::span<const cai_config_key> ConfigKeys() {
    static constexpr cai_config_key kKeys[] = {
        sdk::FloatKey("initial_scale", "65536.0", "fp16: initial loss scale.", 1, 0,
                      CAI_CONFIG_HAS_MIN),
        sdk::IntKey("growth_interval", "1000", "fp16: clean steps before the scale doubles.", 1, 0,
                    CAI_CONFIG_HAS_MIN),
        sdk::IntKey("hysteresis", "2", "fp16: overflowing steps before the scale halves.", 1, 0,
                    CAI_CONFIG_HAS_MIN),
    };
    return kKeys;
  }

  explicit Reference(const cai_create_args& args) {
    if (args.world_size != 1) {
      throw sdk::Error(CAI_FAILED_PRECONDITION,
                       "plugin 'none' is the single-process reference and runs on 1 rank; got " +
                           std::to_string(args.world_size) +
                           ". Choose a strategy (--set plugin.name=ddp) for several ranks");
    }
    sdk::Config config(args.config);
    scaler_config_.struct_size = CAI_LOSS_SCALER_CONFIG_STRUCT_SIZE;
    scaler_config_.initial_scale = config.Float("initial_scale");
    scaler_config_.growth_factor = 2;
    scaler_config_.backoff_factor = 0.5;
    scaler_config_.growth_interval = config.Int("growth_interval");
    scaler_config_.hysteresis = config.Int("hysteresis");
    scaler_config_.min_scale = 1;
    scaler_config_.max_scale = 16777216.0 * 256;  // 2^32, ColossalAI's default ceiling
  }

  void Boost(const cai_boost_args& args) {
    model_ = args.model;
    optimizer_ = args.optimizer;
    precision_ = args.precision;
    const auto& model = *Host().model;
    for (uint32_t i = 0; i < model.num_params(model_); ++i) {
      cai_param_info info{};
      info.struct_size = CAI_PARAM_INFO_STRUCT_SIZE;
      Check(model.param_info(model_, i, &info));
      if (info.tied_to >= 0 || !(info.flags & CAI_PARAM_REQUIRES_GRAD)) continue;
      Param p{i, info.group, info.numel, {}, {}};
      cai_optim_group_info group{};
      group.struct_size = CAI_OPTIM_GROUP_INFO_STRUCT_SIZE;
      Check(Host().optimizer->group_info(optimizer_, p.group, &group));
      for (uint32_t s = 0; s < group.state_slots; ++s) {
        p.state.push_back(Alloc(p.numel, "reference.optimizer_state"));
      }
      if (precision_ != CAI_PRECISION_FP32) {
        p.master = Alloc(p.numel, "reference.master");
        cai_tensor data{};
        Check(model.param_data(model_, i, &data));
        Copy(data, p.master, p.numel);
      }
      params_.push_back(std::move(p));
    }
    if (precision_ != CAI_PRECISION_FP32) {
      Check(model.set_compute_dtype(model_, sdk::ComputeDtype(precision_)));
    }
    if (precision_ == CAI_PRECISION_FP16) scaler_.emplace(scaler_config_);
  }

  void NoSync(bool) {}  // nothing is communicated

  void ForwardBackward(const cai_micro_batch& batch) { Run(batch, true); }
  void Evaluate(const cai_micro_batch& batch) { Run(batch, false); }

  void Step(cai_step_result& result) {
    const auto& model = *Host().model;
    const double scale = scaler_ ? scaler_->scale() : 1.0;
    std::vector<cai_tensor> grads(params_.size());
    double sum_squares = 0;
    bool finite = true;
    for (size_t k = 0; k < params_.size(); ++k) {
      cai_status* missing = model.param_grad(model_, params_[k].index, &grads[k]);
      if (missing) {  // unused this step: no gradient, no update (torch.optim semantics)
        Host().status_destroy(missing);
        grads[k].data = nullptr;
        continue;
      }
      double sq = 0;
      Kernel(CAI_KERNEL_SUM_SQUARES, grads[k], &sq);
      sum_squares += sq;
      if (scaler_) {
        double ok = 0;
        Kernel(CAI_KERNEL_ALL_FINITE, grads[k], &ok);
        finite = finite && ok == 1.0;
      }
    }
    result.loss_scale = scale;
    if (scaler_ && scaler_->Update(!finite)) {
      result.skipped = true;
      result.grad_norm = INFINITY;
      result.loss_scale = scaler_->scale();
      return;
    }
    const double norm = std::sqrt(sum_squares) / scale;
    const double coefficient = Host().optimizer->clip_coefficient(optimizer_, norm) / scale;
    ++step_;
    for (size_t k = 0; k < params_.size(); ++k) {
      if (!grads[k].data) continue;
      Param& p = params_[k];
      cai_tensor data{};
      Check(model.param_data(model_, p.index, &data));
      cai_optim_update_args update{};
      update.struct_size = CAI_OPTIM_UPDATE_ARGS_STRUCT_SIZE;
      update.optimizer = optimizer_;
      update.group = p.group;
      if (precision_ == CAI_PRECISION_FP32) {
        update.param = static_cast<float*>(data.data);
      } else {
        update.param = static_cast<float*>(p.master.data());
        update.param_lowp = data.data;
        update.param_lowp_dtype = data.dtype;
      }
      update.grad = grads[k].data;
      update.grad_dtype = grads[k].dtype;
      for (size_t s = 0; s < p.state.size(); ++s) {
        update.state[s] = static_cast<float*>(p.state[s].data());
      }
      update.numel = static_cast<size_t>(p.numel);
      update.step = step_;
      update.lr = Host().optimizer->lr_at(optimizer_, p.group, step_);
      update.grad_scale = coefficient;
      update.device = data.device;
      Check(Host().optimizer->update(&update));
    }
    result.skipped = false;
    result.grad_norm = norm;
    result.loss_scale = scaler_ ? scaler_->scale() : 1.0;
    result.lr = Host().optimizer->lr_at(optimizer_, 0, step_);
  }

  void ZeroGrad() { Check(Host().model->zero_grad(model_, false)); }

  void Save(const cai_checkpoint_args& args) {
    const auto& ckpt = *Host().checkpoint;
    ForEachTensor(args, [&](const std::string& name, const cai_tensor& t) {
      Check(ckpt.write_tensor(args.checkpoint, name.c_str(), &t));
    });
    if (args.optimizer) {
      Check(ckpt.write_meta(args.checkpoint, "none.step", std::to_string(step_).c_str()));
      if (scaler_) {
        cai_loss_scaler_state state{};
        state.struct_size = CAI_LOSS_SCALER_STATE_STRUCT_SIZE;
        Check(Host().optimizer->loss_scaler_get_state(scaler_->get(), &state));
        char text[128];
        std::snprintf(text, sizeof text, "%.17g %lld %lld", state.scale,
                      static_cast<long long>(state.clean_steps),
                      static_cast<long long>(state.overflows_left));
        Check(ckpt.write_meta(args.checkpoint, "none.loss_scaler", text));
      }
    }
  }

  void Load(const cai_checkpoint_args& args) {
    const auto& ckpt = *Host().checkpoint;
    ForEachTensor(args, [&](const std::string& name, const cai_tensor& t) {
      Check(ckpt.read_tensor(args.checkpoint, name.c_str(), 0, 0, &t));
    });
    if (args.model && precision_ != CAI_PRECISION_FP32) {
      // The model's low-precision copy follows the restored masters.
      for (Param& p : params_) {
        cai_tensor data{};
        Check(Host().model->param_data(model_, p.index, &data));
        int64_t numel = p.numel, stride = 1;
        cai_tensor master = Flat(p.master.data(), &numel, &stride, {CAI_DTYPE_FLOAT, 32, 1});
        cai_mem_kernel_args copy{};
        copy.struct_size = CAI_MEM_KERNEL_ARGS_STRUCT_SIZE;
        copy.op = CAI_KERNEL_COPY;
        copy.x = &master;
        copy.y = &data;
        Check(Host().mempool->kernel(&copy));
      }
    }
    if (args.optimizer) {
      const char* step = nullptr;
      Check(ckpt.read_meta(args.checkpoint, "none.step", &step));
      step_ = std::stoll(step);
      if (scaler_) {
        const char* text = nullptr;
        Check(ckpt.read_meta(args.checkpoint, "none.loss_scaler", &text));
        cai_loss_scaler_state state{};
        state.struct_size = CAI_LOSS_SCALER_STATE_STRUCT_SIZE;
        long long clean = 0, left = 0;
        std::sscanf(text, "%lf %lld %lld", &state.scale, &clean, &left);
        state.clean_steps = clean;
        state.overflows_left = left;
        Check(Host().optimizer->loss_scaler_set_state(scaler_->get(), &state));
      }
    }
  }

  void Stats(cai_strategy_stats& stats) {
    for (const Param& p : params_) {
      const uint64_t element = precision_ == CAI_PRECISION_FP32 ? 4 : 2;
      stats.param_bytes += element * p.numel;
      stats.grad_bytes += element * p.numel;
      stats.master_bytes += p.master.size();
      for (const auto& s : p.state) stats.optimizer_state_bytes += s.size();
    }
  }

  static void EstimateMemory(const cai_memory_estimate_args& args, cai_memory_estimate& out) {
    const uint64_t psi = static_cast<uint64_t>(args.num_params);
    const bool mixed = args.precision != CAI_PRECISION_FP32;
    out.param_bytes = (mixed ? 2 : 4) * psi;
    out.grad_bytes = (mixed ? 2 : 4) * psi;
    out.master_bytes = mixed ? 4 * psi : 0;
    out.optimizer_state_bytes = 4ull * args.optimizer_state_slots * psi;
    out.device_bytes =
        out.param_bytes + out.grad_bytes + out.master_bytes + out.optimizer_state_bytes;
    out.formula = mixed ? "(2 + 2 + 4 + 4k)Ψ" : "(4 + 4 + 4k)Ψ";
  }

 private:
  struct Param {
    uint32_t index;
    uint32_t group;
    int64_t numel;
    std::vector<sdk::Buffer> state;
    sdk::Buffer master;
  };

  static sdk::Buffer Alloc(int64_t numel, const char* tag) {
    return sdk::Buffer::Alloc(CAI_MEM_DEVICE, static_cast<size_t>(numel) * sizeof(float), tag,
                              true);
  }

  static void Copy(const cai_tensor& from, const sdk::Buffer& to, int64_t numel) {
    int64_t n = numel, stride = 1;
    cai_tensor dst = Flat(to.data(), &n, &stride, {CAI_DTYPE_FLOAT, 32, 1});
    cai_mem_kernel_args args{};
    args.struct_size = CAI_MEM_KERNEL_ARGS_STRUCT_SIZE;
    args.op = CAI_KERNEL_COPY;
    args.x = &from;
    args.y = &dst;
    Check(Host().mempool->kernel(&args));
  }

  static void Kernel(cai_mem_kernel_op op, const cai_tensor& y, double* result) {
    cai_mem_kernel_args args{};
    args.struct_size = CAI_MEM_KERNEL_ARGS_STRUCT_SIZE;
    args.op = op;
    args.y = &y;
    args.result = result;
    Check(Host().mempool->kernel(&args));
  }

  void Run(const cai_micro_batch& batch, bool backward) {
    cai_forward_backward_args args{};
    args.struct_size = CAI_FORWARD_BACKWARD_ARGS_STRUCT_SIZE;
    args.tokens = batch.tokens;
    args.targets = batch.targets;
    args.backward = backward;
    args.loss_scale = scaler_ ? scaler_->scale() : 1.0;
    args.loss_weight = batch.loss_weight;
    args.loss = batch.loss;
    Check(Host().model->forward_backward(model_, &args));
  }

  // The canonical full layout every strategy's parity is checked in: "model/<name>" holds
  // fp32 weights (the masters under mixed precision), "optim/<name>/<slot>" the state.
  template <class F>
  void ForEachTensor(const cai_checkpoint_args& args, F&& fn) {
    const auto& model = *Host().model;
    for (Param& p : params_) {
      cai_param_info info{};
      info.struct_size = CAI_PARAM_INFO_STRUCT_SIZE;
      Check(model.param_info(model_, p.index, &info));
      int64_t numel = p.numel, stride = 1;
      if (args.model) {
        if (precision_ == CAI_PRECISION_FP32) {
          cai_tensor data{};
          Check(model.param_data(model_, p.index, &data));
          fn("model/" + std::string(info.name), data);
        } else {
          fn("model/" + std::string(info.name),
             Flat(p.master.data(), &numel, &stride, {CAI_DTYPE_FLOAT, 32, 1}));
        }
      }
      if (args.optimizer) {
        for (size_t s = 0; s < p.state.size(); ++s) {
          fn("optim/" + std::string(info.name) + "/" + std::to_string(s),
             Flat(p.state[s].data(), &numel, &stride, {CAI_DTYPE_FLOAT, 32, 1}));
        }
      }
    }
  }

  cai_model* model_ = nullptr;
  cai_optimizer* optimizer_ = nullptr;
  cai_precision precision_ = CAI_PRECISION_FP32;
  cai_loss_scaler_config scaler_config_{};
  std::optional<sdk::LossScaler> scaler_;
  std::vector<Param> params_;
  int64_t step_ = 0;
};

}  // namespace

const cai_plugin_api* ReferenceStrategy(const cai_host_api* host) {
  sdk::HostSlot() = host;
  sdk::PluginNameSlot() = Reference::kName;
  static const cai_plugin_api table = sdk::detail::MakeTable<Reference>();
  return &table;
}

}  // namespace cai
