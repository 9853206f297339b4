/* A strategy plugin in plain C11, built against the frozen ABI 1.0 headers (tests/abi/v1.0):
 * the "old plugin, new host" case. Its table ends where 1.0's did, so the host must treat
 * everything after it (estimate_memory, since 1.1) as absent.
 *
 * The strategy is plain data parallelism written with ABI 1.0 alone. Every rank holds the whole
 * model; boost broadcasts rank 0's parameters and buffers. After a step's micro-batches, step
 * sums each gradient over the ranks with one all-reduce (the host weights every micro-batch by
 * its share of the global batch, so the SUM is the global-batch mean's gradient), takes the
 * global norm of the summed gradients, asks the host for the clip coefficient and runs the
 * host's fused update with it: the same update on every rank. Checkpoints use the canonical
 * layout ("model/<name>" fp32 weights, "optim/<name>/<slot>" optimizer state, the step count
 * as meta "c_replica.step"), written by rank 0 and read by every rank.
 *
 * Fixture overrides: FIXTURE_MIN_HOST_MINOR, the host minor it claims to need (to test
 * refusal); FIXTURE_NAME and FIXTURE_GRAD_REDUCE_OP, for the negative control of the
 * conformance suite's behaviour checks (CAI_REDUCE_AVG: gradients averaged over ranks instead
 * of summed, its only bug). */
#include <inttypes.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cai/abi.h"

#ifndef FIXTURE_MIN_HOST_MINOR
#define FIXTURE_MIN_HOST_MINOR CAI_TARGET_ABI_MINOR
#endif
#ifndef FIXTURE_NAME
#define FIXTURE_NAME "c_replica"
#endif
#ifndef FIXTURE_GRAD_REDUCE_OP
#define FIXTURE_GRAD_REDUCE_OP CAI_REDUCE_SUM
#endif

#define MAX_SLOTS 4 /* optimizer state slots per parameter (cai_optim_update_args.state) */

static const cai_host_api* host;

static cai_status* fail(cai_status_code code, const char* message) {
  return host->status_create(code, message, strlen(message));
}

/* A parameter this strategy trains: it requires a gradient and is no alias of another
 * (tied_to: the owner holds storage, gradient and state). */
typedef struct trained_param {
  uint32_t index;               /* in the model */
  cai_param_info info;          /* name, group, numel: fixed for the model's lifetime */
  cai_buffer* state[MAX_SLOTS]; /* optimizer state, fp32, NULL past the group's slots */
} trained_param;

struct cai_strategy {
  cai_model* model;
  cai_optimizer* optimizer;
  int64_t step; /* optimizer steps taken: Adam's bias correction, saved with the state */
  bool log_steps;
  uint32_t num_trained;
  trained_param* trained;
};

static const cai_config_key kKeys[] = {
    {CAI_CONFIG_KEY_STRUCT_SIZE, NULL, "log_steps", CAI_CONFIG_BOOL, "false",
     "Log a line after every optimizer step.", NULL, 0, 0, 0},
};

/* One blocking collective on the world group over `tensor` in place, rooted at rank 0. */
static cai_status* collective(cai_comm_op op, cai_reduce_op reduce_op, const cai_tensor* tensor) {
  cai_comm_args args = {.struct_size = CAI_COMM_ARGS_STRUCT_SIZE};
  args.op = op;
  args.reduce_op = reduce_op;
  args.output = tensor;
  args.root = 0;
  return host->comm->run(&args, NULL);
}

static cai_status* create(const cai_create_args* args, cai_strategy** out) {
  if (!args || !out) return fail(CAI_INVALID_ARGUMENT, FIXTURE_NAME ": NULL argument");
  bool log_steps = false;
  cai_status* status = host->config_get_bool(args->config, "log_steps", &log_steps);
  if (status) return status;
  cai_strategy* s = calloc(1, sizeof(cai_strategy));
  if (!s) return fail(CAI_RESOURCE_EXHAUSTED, FIXTURE_NAME ": out of memory");
  s->log_steps = log_steps;
  *out = s;
  return NULL;
}

static void destroy(cai_strategy* s) {
  if (!s) return;
  for (uint32_t k = 0; s->trained && k < s->num_trained; ++k) {
    for (int slot = 0; slot < MAX_SLOTS; ++slot) host->mempool->free(s->trained[k].state[slot]);
  }
  free(s->trained);
  free(s);
}

/* Allocates the zeroed optimizer state of `p` (as many slots as its group's optimizer keeps). */
static cai_status* alloc_state(cai_strategy* s, trained_param* p) {
  cai_optim_group_info group = {.struct_size = CAI_OPTIM_GROUP_INFO_STRUCT_SIZE};
  cai_status* status = host->optimizer->group_info(s->optimizer, p->info.group, &group);
  for (uint32_t slot = 0; !status && slot < group.state_slots && slot < MAX_SLOTS; ++slot) {
    cai_mem_alloc_args alloc = {.struct_size = CAI_MEM_ALLOC_ARGS_STRUCT_SIZE};
    alloc.tier = CAI_MEM_DEVICE;
    alloc.bytes = (size_t)p->info.numel * sizeof(float);
    alloc.tag = "c_replica.state";
    alloc.zero_fill = true;
    status = host->mempool->alloc(&alloc, &p->state[slot]);
  }
  return status;
}

static cai_status* boost(cai_strategy* s, const cai_boost_args* args) {
  if (args->precision != CAI_PRECISION_FP32) {
    return fail(CAI_UNIMPLEMENTED, FIXTURE_NAME " trains in fp32 only");
  }
  s->model = args->model;
  s->optimizer = args->optimizer;
  const uint32_t num_params = host->model->num_params(s->model);
  s->trained = calloc((size_t)num_params + 1, sizeof(trained_param));
  if (!s->trained) return fail(CAI_RESOURCE_EXHAUSTED, FIXTURE_NAME ": out of memory");
  /* Every rank starts from rank 0's parameters (frozen ones too) and buffers. */
  for (uint32_t i = 0; i < num_params; ++i) {
    cai_param_info info = {.struct_size = CAI_PARAM_INFO_STRUCT_SIZE};
    cai_status* status = host->model->param_info(s->model, i, &info);
    if (status) return status;
    if (info.tied_to >= 0) continue;
    cai_tensor data;
    status = host->model->param_data(s->model, i, &data);
    if (!status) status = collective(CAI_COMM_BROADCAST, CAI_REDUCE_SUM, &data);
    if (status) return status;
    if (!(info.flags & CAI_PARAM_REQUIRES_GRAD)) continue;
    trained_param* p = &s->trained[s->num_trained++];
    p->index = i;
    p->info = info;
    status = alloc_state(s, p);
    if (status) return status;
  }
  for (uint32_t b = 0; b < host->model->num_buffers(s->model); ++b) {
    cai_tensor data;
    cai_status* status = host->model->buffer_data(s->model, b, &data);
    if (!status) status = collective(CAI_COMM_BROADCAST, CAI_REDUCE_SUM, &data);
    if (status) return status;
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

/* The parameter's gradient, or *has = false when it has none this step (a parameter the
 * forward did not use: unused on every rank alike, so every rank skips the same collectives). */
static cai_status* gradient(cai_strategy* s, const trained_param* p, cai_tensor* grad, bool* has) {
  cai_status* status = host->model->param_grad(s->model, p->index, grad);
  *has = !status;
  if (status && host->status_code(status) == CAI_FAILED_PRECONDITION) {
    host->status_destroy(status);
    return NULL;
  }
  return status;
}

static cai_status* step(cai_strategy* s, cai_step_result* result) {
  /* Sum every gradient over the ranks, then its squares into the global norm. */
  double sum_squares = 0;
  for (uint32_t k = 0; k < s->num_trained; ++k) {
    cai_tensor grad;
    bool has = false;
    cai_status* status = gradient(s, &s->trained[k], &grad, &has);
    if (status) return status;
    if (!has) continue;
    status = collective(CAI_COMM_ALL_REDUCE, FIXTURE_GRAD_REDUCE_OP, &grad);
    if (status) return status;
    double squares = 0;
    cai_mem_kernel_args kernel = {.struct_size = CAI_MEM_KERNEL_ARGS_STRUCT_SIZE};
    kernel.op = CAI_KERNEL_SUM_SQUARES;
    kernel.y = &grad;
    kernel.result = &squares;
    status = host->mempool->kernel(&kernel);
    if (status) return status;
    sum_squares += squares;
  }
  const double norm = sqrt(sum_squares);
  const double clip = host->optimizer->clip_coefficient(s->optimizer, norm);
  ++s->step;
  /* The same fused update on every rank, the clip coefficient scaling the gradient. */
  for (uint32_t k = 0; k < s->num_trained; ++k) {
    const trained_param* p = &s->trained[k];
    cai_tensor data, grad;
    bool has = false;
    cai_status* status = gradient(s, p, &grad, &has);
    if (status) return status;
    if (!has) continue;
    status = host->model->param_data(s->model, p->index, &data);
    if (status) return status;
    cai_optim_update_args update = {.struct_size = CAI_OPTIM_UPDATE_ARGS_STRUCT_SIZE};
    update.optimizer = s->optimizer;
    update.group = p->info.group;
    update.param = data.data;
    update.grad = grad.data;
    update.grad_dtype = grad.dtype;
    for (int slot = 0; slot < MAX_SLOTS; ++slot) {
      update.state[slot] = p->state[slot] ? host->mempool->data(p->state[slot]) : NULL;
    }
    update.numel = (size_t)p->info.numel;
    update.step = s->step;
    update.lr = host->optimizer->lr_at(s->optimizer, p->info.group, s->step);
    update.grad_scale = clip;
    update.device = data.device;
    status = host->optimizer->update(&update);
    if (status) return status;
  }
  if (s->log_steps) {
    static const char kMessage[] = "step done";
    host->log(CAI_LOG_INFO, FIXTURE_NAME, kMessage, sizeof kMessage - 1);
  }
  if (result->struct_size >= CAI_STRUCT_SIZE(cai_step_result, lr)) {
    result->skipped = false;
    result->grad_norm = norm;
    result->loss_scale = 1.0;
    result->lr = host->optimizer->lr_at(s->optimizer, 0, s->step);
  }
  return NULL;
}

static cai_status* zero_grad(cai_strategy* s) { return host->model->zero_grad(s->model, false); }

/* Calls `fn` on every tensor of the canonical layout: "model/<name>" (the parameter itself)
 * when args->model, "optim/<name>/<slot>" when args->optimizer. */
typedef cai_status* (*tensor_fn)(const cai_checkpoint_args* args, const char* name,
                                 const cai_tensor* tensor);

static cai_status* for_each_tensor(cai_strategy* s, const cai_checkpoint_args* args, tensor_fn fn) {
  cai_status* status = NULL;
  for (uint32_t k = 0; !status && k < s->num_trained; ++k) {
    const trained_param* p = &s->trained[k];
    const size_t length = strlen(p->info.name) + 32;
    char* name = malloc(length);
    if (!name) return fail(CAI_RESOURCE_EXHAUSTED, FIXTURE_NAME ": out of memory");
    if (args->model) {
      cai_tensor data;
      status = host->model->param_data(s->model, p->index, &data);
      snprintf(name, length, "model/%s", p->info.name);
      if (!status) status = fn(args, name, &data);
    }
    for (int slot = 0; !status && args->optimizer && slot < MAX_SLOTS && p->state[slot]; ++slot) {
      cai_tensor view;
      status = host->mempool->view(p->state[slot], (cai_dtype){CAI_DTYPE_FLOAT, 32, 1}, &view);
      snprintf(name, length, "optim/%s/%d", p->info.name, slot);
      if (!status) status = fn(args, name, &view);
    }
    free(name);
  }
  return status;
}

static cai_status* write_tensor(const cai_checkpoint_args* args, const char* name,
                                const cai_tensor* tensor) {
  return host->checkpoint->write_tensor(args->checkpoint, name, tensor);
}

static cai_status* read_tensor(const cai_checkpoint_args* args, const char* name,
                               const cai_tensor* tensor) {
  return host->checkpoint->read_tensor(args->checkpoint, name, 0, 0, tensor);
}

/* Replicated state: rank 0 writes it. */
static cai_status* save(cai_strategy* s, const cai_checkpoint_args* args) {
  if (host->comm->rank(NULL) != 0) return NULL;
  cai_status* status = for_each_tensor(s, args, write_tensor);
  if (status || !args->optimizer) return status;
  char step[32];
  snprintf(step, sizeof step, "%" PRId64, s->step);
  return host->checkpoint->write_meta(args->checkpoint, "c_replica.step", step);
}

/* Every rank reads the whole state, whatever number of ranks saved it. */
static cai_status* load(cai_strategy* s, const cai_checkpoint_args* args) {
  cai_status* status = for_each_tensor(s, args, read_tensor);
  if (status || !args->optimizer) return status;
  const char* step = NULL;
  status = host->checkpoint->read_meta(args->checkpoint, "c_replica.step", &step);
  if (status) return status;
  s->step = strtoll(step, NULL, 10);
  return NULL;
}

static cai_status* stats(cai_strategy* s, cai_strategy_stats* out) {
  for (uint32_t k = 0; k < s->num_trained; ++k) {
    const trained_param* p = &s->trained[k];
    out->param_bytes += (uint64_t)p->info.numel * sizeof(float);
    out->grad_bytes += (uint64_t)p->info.numel * sizeof(float);
    for (int slot = 0; slot < MAX_SLOTS && p->state[slot]; ++slot) {
      out->optimizer_state_bytes += host->mempool->size(p->state[slot]);
    }
  }
  return NULL;
}

static const cai_plugin_api kApi = {CAI_PLUGIN_API_STRUCT_SIZE,
                                    NULL,
                                    FIXTURE_NAME,
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
                                    save,
                                    load,
                                    stats};

CAI_EXPORT cai_status* cai_plugin_init_v1(cai_plugin_init_args* args) {
  if (!args || !args->host) return NULL;
  host = args->host;
  if (args->host_abi_major != CAI_ABI_MAJOR) {
    return fail(CAI_FAILED_PRECONDITION, FIXTURE_NAME " is built for cai ABI 1.x");
  }
  args->plugin_abi_minor = CAI_ABI_MINOR;
  args->plugin_min_host_minor = FIXTURE_MIN_HOST_MINOR;
  args->plugin = &kApi;
  return NULL;
}
