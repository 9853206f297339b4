/* A strategy plugin in plain C11, built against the frozen ABI 1.0 headers (tests/abi/v1.0):
 * the "old plugin, new host" case. Its table ends where 1.0's did, so the host must treat
 * everything after it (estimate_memory, since 1.1) as absent.
 *
 * The strategy itself is a single-process replica: forward/backward through the host, then
 * the host's fused optimizer on every trainable parameter. It refuses more than one rank.
 * FIXTURE_MIN_HOST_MINOR overrides the host minor it claims to need (to test refusal). */
#include <stdlib.h>
#include <string.h>

#include "cai/abi.h"

#ifndef FIXTURE_MIN_HOST_MINOR
#define FIXTURE_MIN_HOST_MINOR CAI_TARGET_ABI_MINOR
#endif

static const cai_host_api* host;

static cai_status* fail(cai_status_code code, const char* message) {
  return host->status_create(code, message, strlen(message));
}

struct cai_strategy {
  cai_model* model;
  cai_optimizer* optimizer;
  int64_t step;
  bool log_steps;
  uint32_t num_params;
  cai_buffer** state; /* num_params * 4 slots, NULL where unused */
};

static const cai_config_key kKeys[] = {
    {CAI_CONFIG_KEY_STRUCT_SIZE, NULL, "log_steps", CAI_CONFIG_BOOL, "false",
     "Log a line after every optimizer step.", NULL, 0, 0, 0},
};

static cai_status* create(const cai_create_args* args, cai_strategy** out) {
  if (!args || !out) return fail(CAI_INVALID_ARGUMENT, "c_replica: NULL argument");
  if (args->world_size != 1) {
    return fail(CAI_FAILED_PRECONDITION,
                "c_replica trains in one process only; use the ddp strategy for several ranks");
  }
  bool log_steps = false;
  cai_status* status = host->config_get_bool(args->config, "log_steps", &log_steps);
  if (status) return status;
  cai_strategy* s = calloc(1, sizeof(cai_strategy));
  if (!s) return fail(CAI_RESOURCE_EXHAUSTED, "c_replica: out of memory");
  s->log_steps = log_steps;
  *out = s;
  return NULL;
}

static void destroy(cai_strategy* s) {
  if (!s) return;
  for (uint32_t i = 0; s->state && i < 4 * s->num_params; ++i) host->mempool->free(s->state[i]);
  free(s->state);
  free(s);
}

static cai_status* boost(cai_strategy* s, const cai_boost_args* args) {
  if (args->precision != CAI_PRECISION_FP32) {
    return fail(CAI_UNIMPLEMENTED, "c_replica trains in fp32 only");
  }
  s->model = args->model;
  s->optimizer = args->optimizer;
  s->num_params = host->model->num_params(s->model);
  s->state = calloc(4 * (size_t)s->num_params + 1, sizeof(cai_buffer*));
  if (!s->state) return fail(CAI_RESOURCE_EXHAUSTED, "c_replica: out of memory");
  for (uint32_t i = 0; i < s->num_params; ++i) {
    cai_param_info info = {.struct_size = CAI_PARAM_INFO_STRUCT_SIZE};
    cai_status* status = host->model->param_info(s->model, i, &info);
    if (status) return status;
    if (!(info.flags & CAI_PARAM_REQUIRES_GRAD) || info.tied_to >= 0) continue;
    cai_optim_group_info group = {.struct_size = CAI_OPTIM_GROUP_INFO_STRUCT_SIZE};
    status = host->optimizer->group_info(s->optimizer, info.group, &group);
    if (status) return status;
    for (uint32_t k = 0; k < group.state_slots && k < 4; ++k) {
      cai_mem_alloc_args alloc = {.struct_size = CAI_MEM_ALLOC_ARGS_STRUCT_SIZE};
      alloc.tier = CAI_MEM_DEVICE;
      alloc.bytes = (size_t)info.numel * sizeof(float);
      alloc.tag = "c_replica.state";
      alloc.zero_fill = true;
      status = host->mempool->alloc(&alloc, &s->state[4 * i + k]);
      if (status) return status;
    }
  }
  return NULL;
}

static cai_status* forward_backward(cai_strategy* s, const cai_micro_batch* batch) {
  cai_forward_backward_args args = {.struct_size = CAI_FORWARD_BACKWARD_ARGS_STRUCT_SIZE};
  args.tokens = batch->tokens;
  args.targets = batch->targets;
  args.backward = true;
  args.loss_weight = batch->loss_weight;
  args.loss = batch->loss;
  return host->model->forward_backward(s->model, &args);
}

static cai_status* step(cai_strategy* s, cai_step_result* result) {
  ++s->step;
  for (uint32_t i = 0; i < s->num_params; ++i) {
    cai_param_info info = {.struct_size = CAI_PARAM_INFO_STRUCT_SIZE};
    cai_status* status = host->model->param_info(s->model, i, &info);
    if (status) return status;
    if (!(info.flags & CAI_PARAM_REQUIRES_GRAD) || info.tied_to >= 0) continue;
    cai_tensor data, grad;
    status = host->model->param_grad(s->model, i, &grad);
    if (status) { /* unused this step */
      host->status_destroy(status);
      continue;
    }
    status = host->model->param_data(s->model, i, &data);
    if (status) return status;
    cai_optim_update_args update = {.struct_size = CAI_OPTIM_UPDATE_ARGS_STRUCT_SIZE};
    update.optimizer = s->optimizer;
    update.group = info.group;
    update.param = data.data;
    update.grad = grad.data;
    update.grad_dtype = grad.dtype;
    for (int k = 0; k < 4; ++k) {
      update.state[k] = s->state[4 * i + k] ? host->mempool->data(s->state[4 * i + k]) : NULL;
    }
    update.numel = (size_t)info.numel;
    update.step = s->step;
    update.lr = host->optimizer->lr_at(s->optimizer, info.group, s->step);
    update.grad_scale = 1.0;
    update.device = data.device;
    status = host->optimizer->update(&update);
    if (status) return status;
  }
  if (s->log_steps) {
    static const char kMessage[] = "step done";
    host->log(CAI_LOG_INFO, "c_replica", kMessage, sizeof kMessage - 1);
  }
  if (result->struct_size >= CAI_STRUCT_SIZE(cai_step_result, lr)) {
    result->skipped = false;
    result->loss_scale = 1.0;
    result->lr = host->optimizer->lr_at(s->optimizer, 0, s->step);
  }
  return NULL;
}

static cai_status* zero_grad(cai_strategy* s) { return host->model->zero_grad(s->model, false); }

static cai_status* no_checkpoint(cai_strategy* s, const cai_checkpoint_args* args) {
  (void)s;
  (void)args;
  return fail(CAI_UNIMPLEMENTED, "c_replica does not checkpoint");
}

static cai_status* stats(cai_strategy* s, cai_strategy_stats* out) {
  (void)s;
  (void)out;
  return NULL;
}

static const cai_plugin_api kApi = {CAI_PLUGIN_API_STRUCT_SIZE,
                                    NULL,
                                    "c_replica",
                                    "1.0.0",
                                    CAI_CAP_PRECISION_FP32,
                                    kKeys,
                                    sizeof kKeys / sizeof kKeys[0],
                                    create,
                                    destroy,
                                    boost,
                                    forward_backward,
                                    NULL,
                                    NULL,
                                    step,
                                    zero_grad,
                                    no_checkpoint,
                                    no_checkpoint,
                                    stats};

CAI_EXPORT cai_status* cai_plugin_init_v1(cai_plugin_init_args* args) {
  if (!args || !args->host) return NULL;
  host = args->host;
  if (args->host_abi_major != CAI_ABI_MAJOR) {
    return fail(CAI_FAILED_PRECONDITION, "c_replica is built for cai ABI 1.x");
  }
  args->plugin_abi_minor = CAI_ABI_MINOR;
  args->plugin_min_host_minor = FIXTURE_MIN_HOST_MINOR;
  args->plugin = &kApi;
  return NULL;
}
