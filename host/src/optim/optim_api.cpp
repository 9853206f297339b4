#include "optim/optim_api.h"

#include <limits>
#include <memory>
#include <string>

#include "core/status.h"
#include "optim/loss_scaler.h"
#include "optim/optimizer.h"

namespace cai {
namespace {

[[noreturn]] void Invalid(const std::string& message) {
  throw Error(CAI_INVALID_ARGUMENT, message);
}

FloatType RequireFloat(cai_dtype d, const char* what, bool allow_f32) {
  if (d.lanes == 1 && d.code == CAI_DTYPE_FLOAT && d.bits == 32 && allow_f32) {
    return FloatType::kF32;
  }
  if (d.lanes == 1 && d.code == CAI_DTYPE_FLOAT && d.bits == 16) return FloatType::kF16;
  if (d.lanes == 1 && d.code == CAI_DTYPE_BFLOAT && d.bits == 16) return FloatType::kBF16;
  Invalid(std::string("optimizer update: ") + what + " dtype {code " + std::to_string(d.code) +
          ", bits " + std::to_string(d.bits) + ", lanes " + std::to_string(d.lanes) + "} is not " +
          (allow_f32 ? "float32, " : "") + "bfloat16 or float16");
}

const Optimizer& Require(const cai_optimizer* opt) {
  if (!opt) Invalid("optimizer handle is NULL");
  return *FromHandle(opt);
}

uint32_t NumGroups(const cai_optimizer* opt) { return opt ? FromHandle(opt)->num_groups() : 0; }

cai_status* GroupInfo(const cai_optimizer* opt, uint32_t group, cai_optim_group_info* out) {
  return Guard([&] {
    const Optimizer& o = Require(opt);
    RequireStructSize(out, CAI_STRUCT_SIZE(cai_optim_group_info, state_slots),
                      "cai_optim_group_info");
    const GroupHyper& h = o.group(group);
    const uint32_t slots = o.state_slots(group);
    out->kind = o.kind();
    out->lr = h.lr;
    out->weight_decay = h.weight_decay;
    out->beta1 = h.beta1;
    out->beta2 = h.beta2;
    out->eps = h.eps;
    out->momentum = h.momentum;
    out->dampening = h.dampening;
    out->nesterov = h.nesterov;
    out->state_slots = slots;
  });
}

cai_status* Update(const cai_optim_update_args* args) {
  return Guard([&] {
    RequireStructSize(args, CAI_STRUCT_SIZE(cai_optim_update_args, stream),
                      "cai_optim_update_args");
    const Optimizer& o = Require(args->optimizer);
    FusedUpdate u;
    if (args->device.device_type == CAI_DEVICE_CUDA) {
      u.cuda_device = args->device.device_id;
      u.stream = args->stream;
    } else if (args->device.device_type != CAI_DEVICE_CPU &&
               args->device.device_type != CAI_DEVICE_CUDA_HOST) {
      Invalid("optimizer update: device type " + std::to_string(args->device.device_type) +
              " is neither host memory nor a CUDA device");
    }
    u.param = args->param;
    u.grad = args->grad;
    u.grad_type = RequireFloat(args->grad_dtype, "grad", true);
    u.state[0] = args->state[0];
    u.state[1] = args->state[1];
    u.param_lowp = args->param_lowp;
    if (args->param_lowp)
      u.param_lowp_type = RequireFloat(args->param_lowp_dtype, "param_lowp", false);
    u.numel = args->numel;
    u.step = args->step;
    u.lr = args->lr;
    u.grad_scale = args->grad_scale;
    o.Update(args->group, u);
  });
}

double LrAt(const cai_optimizer* opt, uint32_t group, int64_t step) {
  if (!opt || group >= FromHandle(opt)->num_groups()) {
    return std::numeric_limits<double>::quiet_NaN();
  }
  return FromHandle(opt)->LrAt(group, step);
}

double ClipCoefficient(const cai_optimizer* opt, double global_norm) {
  if (!opt) return std::numeric_limits<double>::quiet_NaN();
  return FromHandle(opt)->ClipCoefficient(global_norm);
}

double MaxGradNorm(const cai_optimizer* opt) { return opt ? FromHandle(opt)->max_grad_norm() : 0; }

cai_status* LossScalerCreate(const cai_loss_scaler_config* config, cai_loss_scaler** out) {
  return Guard([&] {
    RequireStructSize(config, CAI_STRUCT_SIZE(cai_loss_scaler_config, max_scale),
                      "cai_loss_scaler_config");
    if (!out) Invalid("loss_scaler_create: out is NULL");
    LossScalerConfig c;
    c.initial_scale = config->initial_scale;
    c.growth_factor = config->growth_factor;
    c.backoff_factor = config->backoff_factor;
    c.growth_interval = config->growth_interval;
    c.hysteresis = config->hysteresis;
    c.min_scale = config->min_scale;
    c.max_scale = config->max_scale;
    *out = ToHandle(std::make_unique<LossScaler>(c).release());
  });
}

void LossScalerDestroy(cai_loss_scaler* scaler) { delete FromHandle(scaler); }

double LossScalerScale(const cai_loss_scaler* scaler) {
  return scaler ? FromHandle(scaler)->scale() : 0;
}

bool LossScalerUpdate(cai_loss_scaler* scaler, bool found_inf) {
  return scaler ? FromHandle(scaler)->Update(found_inf) : true;
}

cai_status* LossScalerGetState(const cai_loss_scaler* scaler, cai_loss_scaler_state* out) {
  return Guard([&] {
    if (!scaler) Invalid("loss scaler handle is NULL");
    RequireStructSize(out, CAI_STRUCT_SIZE(cai_loss_scaler_state, overflows_left),
                      "cai_loss_scaler_state");
    const LossScalerState& s = FromHandle(scaler)->state();
    out->scale = s.scale;
    out->clean_steps = s.clean_steps;
    out->overflows_left = s.overflows_left;
  });
}

cai_status* LossScalerSetState(cai_loss_scaler* scaler, const cai_loss_scaler_state* state) {
  return Guard([&] {
    if (!scaler) Invalid("loss scaler handle is NULL");
    RequireStructSize(state, CAI_STRUCT_SIZE(cai_loss_scaler_state, overflows_left),
                      "cai_loss_scaler_state");
    FromHandle(scaler)->set_state({state->scale, state->clean_steps, state->overflows_left});
  });
}

}  // namespace

const cai_optim_api* OptimApi() {
  static const cai_optim_api api = {
      .struct_size = CAI_OPTIM_API_STRUCT_SIZE,
      .extension_start = nullptr,
      .num_groups = NumGroups,
      .group_info = GroupInfo,
      .update = Update,
      .lr_at = LrAt,
      .clip_coefficient = ClipCoefficient,
      .max_grad_norm = MaxGradNorm,
      .loss_scaler_create = LossScalerCreate,
      .loss_scaler_destroy = LossScalerDestroy,
      .loss_scaler_scale = LossScalerScale,
      .loss_scaler_update = LossScalerUpdate,
      .loss_scaler_get_state = LossScalerGetState,
      .loss_scaler_set_state = LossScalerSetState,
  };
  return &api;
}

}  // namespace cai
