/* cai ABI v1 — optimizer service.
 *
 * The host owns the optimizer's definition (kind, parameter groups, hyper-parameters,
 * schedule); a strategy owns where the optimizer's state lives. The fused update works on
 * flat fp32 buffers of any length at any offset, so a plugin updates exactly the shard it
 * owns, on whatever tier it keeps it. Also: the learning-rate schedule, a clipping helper and
 * dynamic loss scaling for fp16.
 *
 * Thread-safety: every function is thread-safe; a loss scaler is externally synchronised.
 */
#ifndef CAI_OPTIMIZER_H_
#define CAI_OPTIMIZER_H_

#include "cai/core.h"

#ifdef __cplusplus
extern "C" {
#endif

/* The optimizer the job configured. Owned by the host. */
typedef struct cai_optimizer cai_optimizer;
/* A dynamic loss scaler. Created and destroyed through cai_optim_api. */
typedef struct cai_loss_scaler cai_loss_scaler;

typedef int32_t cai_optim_kind;
enum { CAI_OPTIM_ADAMW = 0, CAI_OPTIM_ADAM = 1, CAI_OPTIM_SGD = 2 };

/* One parameter group's hyper-parameters. Default split by the host: parameters of rank >= 2
 * get weight decay, biases and norm weights do not. */
typedef struct cai_optim_group_info {
  size_t struct_size;
  cai_extension_base* extension_start;
  cai_optim_kind kind;
  double lr;                  /* base learning rate before the schedule */
  double weight_decay;        /* decoupled for ADAMW, L2 for ADAM and SGD */
  double beta1, beta2, eps;   /* ADAM/ADAMW */
  double momentum, dampening; /* SGD */
  bool nesterov;              /* SGD */
  uint32_t state_slots;       /* fp32 state values per parameter element: 2 Adam, 1 SGD+momentum */
} cai_optim_group_info;
#define CAI_OPTIM_GROUP_INFO_STRUCT_SIZE CAI_STRUCT_SIZE(cai_optim_group_info, state_slots)

/* One fused update of `numel` elements of group `group`:
 *   g = grad * grad_scale (grad may be fp32, bf16 or fp16), then the group's rule on
 *   param (fp32), with state[k] the k-th state slot (fp32, numel each).
 * If param_lowp is non-NULL, the updated parameters are also written there in its dtype
 * (bf16/fp16), fusing the master → model copy of mixed precision. All pointers address
 * `numel` elements on `device` (CPU or the host's accelerator). */
typedef struct cai_optim_update_args {
  size_t struct_size;
  cai_extension_base* extension_start;
  cai_optimizer* optimizer;
  uint32_t group;
  float* param;
  const void* grad;
  cai_dtype grad_dtype;
  float* state[4];  /* state_slots entries used, the rest NULL */
  void* param_lowp; /* may be NULL */
  cai_dtype param_lowp_dtype;
  size_t numel;
  int64_t step;      /* 1-based step count for bias correction */
  double lr;         /* learning rate for this step (from lr_at) */
  double grad_scale; /* multiplies the gradient first: 1/loss_scale * clip coefficient */
  cai_device device;
  void* stream;
} cai_optim_update_args;
#define CAI_OPTIM_UPDATE_ARGS_STRUCT_SIZE CAI_STRUCT_SIZE(cai_optim_update_args, stream)

/* Dynamic loss scaling (torch.cuda.amp.GradScaler semantics plus hysteresis as in
 * ColossalAI/DeepSpeed): after `hysteresis` consecutive overflowing steps the scale is
 * multiplied by backoff_factor; after growth_interval clean steps by growth_factor; always
 * clamped to [min_scale, max_scale]. */
typedef struct cai_loss_scaler_config {
  size_t struct_size;
  cai_extension_base* extension_start;
  double initial_scale;
  double growth_factor;
  double backoff_factor;
  int64_t growth_interval;
  int64_t hysteresis;
  double min_scale;
  double max_scale;
} cai_loss_scaler_config;
#define CAI_LOSS_SCALER_CONFIG_STRUCT_SIZE CAI_STRUCT_SIZE(cai_loss_scaler_config, max_scale)

/* What a checkpoint keeps of a loss scaler, so resume continues bit for bit. */
typedef struct cai_loss_scaler_state {
  size_t struct_size;
  cai_extension_base* extension_start;
  double scale;
  int64_t clean_steps;    /* consecutive steps without overflow */
  int64_t overflows_left; /* overflows still tolerated before the next backoff */
} cai_loss_scaler_state;
#define CAI_LOSS_SCALER_STATE_STRUCT_SIZE CAI_STRUCT_SIZE(cai_loss_scaler_state, overflows_left)

typedef struct cai_optim_api {
  size_t struct_size;
  cai_extension_base* extension_start;

  uint32_t (*num_groups)(const cai_optimizer* opt);
  cai_status* (*group_info)(const cai_optimizer* opt, uint32_t group, cai_optim_group_info* out);
  /* Runs one fused update (see cai_optim_update_args); vectorised and multi-threaded on CPU. */
  cai_status* (*update)(const cai_optim_update_args* args);
  /* Learning rate of `group` at 1-based optimizer step `step` (warmup + cosine as configured). */
  double (*lr_at)(const cai_optimizer* opt, uint32_t group, int64_t step);
  /* Gradient clipping by global norm: given the global norm, the factor to multiply
   * gradients by (1 when max_norm <= 0 or the norm is within it). */
  double (*clip_coefficient)(const cai_optimizer* opt, double global_norm);
  /* max_norm configured for the job (0 = no clipping). */
  double (*max_grad_norm)(const cai_optimizer* opt);

  cai_status* (*loss_scaler_create)(const cai_loss_scaler_config* config, cai_loss_scaler** out);
  void (*loss_scaler_destroy)(cai_loss_scaler* scaler);
  double (*loss_scaler_scale)(const cai_loss_scaler* scaler);
  /* Records one step's outcome; returns true when the step must be skipped (found_inf). */
  bool (*loss_scaler_update)(cai_loss_scaler* scaler, bool found_inf);
  cai_status* (*loss_scaler_get_state)(const cai_loss_scaler* scaler, cai_loss_scaler_state* out);
  cai_status* (*loss_scaler_set_state)(cai_loss_scaler* scaler, const cai_loss_scaler_state* state);
} cai_optim_api;
#define CAI_OPTIM_API_STRUCT_SIZE CAI_STRUCT_SIZE(cai_optim_api, loss_scaler_set_state)

#ifdef __cplusplus
} /* extern "C" */
#endif

#endif /* CAI_OPTIMIZER_H_ */
