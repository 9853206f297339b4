/* cai ABI v1 — the host table a plugin receives, the strategy table it returns, and the entry
 * point that exchanges them.
 *
 * Lifecycle: the host dlopen()s the plugin (RTLD_NOW | RTLD_LOCAL, from the descriptor it
 * trust-checked and hashed, never unloaded), calls cai_plugin_init_v1 exactly once,
 * single-threaded, then for each job:
 * create → boost → [parallel_layout] → { forward_backward (or execute_pipeline) … → step →
 * zero_grad } … → save/load as asked → destroy. The plugin's table mirrors ColossalAI's
 * Booster plugin.
 */
#ifndef CAI_PLUGIN_H_
#define CAI_PLUGIN_H_

#include "cai/comm.h"
#include "cai/core.h"
#include "cai/mempool.h"
#include "cai/model.h"
#include "cai/optimizer.h"

#ifdef __cplusplus
extern "C" {
#endif

/* ---- Checkpoint writer/reader ----------------------------------------------------------- */

/* A checkpoint being written or read by this rank: a directory the host made (atomically
 * renamed into place once every rank has finished writing). A strategy stores named tensors
 * in its own layout (full, sharded, per rank) and small metadata strings. Owned by the host;
 * valid during the save/load call only. */
typedef struct cai_checkpoint cai_checkpoint;

typedef struct cai_ckpt_tensor_info {
  size_t struct_size;
  cai_extension_base* extension_start;
  cai_dtype dtype;
  int32_t ndim;
  int64_t shape[8];
} cai_ckpt_tensor_info;
#define CAI_CKPT_TENSOR_INFO_STRUCT_SIZE CAI_STRUCT_SIZE(cai_ckpt_tensor_info, shape)

typedef struct cai_checkpoint_api {
  size_t struct_size;
  cai_extension_base* extension_start;
  /* Writes `tensor` (contiguous, host or device) under `name` ("model/blocks.0.w",
   * "optim/rank1/exp_avg"); names are unique per checkpoint across all ranks. */
  cai_status* (*write_tensor)(cai_checkpoint* ckpt, const char* name, const cai_tensor* tensor);
  /* Reads a tensor written under `name` (by any rank) into `dst`, which must match its numel;
   * dtype is converted when they differ. offset/count select elements [offset, offset+count)
   * of the flattened tensor so a rank reads only its shard (count 0 = all). NOT_FOUND names
   * the missing entry. */
  cai_status* (*read_tensor)(cai_checkpoint* ckpt, const char* name, int64_t offset, int64_t count,
                             const cai_tensor* dst);
  cai_status* (*tensor_info)(cai_checkpoint* ckpt, const char* name, cai_ckpt_tensor_info* out);
  /* Small UTF-8 metadata (JSON or TOML text of the plugin's choice). The read string lives
   * until the checkpoint call returns. */
  cai_status* (*write_meta)(cai_checkpoint* ckpt, const char* key, const char* value);
  cai_status* (*read_meta)(cai_checkpoint* ckpt, const char* key, const char** value);
  /* World size and rank of the run that wrote the checkpoint (for resharding on load). */
  int32_t (*saved_world_size)(const cai_checkpoint* ckpt);
} cai_checkpoint_api;
#define CAI_CHECKPOINT_API_STRUCT_SIZE CAI_STRUCT_SIZE(cai_checkpoint_api, saved_world_size)

/* ---- Host table ------------------------------------------------------------------------- */

/* Services the host gives every plugin. Valid for the process lifetime; thread-safe unless a
 * function says otherwise. */
typedef struct cai_host_api {
  size_t struct_size;
  cai_extension_base* extension_start;
  uint32_t abi_major;
  uint32_t abi_minor;
  const char* host_version; /* "0.1.0" */

  /* Statuses: the message is copied; status_message lives as long as the status. */
  cai_status* (*status_create)(cai_status_code code, const char* message, size_t length);
  void (*status_destroy)(cai_status* status);
  cai_status_code (*status_code)(const cai_status* status);
  const char* (*status_message)(const cai_status* status);

  /* Log sink: the host's logger, which prefixes rank and source. */
  void (*log)(cai_log_level level, const char* source, const char* message, size_t length);

  /* Typed access to a validated configuration. NOT_FOUND for a key the plugin did not
   * declare, INVALID_ARGUMENT for a type other than the declared one. Returned strings live
   * as long as the configuration. */
  cai_status* (*config_get_bool)(const cai_config* config, const char* key, bool* out);
  cai_status* (*config_get_int)(const cai_config* config, const char* key, int64_t* out);
  cai_status* (*config_get_float)(const cai_config* config, const char* key, double* out);
  cai_status* (*config_get_string)(const cai_config* config, const char* key, const char** out);

  const cai_model_api* model;
  const cai_optim_api* optimizer;
  const cai_comm_api* comm;
  const cai_mem_api* mempool;
  const cai_checkpoint_api* checkpoint;
} cai_host_api;
#define CAI_HOST_API_STRUCT_SIZE CAI_STRUCT_SIZE(cai_host_api, checkpoint)

/* ---- Strategy table --------------------------------------------------------------------- */

/* A strategy instance. Opaque to the host. Externally synchronised: the host calls one
 * function of an instance at a time. */
typedef struct cai_strategy cai_strategy;

/* cai_plugin_api.capabilities */
#define CAI_CAP_PRECISION_FP32 ((uint64_t)1 << 0)
#define CAI_CAP_PRECISION_BF16 ((uint64_t)1 << 1)
#define CAI_CAP_PRECISION_FP16 ((uint64_t)1 << 2)
#define CAI_CAP_NO_SYNC ((uint64_t)1 << 3)
#define CAI_CAP_CPU_OFFLOAD ((uint64_t)1 << 4)
#define CAI_CAP_PIPELINE ((uint64_t)1 << 5)
#define CAI_CAP_SHARDED_CHECKPOINT ((uint64_t)1 << 6)
#define CAI_CAP_TENSOR_PARALLEL ((uint64_t)1 << 7)

typedef int32_t cai_precision;
enum { CAI_PRECISION_FP32 = 0, CAI_PRECISION_BF16 = 1, CAI_PRECISION_FP16 = 2 };

typedef struct cai_create_args {
  size_t struct_size;
  cai_extension_base* extension_start;
  const cai_config* config; /* the plugin's validated table; valid until destroy */
  int32_t rank;             /* world rank and size, for logs */
  int32_t world_size;
} cai_create_args;
#define CAI_CREATE_ARGS_STRUCT_SIZE CAI_STRUCT_SIZE(cai_create_args, world_size)

typedef struct cai_boost_args {
  size_t struct_size;
  cai_extension_base* extension_start;
  cai_model* model;          /* valid until destroy */
  cai_optimizer* optimizer;  /* valid until destroy */
  cai_precision precision;   /* the job's train.precision */
  int32_t grad_accumulation; /* micro-batches per optimizer step (>= 1) */
} cai_boost_args;
#define CAI_BOOST_ARGS_STRUCT_SIZE CAI_STRUCT_SIZE(cai_boost_args, grad_accumulation)

typedef struct cai_micro_batch {
  size_t struct_size;
  cai_extension_base* extension_start;
  const cai_tensor* tokens;  /* [batch, seq] int64, host memory */
  const cai_tensor* targets; /* [batch, seq] int64, -1 = ignored */
  /* This micro-batch's rows / the step's global batch. Summed over every rank's micro-batches
   * of a step it is 1, over one rank's it is the rank's share; gradients are summed over
   * ranks, never averaged (docs/abi-contract.md, "Micro-batches and loss_weight"). 1 in
   * evaluate, where it has no effect. */
  double loss_weight;
  double* loss; /* out: this rank's unweighted mean loss on the micro-batch */
} cai_micro_batch;
#define CAI_MICRO_BATCH_STRUCT_SIZE CAI_STRUCT_SIZE(cai_micro_batch, loss)

/* All of this replica's micro-batches of one optimizer step, for execute_pipeline. Each
 * micro_batches[i].loss, where non-NULL, may receive that micro-batch's unweighted mean loss
 * on the ranks that compute it (the last pipeline stage); other ranks leave it untouched. */
typedef struct cai_pipeline_args {
  size_t struct_size;
  cai_extension_base* extension_start;
  const cai_micro_batch* micro_batches;
  int32_t num_micro_batches;
  /* out: sum over the micro-batches of (mean loss * loss_weight): this replica's share of the
   * step's global loss. Valid at least where cai_parallel_layout.reports_loss. */
  double* loss;
} cai_pipeline_args;
#define CAI_PIPELINE_ARGS_STRUCT_SIZE CAI_STRUCT_SIZE(cai_pipeline_args, loss)

typedef struct cai_step_result {
  size_t struct_size;
  cai_extension_base* extension_start;
  bool skipped; /* overflow: parameters, state and step count unchanged on every rank */
  /* L2 norm of the global-batch gradient over all trainable parameters, unscaled, before
   * clipping; the same on every rank. +inf on a skipped step; NaN where the ranks apply no
   * single global gradient (local SGD). */
  double grad_norm;
  double loss_scale; /* scale in force for the next step (1 without fp16) */
  /* Group 0's rate at the step this call made, lr_at(group 0, steps after the call); on a
   * skipped step the rate it would have applied, which the next step applies
   * (docs/abi-contract.md, "cai_step_result"). */
  double lr;
} cai_step_result;
#define CAI_STEP_RESULT_STRUCT_SIZE CAI_STRUCT_SIZE(cai_step_result, lr)

typedef struct cai_checkpoint_args {
  size_t struct_size;
  cai_extension_base* extension_start;
  cai_checkpoint* checkpoint;
  bool model;     /* save/load model weights */
  bool optimizer; /* save/load optimizer state (and loss scaler) */
} cai_checkpoint_args;
#define CAI_CHECKPOINT_ARGS_STRUCT_SIZE CAI_STRUCT_SIZE(cai_checkpoint_args, optimizer)

typedef struct cai_strategy_stats {
  size_t struct_size;
  cai_extension_base* extension_start;
  uint64_t param_bytes; /* model parameters this rank holds now (all tiers) */
  uint64_t grad_bytes;
  uint64_t optimizer_state_bytes;
  uint64_t master_bytes; /* fp32 master copies under mixed precision */
  double overlap_ratio;  /* share of communication hidden behind compute, 0..1 */
} cai_strategy_stats;
#define CAI_STRATEGY_STATS_STRUCT_SIZE CAI_STRUCT_SIZE(cai_strategy_stats, overlap_ratio)

/* since 1.1: what `cai plan` asks a strategy about its per-rank memory. */
typedef struct cai_memory_estimate_args {
  size_t struct_size;
  cai_extension_base* extension_start;
  const cai_config* config;   /* the plugin's validated table */
  int64_t num_params;         /* Ψ: trainable parameter elements (tied counted once) */
  int64_t largest_unit_numel; /* elements of the largest unit */
  int32_t world_size;
  cai_precision precision;
  uint32_t optimizer_state_slots; /* fp32 values per element: 2 for Adam, 1 for SGD+momentum */
  /* since 1.3: the model's parameters as it will register them (tied ones once, before
   * model.freeze), for strategies whose memory depends on how parameters are laid out (chunks,
   * buckets): parameter i has param_numel[i] elements and belongs to unit param_unit[i] (-1:
   * none), unit u is of kind unit_kind[u] (CAI_UNIT_*). The host fills them where it knows the
   * model before building it (zoo models); num_layout_params = num_layout_units = 0 and NULL
   * arrays otherwise, and from a 1.1/1.2 host (check CAI_HAS_FIELD(args,
   * cai_memory_estimate_args, unit_kind)). The arrays live until the call returns. */
  uint32_t num_layout_params;
  const int64_t* param_numel;
  const int32_t* param_unit;
  uint32_t num_layout_units;
  const int32_t* unit_kind;
} cai_memory_estimate_args;
#define CAI_MEMORY_ESTIMATE_ARGS_STRUCT_SIZE CAI_STRUCT_SIZE(cai_memory_estimate_args, unit_kind)

/* since 1.1: per-rank model-state bytes (parameters, gradients, optimizer state, masters),
 * split by the tier that holds them. */
typedef struct cai_memory_estimate {
  size_t struct_size;
  cai_extension_base* extension_start;
  uint64_t param_bytes;
  uint64_t grad_bytes;
  uint64_t optimizer_state_bytes;
  uint64_t master_bytes;
  uint64_t device_bytes; /* of the above, held on the device tier */
  uint64_t host_bytes;   /* of the above, held on host tiers (offload) */
  const char* formula;   /* static text, e.g. "(2+2+12)Ψ/N" */
} cai_memory_estimate;
#define CAI_MEMORY_ESTIMATE_STRUCT_SIZE CAI_STRUCT_SIZE(cai_memory_estimate, formula)

/* since 1.3: how a strategy lays the world's ranks out, so that the host feeds each rank the
 * right rows and counts each loss once (cai_plugin_api.parallel_layout). The host zero-fills
 * it and sets struct_size; the strategy fills what it knows. */
typedef struct cai_parallel_layout {
  size_t struct_size;
  cai_extension_base* extension_start;
  /* The global batch is split over data_parallel_size replicas, replica data_parallel_rank
   * taking its share of the rows as a rank of a pure data-parallel world would. Every rank of
   * one replica (its pipeline stages, later its tensor-parallel peers) gets the same rows.
   * 1 <= data_parallel_size, data_parallel_size divides the world size, and
   * 0 <= data_parallel_rank < data_parallel_size. */
  int32_t data_parallel_rank;
  int32_t data_parallel_size;
  /* This rank's losses count in the step's global loss and in evaluation: exactly one rank
   * per replica says so (the last pipeline stage, say). The host sums reports_loss ranks'
   * weighted losses over the world. */
  bool reports_loss;
  /* The host calls execute_pipeline once per step with all of this replica's micro-batches of
   * the step, instead of forward_backward per micro-batch; no_sync is not called then.
   * Needs CAI_CAP_PIPELINE and execute_pipeline. */
  bool pipelines;
} cai_parallel_layout;
#define CAI_PARALLEL_LAYOUT_STRUCT_SIZE CAI_STRUCT_SIZE(cai_parallel_layout, pipelines)

typedef struct cai_plugin_api {
  size_t struct_size;
  cai_extension_base* extension_start;
  const char* name;                  /* equals the manifest's plugin.name */
  const char* version;               /* the plugin's own version */
  uint64_t capabilities;             /* CAI_CAP_* */
  const cai_config_key* config_keys; /* the schema of [plugin.<name>]; elements lie
                                        config_keys[0].struct_size bytes apart */
  size_t num_config_keys;

  /* Required. create makes an instance from the validated config; destroy accepts NULL. */
  cai_status* (*create)(const cai_create_args* args, cai_strategy** out);
  void (*destroy)(cai_strategy* strategy);
  /* Required. Takes charge of model and optimizer (broadcast, shard, wrap, register hooks).
   * Refuses what the strategy cannot do with FAILED_PRECONDITION or UNIMPLEMENTED and a
   * message saying what to change. */
  cai_status* (*boost)(cai_strategy* strategy, const cai_boost_args* args);
  /* Required. Forward and backward of one micro-batch, communication included. */
  cai_status* (*forward_backward)(cai_strategy* strategy, const cai_micro_batch* batch);
  /* Optional (NULL unless CAI_CAP_PIPELINE): all of this replica's micro-batches of a step
   * through a pipeline, when parallel_layout says `pipelines` (see cai_pipeline_args). */
  cai_status* (*execute_pipeline)(cai_strategy* strategy, const cai_pipeline_args* args);
  /* Optional (NULL unless CAI_CAP_NO_SYNC): while enabled, forward_backward accumulates
   * gradients locally without communication. */
  cai_status* (*no_sync)(cai_strategy* strategy, bool enabled);
  /* Required. Finish reductions, unscale, clip, update, re-gather. */
  cai_status* (*step)(cai_strategy* strategy, cai_step_result* result);
  /* Required. */
  cai_status* (*zero_grad)(cai_strategy* strategy);
  /* Required. Save/load model and optimizer state in the strategy's own layout. Collective:
   * every rank calls them. */
  cai_status* (*save)(cai_strategy* strategy, const cai_checkpoint_args* args);
  cai_status* (*load)(cai_strategy* strategy, const cai_checkpoint_args* args);
  /* Required. Memory the strategy holds, by kind. */
  cai_status* (*stats)(cai_strategy* strategy, cai_strategy_stats* out);

  /* since 1.1. Optional: the strategy's per-rank model-state memory for `cai plan`, without
   * creating an instance. Thread-safe. */
  cai_status* (*estimate_memory)(const cai_memory_estimate_args* args, cai_memory_estimate* out);
  /* since 1.1. Optional: forward only, for evaluation; batch->loss receives this rank's mean
   * loss and nothing is accumulated into gradients. Hosts fall back to the model service's
   * forward when it is absent, which is right only for strategies that keep every parameter
   * materialised (1.0 plugins that shard parameters cannot be evaluated by a 1.0 contract).
   * Under a layout (parallel_layout), the host calls it on every rank of a replica with the
   * replica's batch; batch->loss is meaningful where reports_loss. */
  cai_status* (*evaluate)(cai_strategy* strategy, const cai_micro_batch* batch);

  /* since 1.3. Optional: fills `out` with the strategy's layout of ranks. The host calls it
   * once per instance, after boost. Absent (older plugins, or NULL): data_parallel_rank is the
   * world rank, data_parallel_size the world size, every rank reports its loss and nothing
   * pipelines, which is what every 1.0-1.2 strategy assumes. */
  cai_status* (*parallel_layout)(cai_strategy* strategy, cai_parallel_layout* out);
} cai_plugin_api;
#define CAI_PLUGIN_API_STRUCT_SIZE CAI_STRUCT_SIZE(cai_plugin_api, parallel_layout)
/* The smallest table a host accepts: ABI 1.0's. */
#define CAI_PLUGIN_API_V1_0_STRUCT_SIZE CAI_STRUCT_SIZE(cai_plugin_api, stats)

/* ---- Entry point ------------------------------------------------------------------------ */

typedef struct cai_plugin_init_args {
  size_t struct_size;
  cai_extension_base* extension_start;
  uint32_t host_abi_major;        /* in */
  uint32_t host_abi_minor;        /* in */
  const cai_host_api* host;       /* in: valid for the process lifetime */
  const char* plugin_dir;         /* in: directory of the manifest, valid during the call */
  uint32_t plugin_abi_minor;      /* out: CAI_ABI_MINOR the plugin was built with */
  uint32_t plugin_min_host_minor; /* out: CAI_TARGET_ABI_MINOR: oldest host minor it needs */
  const cai_plugin_api* plugin;   /* out: static table, valid for the process lifetime */
} cai_plugin_init_args;
#define CAI_PLUGIN_INIT_ARGS_STRUCT_SIZE CAI_STRUCT_SIZE(cai_plugin_init_args, plugin)

/* The one symbol a plugin exports. Called once, single-threaded; must not start threads or
 * touch devices (that belongs in create). Returns NULL and fills the out fields, or an error
 * status (created with args->host->status_create) such as FAILED_PRECONDITION when the host's
 * major differs or its minor is older than the plugin needs. */
typedef cai_status* (*cai_plugin_init_fn)(cai_plugin_init_args* args);
#define CAI_PLUGIN_ENTRY_SYMBOL "cai_plugin_init_v1"
CAI_EXPORT cai_status* cai_plugin_init_v1(cai_plugin_init_args* args);

#ifdef __cplusplus
} /* extern "C" */
#endif

#endif /* CAI_PLUGIN_H_ */
