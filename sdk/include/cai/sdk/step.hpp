// cai SDK: the step epilogue every strategy ends an optimizer step with.
//
// Before an update the ranks must agree on three things: the global gradient norm (for
// clipping and for the log), whether some rank's fp16 gradients overflowed (then every rank
// skips the step and the loss scaler backs off), and which parameters got a gradient on some
// rank (torch.optim leaves a parameter without .grad untouched). StepEpilogue settles all three
// with one SUM all-reduce over a group, applies the loss scaler's verdict and the clip
// coefficient, counts the step and fills cai_step_result the same way for every strategy:
//   grad_norm  the unscaled global L2 norm before clipping; +inf on a skipped step;
//   lr         group 0's learning rate at the step made; on a skipped step (nothing updated,
//              the step count unchanged) the rate that step would have applied, which is also
//              the next step's;
//   loss_scale the scale in force for the next step (1 without fp16).
#ifndef CAI_SDK_STEP_HPP_
#define CAI_SDK_STEP_HPP_

#include <algorithm>
#include <cmath>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "cai/sdk.hpp"
#include "cai/sdk/collectives.hpp"

namespace cai::sdk {

// What one rank contributes to a step's agreement.
struct StepSums {
  // Σ g² of the (loss-scaled) gradient elements this rank contributes. Where several ranks
  // hold copies of the same gradient (data-parallel replicas after an all-reduce), only one of
  // them may contribute it, or the caller agrees over a group that holds one copy.
  double sum_squares = 0;
  bool overflow = false;  // an inf/NaN in this rank's fp16 gradients
  // Per model parameter (index = cai_param_info index, or any numbering every rank shares):
  // non-zero where this rank produced a gradient. After Decide: non-zero where any rank did.
  std::vector<double> used;
};

// What the ranks decided.
struct StepDecision {
  bool skipped = false;
  double grad_norm = 0;   // unscaled, before clipping
  double grad_scale = 1;  // multiply the loss-scaled gradients by this: clip / loss_scale
  int64_t step = 0;       // the optimizer step to apply (1-based); unchanged when skipped
};

class StepEpilogue {
 public:
  // Prefix of the checkpoint meta keys every SDK strategy shares ("train.step").
  static constexpr const char* kCommonPrefix = "train";

  // `max_norm` > 0 overrides optimizer.max_grad_norm (a plugin's own clipping key).
  explicit StepEpilogue(cai_optimizer* optimizer = nullptr, double max_norm = 0)
      : optimizer_(optimizer), max_norm_(max_norm) {}
  StepEpilogue(const StepEpilogue&) = delete;
  StepEpilogue& operator=(const StepEpilogue&) = delete;

  // fp16: dynamic loss scaling with this configuration (LossScalerConfig of the plugin's keys).
  void EnableLossScaling(const cai_loss_scaler_config& config) { scaler_.emplace(config); }
  bool loss_scaling() const { return scaler_.has_value(); }
  // The scale to multiply the loss by in this step's backward (1 without loss scaling).
  double loss_scale() const { return scaler_ ? scaler_->scale() : 1.0; }
  int64_t step() const { return step_; }  // optimizer steps made so far

  // Bytes Decide all-reduces to agree over a group of `group_size` on a model of `params`
  // trainable parameters (the sum of squares, the overflow flag and a used flag per parameter,
  // a double each), nothing on one rank: for memory estimates.
  static uint64_t AgreementBytes(uint64_t params, int32_t group_size) {
    return group_size > 1 ? 8 * (2 + params) : 0;
  }

  // Agrees on `sums` over `group` (NULL: the world) when `agree`, else takes them as already
  // global (e.g. DDP's all-reduced buckets, the same on every rank), then decides the step and
  // fills `result`. Collective over `group` when `agree`.
  StepDecision Decide(StepSums& sums, cai_step_result& result, cai_comm_group* group = nullptr,
                      bool agree = true) {
    if (agree && GroupSize(group) > 1) {
      std::vector<double> wire(2 + sums.used.size());
      wire[0] = sums.sum_squares;
      wire[1] = sums.overflow ? 1 : 0;
      std::copy(sums.used.begin(), sums.used.end(), wire.begin() + 2);
      AllReduceValues(wire, group);
      sums.sum_squares = wire[0];
      sums.overflow = wire[1] > 0;
      std::copy(wire.begin() + 2, wire.end(), sums.used.begin());
    }
    const double scale = loss_scale();
    StepDecision d;
    if (scaler_ && scaler_->Update(sums.overflow)) {
      d.skipped = true;
      d.grad_norm = INFINITY;
      d.step = step_;
      result.skipped = true;
      result.grad_norm = INFINITY;
      result.loss_scale = scaler_->scale();
      result.lr = LearningRate(step_ + 1);
      Log(CAI_LOG_INFO, std::string(PluginNameSlot()) +
                            ": inf/nan in the fp16 gradients; step skipped, loss scale " +
                            std::to_string(scale) + " -> " + std::to_string(scaler_->scale()));
      return d;
    }
    d.grad_norm = std::sqrt(sums.sum_squares) / scale;
    d.grad_scale = ClipCoefficient(d.grad_norm) / scale;
    d.step = ++step_;
    result.skipped = false;
    result.grad_norm = d.grad_norm;
    result.loss_scale = loss_scale();
    result.lr = LearningRate(step_);
    return d;
  }

  // A step made without one global gradient (local SGD): counted, reported with grad_norm NaN.
  int64_t CountStep(cai_step_result& result) {
    result.skipped = false;
    result.grad_norm = NAN;
    result.loss_scale = loss_scale();
    result.lr = LearningRate(++step_);
    return step_;
  }

  // The step count and loss scaler as checkpoint metadata under the common keys "train.step"
  // and "train.loss_scaler", which every SDK strategy reads, so one strategy resumes another's
  // optimizer state; and under "<prefix>.step" and "<prefix>.loss_scaler" as well, for hosts
  // and strategies that predate the common keys. Meta keys are unique per checkpoint across
  // ranks: call it on one rank.
  void Save(cai_checkpoint* ckpt, const std::string& prefix) const {
    SaveUnder(ckpt, kCommonPrefix);
    if (prefix != kCommonPrefix) SaveUnder(ckpt, prefix);
  }
  // Reads "train.*" first and falls back to "<prefix>.*" (checkpoints written before the
  // common keys). A checkpoint saved without loss scaling (fp32, bf16) resumes an fp16 run at
  // the configured initial scale.
  void Load(cai_checkpoint* ckpt, const std::string& prefix) {
    const std::string common = std::string(kCommonPrefix) + ".step", own = prefix + ".step";
    std::optional<std::string> step = ReadMetaIfPresent(ckpt, common.c_str());
    std::string found = kCommonPrefix;
    if (!step) {
      step = ReadMetaIfPresent(ckpt, own.c_str());
      found = prefix;
    }
    if (!step) {
      throw Error(CAI_NOT_FOUND, prefix + ": the checkpoint has neither meta '" + common +
                                     "' nor '" + own +
                                     "': a strategy that keeps its step under its own name "
                                     "wrote its optimizer state; resume it with that strategy "
                                     "(plugin.name)");
    }
    step_ = std::stoll(*step);
    const std::string scaler_key = found + ".loss_scaler";
    if (scaler_ && ReadMetaIfPresent(ckpt, scaler_key.c_str())) {
      LoadLossScalerState(*scaler_, ckpt, scaler_key.c_str());
    }
  }

  // The factor clipping multiplies a gradient of norm `norm` by (1 within the limit).
  double ClipCoefficient(double norm) const {
    if (max_norm_ <= 0) return Host().optimizer->clip_coefficient(optimizer_, norm);
    return norm <= max_norm_ ? 1 : max_norm_ / (norm + 1e-6);  // the host's formula
  }

 private:
  void SaveUnder(cai_checkpoint* ckpt, const std::string& prefix) const {
    Check(Host().checkpoint->write_meta(ckpt, (prefix + ".step").c_str(),
                                        std::to_string(step_).c_str()));
    if (scaler_) SaveLossScalerState(*scaler_, ckpt, (prefix + ".loss_scaler").c_str());
  }

  double LearningRate(int64_t step) const {
    return optimizer_ ? Host().optimizer->lr_at(optimizer_, 0, step) : 0;
  }

  cai_optimizer* optimizer_;
  double max_norm_;
  std::optional<LossScaler> scaler_;
  int64_t step_ = 0;
};

}  // namespace cai::sdk

#endif  // CAI_SDK_STEP_HPP_
