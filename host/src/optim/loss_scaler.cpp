#include "optim/loss_scaler.h"

#include <algorithm>
#include <cmath>
#include <string>

#include "core/status.h"

namespace cai {
namespace {

[[noreturn]] void Invalid(const std::string& message) {
  throw Error(CAI_INVALID_ARGUMENT, "loss scaler: " + message);
}

double Clamp(double scale, const LossScalerConfig& c) {
  if (c.max_scale > 0) scale = std::min(scale, c.max_scale);
  if (c.min_scale > 0) scale = std::max(scale, c.min_scale);
  return scale;
}

}  // namespace

LossScaler::LossScaler(const LossScalerConfig& c) : config_(c) {
  if (!(c.growth_factor > 1 && std::isfinite(c.growth_factor))) {
    Invalid("growth_factor = " + std::to_string(c.growth_factor) + " must be finite and > 1");
  }
  if (!(c.backoff_factor > 0 && c.backoff_factor < 1)) {
    Invalid("backoff_factor = " + std::to_string(c.backoff_factor) + " must lie in (0, 1)");
  }
  if (c.growth_interval < 1) Invalid("growth_interval must be >= 1");
  if (c.hysteresis < 1) Invalid("hysteresis must be >= 1 (1 backs off at every overflow)");
  if (!(c.min_scale >= 0 && c.max_scale >= 0 && std::isfinite(c.min_scale) &&
        std::isfinite(c.max_scale)) ||
      (c.max_scale > 0 && c.min_scale > c.max_scale)) {
    Invalid("min_scale = " + std::to_string(c.min_scale) + " and max_scale = " +
            std::to_string(c.max_scale) + " must be finite, >= 0 and min <= max (0 = no clamp)");
  }
  if (!(c.initial_scale > 0 && std::isfinite(c.initial_scale)) ||
      Clamp(c.initial_scale, c) != c.initial_scale) {
    Invalid("initial_scale = " + std::to_string(c.initial_scale) +
            " must be finite, > 0 and within [min_scale, max_scale]");
  }
  state_ = {c.initial_scale, 0, c.hysteresis - 1};
}

bool LossScaler::Update(bool found_inf) {
  if (found_inf) {
    state_.clean_steps = 0;
    if (state_.overflows_left > 0) {
      --state_.overflows_left;
    } else {
      state_.scale = Clamp(state_.scale * config_.backoff_factor, config_);
    }
    return true;
  }
  state_.overflows_left = config_.hysteresis - 1;
  if (++state_.clean_steps == config_.growth_interval) {
    state_.scale = Clamp(state_.scale * config_.growth_factor, config_);
    state_.clean_steps = 0;
  }
  return false;
}

void LossScaler::set_state(const LossScalerState& s) {
  if (!(s.scale > 0 && std::isfinite(s.scale)) || Clamp(s.scale, config_) != s.scale) {
    Invalid("state scale = " + std::to_string(s.scale) +
            " must be finite, > 0 and within [min_scale, max_scale]");
  }
  if (s.clean_steps < 0 || s.clean_steps >= config_.growth_interval) {
    Invalid("state clean_steps = " + std::to_string(s.clean_steps) + " must lie in [0, " +
            std::to_string(config_.growth_interval) + ")");
  }
  if (s.overflows_left < 0 || s.overflows_left >= config_.hysteresis) {
    Invalid("state overflows_left = " + std::to_string(s.overflows_left) + " must lie in [0, " +
            std::to_string(config_.hysteresis) + ")");
  }
  state_ = s;
}

}  // namespace cai
