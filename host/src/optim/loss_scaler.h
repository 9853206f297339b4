// Dynamic loss scaling for fp16 training: torch.cuda.amp.GradScaler's growth and backoff plus
// the hysteresis of ColossalAI's DynamicGradScaler and DeepSpeed's DynamicLossScaler, with the
// scale clamped to [min_scale, max_scale].
//
// On an overflowing step the step is skipped and the growth count restarts; the scale backs
// off only once `hysteresis` consecutive steps have overflowed, and then on every further
// consecutive overflow. A clean step restores the tolerance; growth_interval consecutive clean
// steps multiply the scale by growth_factor.
#pragma once

#include <cstdint>

#include "cai/optimizer.h"

namespace cai {

// ColossalAI's DynamicGradScaler defaults.
struct LossScalerConfig {
  double initial_scale = 65536;
  double growth_factor = 2;
  double backoff_factor = 0.5;
  int64_t growth_interval = 1000;
  int64_t hysteresis = 2;
  double min_scale = 1;           // 0 = no lower clamp
  double max_scale = 4294967296;  // 0 = no upper clamp
};

struct LossScalerState {
  double scale = 0;
  int64_t clean_steps = 0;     // consecutive steps without overflow, < growth_interval
  int64_t overflows_left = 0;  // overflows still tolerated before the next backoff, < hysteresis
};

// Externally synchronised.
class LossScaler {
 public:
  // Throws cai::Error(INVALID_ARGUMENT) naming a bad field.
  explicit LossScaler(const LossScalerConfig& config);

  double scale() const { return state_.scale; }
  // Records one step's outcome; returns true when the step must be skipped (found_inf).
  bool Update(bool found_inf);
  const LossScalerState& state() const { return state_; }
  // Throws INVALID_ARGUMENT for a state this scaler's configuration cannot reach.
  void set_state(const LossScalerState& state);

 private:
  LossScalerConfig config_;
  LossScalerState state_;
};

inline cai_loss_scaler* ToHandle(LossScaler* scaler) {
  return reinterpret_cast<cai_loss_scaler*>(scaler);
}
inline LossScaler* FromHandle(cai_loss_scaler* scaler) {
  return reinterpret_cast<LossScaler*>(scaler);
}
inline const LossScaler* FromHandle(const cai_loss_scaler* scaler) {
  return reinterpret_cast<const LossScaler*>(scaler);
}

}  // namespace cai
