/* cai ABI v1 — model service.
 *
 * The host owns the model (a zoo model or a TorchScript module); a strategy sees its
 * parameters as flat memory and drives it through this table: parameter metadata and views,
 * units (transformer blocks and the like) for wrapping and pipeline stages, hooks, parameter
 * and gradient storage replacement/release, whole-model and per-stage forward/backward, the
 * structure tensor parallelism needs, activation checkpointing and compute dtype.
 *
 * Parameter storage follows PyTorch FSDP: releasing a parameter shrinks its storage to zero
 * bytes while the parameter object (and every view autograd saved of it) stays valid;
 * materialising grows the same storage back, which the plugin then fills (e.g. all-gathers
 * into) before the next use.
 *
 * Thread-safety: a model is externally synchronised — call its functions from one thread at a
 * time. Hook callbacks run on the thread that runs forward/backward (for gradient-ready hooks,
 * possibly an autograd worker thread) and must not call forward/backward themselves.
 */
#ifndef CAI_MODEL_H_
#define CAI_MODEL_H_

#include "cai/core.h"

struct cai_comm_group;

#ifdef __cplusplus
extern "C" {
#endif

typedef struct cai_model cai_model;

/* Role of a parameter in the model's structure, for tensor-parallel sharding and for
 * strategies that treat embeddings or norms specially. */
typedef int32_t cai_param_role;
enum {
  CAI_ROLE_OTHER = 0,
  CAI_ROLE_EMBEDDING = 1,     /* token embedding [vocab, hidden] */
  CAI_ROLE_POS_EMBEDDING = 2, /* learned positions [ctx, hidden] */
  CAI_ROLE_ATTN_QKV = 3,      /* fused q/k/v projection (column-parallel) */
  CAI_ROLE_ATTN_Q = 4,
  CAI_ROLE_ATTN_K = 5,
  CAI_ROLE_ATTN_V = 6,
  CAI_ROLE_ATTN_OUT = 7,  /* attention output projection (row-parallel) */
  CAI_ROLE_MLP_UP = 8,    /* column-parallel */
  CAI_ROLE_MLP_GATE = 9,  /* column-parallel (SwiGLU) */
  CAI_ROLE_MLP_DOWN = 10, /* row-parallel */
  CAI_ROLE_NORM = 11,     /* LayerNorm / RMSNorm weight or bias */
  CAI_ROLE_LM_HEAD = 12   /* output projection (may be tied to the embedding) */
};

/* Kind of a unit. */
typedef int32_t cai_unit_kind;
enum { CAI_UNIT_OTHER = 0, CAI_UNIT_EMBEDDING = 1, CAI_UNIT_BLOCK = 2, CAI_UNIT_HEAD = 3 };

/* cai_param_info.flags */
#define CAI_PARAM_REQUIRES_GRAD ((uint64_t)1 << 0)
#define CAI_PARAM_IS_BIAS ((uint64_t)1 << 1)
#define CAI_PARAM_RELEASED ((uint64_t)1 << 2) /* storage currently released */

typedef struct cai_param_info {
  size_t struct_size;
  cai_extension_base* extension_start;
  const char* name;        /* "blocks.3.attn.qkv.weight"; lives as long as the model */
  const char* module_path; /* "blocks.3.attn.qkv" */
  int32_t ndim;
  const int64_t* shape; /* ndim entries; lives as long as the model */
  int64_t numel;
  cai_dtype dtype; /* current storage dtype */
  uint64_t flags;  /* CAI_PARAM_* */
  uint32_t group;  /* optimizer parameter group */
  /* The parameter whose storage this one shares, or -1. ABI 1.x hosts list a shared tensor
   * once, under its first name, so it is -1 for every parameter they report; a strategy
   * still treats tied_to >= 0 as an alias of that owner: no storage, gradient, optimizer
   * state or checkpoint entry of its own. */
  int32_t tied_to;
  int32_t unit; /* index of the unit that holds it, or -1 */
  cai_param_role role;
  int32_t parallel_dim; /* dimension tensor parallelism splits (-1 = replicate) */
  /* since 1.3: tensor parallelism (apply_tensor_parallel). `shape` and `numel` describe this
   * rank's slice; global_shape (ndim entries, lives as long as the model) the whole, unpadded
   * parameter, which is what checkpoints hold. tp_dim is the dimension the slice is cut along,
   * -1 when the parameter is whole on every rank of the group (then global_shape equals
   * shape). Along tp_dim the parameter is tp_blocks equal blocks (GPT-2's fused q/k/v: 3; else
   * 1), each padded with zeros to tp_padded / tp_blocks elements (a vocabulary padded to the
   * requested multiple) and cut evenly over the group: rank r holds the r-th part of every
   * block, blocks in order. Padding never receives gradient. Before apply_tensor_parallel:
   * global_shape = shape, tp_dim = -1, tp_blocks = 1, tp_padded = 0. */
  const int64_t* global_shape;
  int32_t tp_dim;
  int32_t tp_blocks;
  int64_t tp_padded;
} cai_param_info;
#define CAI_PARAM_INFO_STRUCT_SIZE CAI_STRUCT_SIZE(cai_param_info, tp_padded)

typedef struct cai_unit_info {
  size_t struct_size;
  cai_extension_base* extension_start;
  const char* name; /* "blocks.3" */
  cai_unit_kind kind;
  uint32_t num_params;
  const uint32_t* params; /* parameter indices, in registration order */
  int64_t numel;          /* sum of the unit's parameters' numel (tied counted once) */
  /* since 1.3: parameters held by other units that this unit's forward reads (GPT-2's head
   * reads the token embedding held by unit 0), so a pipeline knows which parameters cross
   * stages. num_reads entries, in index order; lives as long as the model. */
  uint32_t num_reads;
  const uint32_t* reads;
} cai_unit_info;
#define CAI_UNIT_INFO_STRUCT_SIZE CAI_STRUCT_SIZE(cai_unit_info, reads)

/* ---- Hooks ------------------------------------------------------------------------------ */

typedef int32_t cai_hook_kind;
enum {
  CAI_HOOK_PRE_FORWARD = 0,     /* before a unit's forward */
  CAI_HOOK_POST_FORWARD = 1,    /* after a unit's forward */
  CAI_HOOK_PRE_BACKWARD = 2,    /* before a unit's backward (its output gradient is ready) */
  CAI_HOOK_POST_BACKWARD = 3,   /* after a unit's backward (all its parameters' gradients done) */
  CAI_HOOK_GRAD_READY = 4,      /* a parameter's gradient for this backward is accumulated */
  CAI_HOOK_PRE_STEP_FORWARD = 5 /* once, before the whole model's forward of a micro-batch */
};

typedef struct cai_hook_event {
  size_t struct_size;
  cai_extension_base* extension_start;
  cai_hook_kind kind;
  int32_t unit;   /* for unit hooks, else -1 */
  int32_t param;  /* for GRAD_READY, else -1 */
  bool recompute; /* forward hooks: true when activation checkpointing re-runs the unit */
} cai_hook_event;
#define CAI_HOOK_EVENT_STRUCT_SIZE CAI_STRUCT_SIZE(cai_hook_event, recompute)

/* A hook returns NULL to continue; an error status aborts the forward/backward in progress,
 * which then fails with that status. */
typedef cai_status* (*cai_hook_fn)(void* user_data, const cai_hook_event* event);

typedef struct cai_hook_args {
  size_t struct_size;
  cai_extension_base* extension_start;
  cai_hook_kind kind;
  int32_t unit;  /* -1 = every unit (unit hooks) */
  int32_t param; /* -1 = every parameter (GRAD_READY) */
  cai_hook_fn fn;
  void* user_data; /* passed back verbatim; owned by the caller */
} cai_hook_args;
#define CAI_HOOK_ARGS_STRUCT_SIZE CAI_STRUCT_SIZE(cai_hook_args, user_data)

/* ---- Forward / backward ----------------------------------------------------------------- */

/* One micro-batch through the whole model: tokens [batch, seq] int64 and targets [batch, seq]
 * int64 (-1 = ignored) in host memory; the mean cross-entropy loss is returned and, when
 * `backward` is set, (loss * loss_weight * loss_scale) is back-propagated, accumulating into
 * gradients. */
typedef struct cai_forward_backward_args {
  size_t struct_size;
  cai_extension_base* extension_start;
  const cai_tensor* tokens;
  const cai_tensor* targets;
  bool backward;
  double loss_scale; /* 0 means 1 */
  /* Multiplies the loss before backward; 0 means 1. Pass cai_micro_batch.loss_weight: the
   * micro-batch's rows / the step's global batch (gradients are summed over ranks). */
  double loss_weight;
  double* loss; /* out: unscaled, unweighted mean loss */
} cai_forward_backward_args;
#define CAI_FORWARD_BACKWARD_ARGS_STRUCT_SIZE CAI_STRUCT_SIZE(cai_forward_backward_args, loss)

/* Activation handle for pipeline stages: a host-owned tensor with autograd history. */
typedef struct cai_activation cai_activation;

/* Forward of units [first_unit, last_unit) for a pipeline stage. The first stage takes
 * `tokens`; later stages take `input` (received from the previous stage). The last stage
 * (last_unit == num_units) also takes `targets` and returns the loss. `output` receives a
 * new activation (NULL for the last stage) that the caller releases. */
typedef struct cai_stage_forward_args {
  size_t struct_size;
  cai_extension_base* extension_start;
  int32_t first_unit;
  int32_t last_unit;
  const cai_tensor* tokens;
  const cai_tensor* targets;
  const cai_tensor* input; /* activation data from the previous stage */
  cai_activation** output;
  double* loss;
  /* since 1.3: forward only, for evaluation: no graph is kept and parameters' gradients are
   * untouched. The last stage returns its loss and keeps nothing (no stage_backward follows,
   * and it takes no micro-batch number); a non-last stage's output activation carries no
   * graph, so it cannot be back-propagated. Unit hooks fire as in any forward. */
  bool no_grad;
  /* since 1.3: split backward (zero-bubble pipelines): this stage's stage_backward computes the
   * input gradient and every parameter gradient except the transformer blocks' linear
   * projections' weights and biases, whose dW = dY^T X and db = sum dY wait for
   * stage_backward_weights (which needs neither the parameters' data nor the graph). A block's
   * GRAD_READY for those parameters and its POST_BACKWARD fire there. The projections that a
   * collective overlaps (sequence parallelism's split_gather and ring column projections, ring's
   * row projections) keep their weight gradients in stage_backward. INVALID_ARGUMENT with
   * no_grad. */
  bool split_backward;
} cai_stage_forward_args;
#define CAI_STAGE_FORWARD_ARGS_STRUCT_SIZE CAI_STRUCT_SIZE(cai_stage_forward_args, split_backward)

/* Backward of one stage-forward. `activation` is what stage_forward returned (NULL for the
 * last stage, identified by micro_batch); `grad_output` the gradient received from the next
 * stage (NULL for the last stage, which starts from loss * loss_scale); the gradient of the
 * stage's input is written to `grad_input` when non-NULL. */
typedef struct cai_stage_backward_args {
  size_t struct_size;
  cai_extension_base* extension_start;
  cai_activation* activation;
  const cai_tensor* grad_output;
  const cai_tensor* grad_input;
  int32_t micro_batch;
  double loss_scale;
} cai_stage_backward_args;
#define CAI_STAGE_BACKWARD_ARGS_STRUCT_SIZE CAI_STRUCT_SIZE(cai_stage_backward_args, loss_scale)

/* The weight pass of a split stage (since 1.3; cai_stage_forward_args.split_backward), after
 * its stage_backward: `activation` as stage_backward took it (the caller releases it only after
 * this call), or NULL and `micro_batch` for the last stage. Releasing an activation whose weight
 * pass has not run loses those gradients: every later forward or backward call then fails with
 * FAILED_PRECONDITION until zero_grad. */
typedef struct cai_stage_backward_weights_args {
  size_t struct_size;
  cai_extension_base* extension_start;
  cai_activation* activation;
  int32_t micro_batch;
} cai_stage_backward_weights_args;
#define CAI_STAGE_BACKWARD_WEIGHTS_ARGS_STRUCT_SIZE \
  CAI_STRUCT_SIZE(cai_stage_backward_weights_args, micro_batch)

/* Tensor parallelism through the host: parameters with a parallel_dim are split across
 * `group` (column-parallel roles on their output dimension, row-parallel on their input), and
 * the host inserts the matching collectives in forward and backward (Megatron-LM's f/g
 * operators). With sequence_parallel (since 1.3 for zoo models), norms, residuals and
 * dropout run on sequence shards: units between the embedding and the head take and return
 * [B, T/size, hidden], and the all-reduces become all-gathers and reduce-scatters. */
typedef struct cai_tensor_parallel_args {
  size_t struct_size;
  cai_extension_base* extension_start;
  struct cai_comm_group* group;
  bool sequence_parallel;
  /* since 1.3: the vocabulary (token embedding, output projection) is padded to a multiple of
   * vocab_divisible_by x the group's size (Megatron-LM's make_vocab_size_divisible_by; 0 or 1:
   * of the group's size). */
  int64_t vocab_divisible_by;
  /* since 1.3: all-gather the vocabulary-parallel logits before the loss (ColossalAI's
   * parallel_output = false); false: the loss is a distributed cross-entropy and no rank holds
   * the whole logits. */
  bool gather_output;
  /* since 1.3, with sequence_parallel (ColossalAI's "ring"): the all-gather before each
   * column-parallel projection and the reduce-scatter after each row-parallel one run as rings
   * of size − 1 send/recv steps, each step's transfer overlapping the matmul of the chunk of
   * the sequence already here (backward likewise). Same results and the same bytes on the wire
   * as the collectives (a rank sends (size − 1)/size of the gathered or reduced tensor); the
   * embedding's reduce-scatter, which has no matmul to hide behind, stays a collective. */
  bool sequence_parallel_ring;
} cai_tensor_parallel_args;
#define CAI_TENSOR_PARALLEL_ARGS_STRUCT_SIZE \
  CAI_STRUCT_SIZE(cai_tensor_parallel_args, sequence_parallel_ring)

/* Sequence parallelism over a group of its own (since 1.3, zoo models), apply_sequence_parallel.
 * Every rank of the group calls forward/backward on the same tokens and targets [B, T]; each
 * runs the embedding, the blocks and the head on its T/size positions (which ones: the mode),
 * so units between the embedding and the head take and return [B, T/size, hidden] (what a
 * pipeline sends between stages). Position embeddings and RoPE take the shard's positions.
 *  ALL_TO_ALL: DeepSpeed-Ulysses (Jacobs et al. 2023), T a multiple of size, rank r holding the
 *    consecutive positions [r·T/size, (r + 1)·T/size). Around each attention an all-to-all
 *    turns q, k, v from [all heads, T/size positions] into [heads/size, all T positions] and
 *    another turns the output back, so attention sees the whole sequence for 1/size of the
 *    heads. Per block and micro-batch a rank hands 4·B·(T/size)·(q + kv) elements to
 *    all-to-alls, forward and backward together (q, kv: the widths of its query and of its
 *    key or value projection; a recomputed block runs its forward's two again). The heads
 *    and key/value heads (per tensor-parallel rank) must divide by size.
 *  RING_ATTN: ring attention (Liu et al. 2023) with the balanced "zigzag" split of the causal
 *    sequence: T a multiple of 2·size, cut into 2·size chunks of c = T/(2·size), rank r holding
 *    chunks r and 2·size − 1 − r (its positions in that order), so every rank does the same
 *    share of the causal attention. Each attention runs size steps: this rank's queries
 *    against the keys and values of rank r, r − 1, ..., merged with an online softmax, while
 *    the keys and values move one rank on around the ring (sent to r + 1, received from
 *    r − 1); backward passes them around again with their gradients travelling beside them
 *    back to their owner. Per block and micro-batch a rank sends 2·B·2c·kv elements (k and v)
 *    size − 1 times in forward, and in backward size − 1 times again plus their fp32
 *    gradients size times (a recomputed block repeats its forward's). Any head counts.
 * The loss is the whole micro-batch's mean on every rank (a 2-float all-reduce of the shards'
 * sums and target counts), but each rank back-propagates only its shard's part of it: a
 * parameter's gradient on one rank is partial, and its SUM over the group is the gradient.
 * A strategy therefore reduces gradients over data parallelism × this group as it does over
 * data parallelism alone (summing the replicas' loss_weight-scaled gradients), as ColossalAI's
 * ZeRO does over dp × sp. */
typedef enum cai_sequence_parallel_mode {
  CAI_SEQUENCE_PARALLEL_ALL_TO_ALL = 1,
  CAI_SEQUENCE_PARALLEL_RING_ATTN = 2
} cai_sequence_parallel_mode;

typedef struct cai_sequence_parallel_args {
  size_t struct_size;
  cai_extension_base* extension_start;
  struct cai_comm_group* group;
  int32_t mode; /* cai_sequence_parallel_mode */
} cai_sequence_parallel_args;
#define CAI_SEQUENCE_PARALLEL_ARGS_STRUCT_SIZE CAI_STRUCT_SIZE(cai_sequence_parallel_args, mode)

typedef struct cai_model_api {
  size_t struct_size;
  cai_extension_base* extension_start;

  /* Structure. Indices are stable for the model's lifetime. */
  uint32_t (*num_params)(const cai_model* model);
  cai_status* (*param_info)(const cai_model* model, uint32_t index, cai_param_info* out);
  uint32_t (*num_units)(const cai_model* model);
  cai_status* (*unit_info)(const cai_model* model, uint32_t index, cai_unit_info* out);
  /* Model-wide description: "gpt2 n_layer=4 n_head=4 ..." for logs; lives as long as the model. */
  const char* (*describe)(const cai_model* model);

  /* Views. `out` describes the parameter's current data (or gradient) in place; shape and
   * strides live until its storage is next replaced, released or materialised. param_grad
   * fails with FAILED_PRECONDITION when the gradient is undefined (never produced, or
   * released). */
  cai_status* (*param_data)(cai_model* model, uint32_t index, cai_tensor* out);
  cai_status* (*param_grad)(cai_model* model, uint32_t index, cai_tensor* out);
  /* Non-trainable state that data parallelism broadcasts (running stats, caches). */
  uint32_t (*num_buffers)(const cai_model* model);
  cai_status* (*buffer_data)(cai_model* model, uint32_t index, cai_tensor* out);

  /* Storage. replace_param_storage points the parameter at caller memory (`storage`, same
   * numel, dtype may differ only as set_compute_dtype allows), e.g. a view into a flat
   * buffer; the caller keeps that memory alive and unchanged in size until the next
   * replacement. release_param_storage frees the parameter's storage (zero bytes) keeping the
   * tensor valid; materialize_param_storage grows it back (contents undefined) and fills
   * `out` so the caller can write it. Replacing a released parameter's storage with memory of
   * its dtype refills that same storage in place, so the views autograd saved of it before the
   * release see the caller's memory (FSDP all-gathers straight into the parameters this way;
   * the caller releases the parameter again before that memory goes). replace_grad_storage makes
   * gradients accumulate straight into caller memory (DDP's gradient_as_bucket_view); release_grad
   * drops the gradient. A lazily initialised model's parameter (1.3 hosts, model.init_device =
   * "lazy") holds no memory until first read: param_data and materialize_param_storage draw its
   * initial values then; releasing it before any read drops it undrawn. */
  cai_status* (*replace_param_storage)(cai_model* model, uint32_t index, const cai_tensor* storage);
  cai_status* (*release_param_storage)(cai_model* model, uint32_t index);
  cai_status* (*materialize_param_storage)(cai_model* model, uint32_t index, cai_tensor* out);
  cai_status* (*replace_grad_storage)(cai_model* model, uint32_t index, const cai_tensor* storage);
  cai_status* (*release_grad)(cai_model* model, uint32_t index);
  /* Sets every gradient to zero (keeping replaced gradient storage) or, with set_to_none,
   * drops them. */
  cai_status* (*zero_grad)(cai_model* model, bool set_to_none);

  /* Hooks. register_hook returns an id for remove_hook. */
  cai_status* (*register_hook)(cai_model* model, const cai_hook_args* args, uint64_t* id);
  cai_status* (*remove_hook)(cai_model* model, uint64_t id);

  /* Execution. */
  cai_status* (*forward_backward)(cai_model* model, const cai_forward_backward_args* args);
  cai_status* (*stage_forward)(cai_model* model, const cai_stage_forward_args* args);
  cai_status* (*stage_backward)(cai_model* model, const cai_stage_backward_args* args);
  void (*activation_release)(cai_activation* activation);
  /* Describes the activation's data (for sending to the next stage). */
  cai_status* (*activation_data)(cai_activation* activation, cai_tensor* out);

  /* Configuration. compute dtype fp32 / bf16 / fp16: parameters are cast to it (the strategy
   * keeps fp32 masters where it wants them); a released parameter changes dtype without data
   * (1.3 hosts; older ones refuse it). Activation checkpointing recomputes each unit's
   * forward during backward. */
  cai_status* (*set_compute_dtype)(cai_model* model, cai_dtype dtype);
  cai_status* (*set_activation_checkpointing)(cai_model* model, bool enabled);
  /* Applies tensor parallelism (see cai_tensor_parallel_args) over `group`: Megatron-LM's
   * column- and row-parallel projections and a vocabulary-parallel embedding and output
   * projection. Each parameter keeps the exact slice of its unsplit values that
   * cai_param_info's tp fields describe, and forward and backward run the group's all-reduces
   * (so every rank of the group calls forward/backward on the same tokens, in step).
   * Collective over the group; once per model, before any storage is replaced or released.
   * UNIMPLEMENTED for TorchScript models without a tensor-parallel policy and, for them,
   * sequence_parallel; INVALID_ARGUMENT when the group's size does not divide the heads,
   * key/value heads or MLP width (the message names them). */
  cai_status* (*apply_tensor_parallel)(cai_model* model, const cai_tensor_parallel_args* args);

  /* 1.2. Casts every floating-point buffer to `dtype` (fp32 / bf16 / fp16) in place; integer
   * and bool buffers keep theirs (PyTorch FSDP's MixedPrecision.buffer_dtype: an fp32 buffer
   * in a bf16 forward promotes what it touches back to fp32). buffer_data describes the cast
   * buffers from then on. Not thread-safe against a running forward. */
  cai_status* (*set_buffer_dtype)(cai_model* model, cai_dtype dtype);

  /* 1.3. Turns on optional kernels (CAI_MODEL_KERNEL_*) of a zoo model; kernels already on
   * (the job's model.* keys) stay on. Each computes what the composed ATen path computes and
   * keeps less for backward. UNIMPLEMENTED for TorchScript models. */
  cai_status* (*enable_kernels)(cai_model* model, uint64_t kernels);
  /* 1.3. Activation checkpointing of one transformer block (a CAI_UNIT_BLOCK unit): its
   * forward is recomputed in backward. set_activation_checkpointing sets every block at once.
   * INVALID_ARGUMENT for another kind of unit. */
  cai_status* (*set_unit_checkpointing)(cai_model* model, uint32_t unit, bool enabled);
  /* 1.3. Sequence parallelism (see cai_sequence_parallel_args) over `group`. Collective over
   * the group; once per model, after apply_tensor_parallel if any (INVALID_ARGUMENT with
   * tensor parallelism's sequence_parallel, whose sequence split it would repeat), before any
   * storage is replaced or released. INVALID_ARGUMENT when, under ALL_TO_ALL, the group's
   * size does not divide the (per tensor-parallel rank) heads or key/value heads, and, at
   * forward, when the sequence length is not a multiple of size (ALL_TO_ALL) or 2·size
   * (RING_ATTN); UNIMPLEMENTED for TorchScript models and for other modes. */
  cai_status* (*apply_sequence_parallel)(cai_model* model, const cai_sequence_parallel_args* args);
  /* 1.3. The weight pass of a split backward (see cai_stage_backward_weights_args). */
  cai_status* (*stage_backward_weights)(cai_model* model,
                                        const cai_stage_backward_weights_args* args);
} cai_model_api;
#define CAI_MODEL_API_STRUCT_SIZE CAI_STRUCT_SIZE(cai_model_api, stage_backward_weights)

/* enable_kernels (1.3). */
/* Causal attention tiled over query and key blocks with an online softmax: O(T·d) memory per
 * head instead of the T×T scores. */
#define CAI_MODEL_KERNEL_MEMORY_EFFICIENT_ATTENTION ((uint64_t)1 << 0)
/* RMSNorm (Llama) in one pass keeping its input and 1/rms; GPT-2's LayerNorm is ATen's fused
 * kernel already. */
#define CAI_MODEL_KERNEL_FUSED_NORMALIZATION ((uint64_t)1 << 1)
/* bias + tanh-GELU (GPT-2's MLP) and SwiGLU (Llama's) in one pass each way. */
#define CAI_MODEL_KERNEL_FUSED_ACTIVATION ((uint64_t)1 << 2)

#ifdef __cplusplus
} /* extern "C" */
#endif

#endif /* CAI_MODEL_H_ */
