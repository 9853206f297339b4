#include "train/reference_strategy.h"

#include <cmath>
#include <cstdio>
#include <optional>
#include <string>
#include <vector>

#include "cai/sdk.hpp"
#include "cai/sdk/flat.hpp"
#include "cai/sdk/step.hpp"

namespace cai {
namespace {

using sdk::Check;
using sdk::Host;

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
    precision_ = args.precision;
    for (uint32_t p : sdk::OwnedParams(model_, /*trainable=*/true)) layout_.Add(model_, p);
    if (layout_.size() == 0) {  // else backward fails deep in autograd
      throw sdk::Error(CAI_FAILED_PRECONDITION,
                       "none: the model has no trainable parameters; unfreeze some (model.freeze)");
    }
    optim_ = sdk::FlatOptimizer(args.optimizer, layout_.numel(), CAI_MEM_DEVICE,
                                "reference.optimizer_state");
    if (precision_ != CAI_PRECISION_FP32) {
      masters_ = sdk::AllocFlat(CAI_MEM_DEVICE, layout_.numel(), sdk::kFloat32, "reference.master");
      sdk::CopyParamsInto(model_, layout_, masters_, sdk::kFloat32);
      Check(Host().model->set_compute_dtype(model_, sdk::ComputeDtype(precision_)));
    }
    epilogue_.emplace(args.optimizer);
    if (precision_ == CAI_PRECISION_FP16) epilogue_->EnableLossScaling(scaler_config_);
  }

  void NoSync(bool) {}  // nothing is communicated

  void ForwardBackward(const cai_micro_batch& batch) {
    sdk::RunMicroBatch(model_, batch, true, epilogue_->loss_scale());
  }
  void Evaluate(const cai_micro_batch& batch) { sdk::RunMicroBatch(model_, batch, false); }

  void Step(cai_step_result& result) {
    const auto& model = *Host().model;
    std::vector<cai_tensor> grads(layout_.size());
    sdk::StepSums sums;
    sums.used.assign(layout_.size(), 0);
    for (size_t k = 0; k < layout_.size(); ++k) {
      cai_status* missing = model.param_grad(model_, layout_[k].param, &grads[k]);
      if (missing) {  // unused this step: no gradient, no update (torch.optim semantics)
        Host().status_destroy(missing);
        continue;
      }
      sums.used[k] = 1;
      double sq = 0;
      sdk::RunKernel(CAI_KERNEL_SUM_SQUARES, nullptr, grads[k], 0, &sq);
      sums.sum_squares += sq;
      if (epilogue_->loss_scaling()) {
        double ok = 0;
        sdk::RunKernel(CAI_KERNEL_ALL_FINITE, nullptr, grads[k], 0, &ok);
        sums.overflow = sums.overflow || ok != 1.0;
      }
    }
    const sdk::StepDecision d = epilogue_->Decide(sums, result);
    if (d.skipped) return;
    for (size_t k = 0; k < layout_.size(); ++k) {
      if (!sums.used[k]) continue;
      cai_tensor data{};
      Check(model.param_data(model_, layout_[k].param, &data));
      sdk::FlatOptimizer::Piece piece;
      piece.group = layout_[k].group;
      piece.offset = layout_[k].offset;
      piece.count = static_cast<size_t>(layout_[k].numel);
      if (precision_ == CAI_PRECISION_FP32) {
        piece.param = static_cast<float*>(data.data);
      } else {
        piece.param = static_cast<float*>(masters_.data()) + layout_[k].offset;
        piece.lowp = data.data;
        piece.lowp_dtype = data.dtype;
      }
      piece.grad = grads[k].data;
      piece.grad_dtype = grads[k].dtype;
      optim_.Update(piece, d.step, d.grad_scale);
    }
  }

  void ZeroGrad() { Check(Host().model->zero_grad(model_, false)); }

  // The canonical full layout every strategy's parity is checked in: "model/<name>" holds
  // fp32 weights (the masters under mixed precision), "optim/<name>/<slot>" the state.
  void Save(const cai_checkpoint_args& args) {
    if (precision_ == CAI_PRECISION_FP32) {
      // The model's own parameters are the weights.
      if (args.model) {
        for (size_t k = 0; k < layout_.size(); ++k) {
          cai_tensor data{};
          Check(Host().model->param_data(model_, layout_[k].param, &data));
          sdk::WriteAsFp32(args.checkpoint, "model/" + layout_[k].name, data);
        }
        sdk::SaveFrozenParams(model_, args.checkpoint);
      }
      cai_checkpoint_args rest = args;
      rest.model = false;
      sdk::SaveFlatReplica(model_, rest, layout_, masters_, optim_);
    } else {
      sdk::SaveFlatReplica(model_, args, layout_, masters_, optim_);
    }
    if (args.optimizer) epilogue_->Save(args.checkpoint, kName);
  }

  void Load(const cai_checkpoint_args& args) {
    if (precision_ == CAI_PRECISION_FP32) {
      if (args.model) {
        for (size_t k = 0; k < layout_.size(); ++k) {
          cai_tensor data{};
          Check(Host().model->param_data(model_, layout_[k].param, &data));
          const std::string name = "model/" + layout_[k].name;
          Check(Host().checkpoint->read_tensor(args.checkpoint, name.c_str(), 0, 0, &data));
        }
        sdk::LoadFrozenParams(model_, args.checkpoint);
      }
      cai_checkpoint_args rest = args;
      rest.model = false;
      sdk::LoadFlatReplica(model_, rest, layout_, masters_, optim_);
    } else {
      sdk::LoadFlatReplica(model_, args, layout_, masters_, optim_);
      // The model's low-precision copy follows the restored masters.
      if (args.model) {
        for (size_t k = 0; k < layout_.size(); ++k) {
          cai_tensor data{};
          Check(Host().model->param_data(model_, layout_[k].param, &data));
          cai_tensor master = layout_.View(masters_, sdk::kFloat32, k);
          sdk::RunKernel(CAI_KERNEL_COPY, &master, data);
        }
      }
    }
    if (args.optimizer) epilogue_->Load(args.checkpoint, kName);
  }

  void Stats(cai_strategy_stats& stats) {
    const uint64_t element = precision_ == CAI_PRECISION_FP32 ? 4 : 2;
    stats.param_bytes = element * layout_.numel() + sdk::FrozenParamBytes(model_);
    stats.grad_bytes = element * layout_.numel();
    stats.master_bytes = masters_.size();
    stats.optimizer_state_bytes = optim_.bytes();
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
  cai_model* model_ = nullptr;
  cai_precision precision_ = CAI_PRECISION_FP32;
  cai_loss_scaler_config scaler_config_{};
  sdk::FlatLayout layout_;  // trainable parameters, registration order
  sdk::Buffer masters_;     // fp32 masters under bf16/fp16, laid out like layout_
  sdk::FlatOptimizer optim_;
  std::optional<sdk::StepEpilogue> epilogue_;
};

}  // namespace

const cai_plugin_api* ReferenceStrategy(const cai_host_api* host) {
  sdk::HostSlot() = host;
  sdk::PluginNameSlot() = Reference::kName;
  static const cai_plugin_api table = sdk::detail::MakeTable<Reference>();
  return &table;
}

}  // namespace cai
