/* cai ABI v1 — communicator service.
 *
 * Collectives over groups of ranks, backed by an existing engine (Gloo on CPU, NCCL on GPU;
 * cai_comm_api.backend_info says what each collective maps to natively). Every collective
 * moves exactly the bytes its algorithm needs: a reduce-scatter is never an all-reduce in
 * disguise. Byte counters record, per operation and group, the bytes this rank handed to the
 * collective (the size of its input buffer), which is what ZeRO's and FSDP's formulas count.
 *
 * Thread-safety: every function is thread-safe. Collectives on one group must be issued in
 * the same order on every rank of the group (as in NCCL and c10d); issuing them from several
 * threads at once is the caller's ordering problem.
 */
#ifndef CAI_COMM_H_
#define CAI_COMM_H_

#include "cai/core.h"

#ifdef __cplusplus
extern "C" {
#endif

/* A group of ranks. The world group is owned by the host and must not be destroyed. */
typedef struct cai_comm_group cai_comm_group;
/* An operation in flight (c10d's Work). Released with work_release, after or instead of a
 * wait; releasing a work that has not completed waits for it first. */
typedef struct cai_comm_work cai_comm_work;

typedef int32_t cai_reduce_op;
enum {
  CAI_REDUCE_SUM = 0,
  /* The sum divided by the group size. Gloo (host memory): SUM, then the division on every
   * rank (all_reduce, reduce_scatter) or on the root only (reduce); bf16/fp16 are added in
   * fp32, rounded at each ring step, and divided in fp32. NCCL (CUDA memory): ncclAvg.
   * Strategies reduce gradients with SUM, never AVG: cai_micro_batch.loss_weight already makes
   * the sum over ranks the global-batch mean. */
  CAI_REDUCE_AVG = 1,
  CAI_REDUCE_MAX = 2,
  CAI_REDUCE_MIN = 3,
  CAI_REDUCE_PRODUCT = 4
};

typedef int32_t cai_comm_op;
enum {
  CAI_COMM_ALL_REDUCE = 0,
  CAI_COMM_REDUCE_SCATTER = 1,
  CAI_COMM_ALL_GATHER = 2,
  CAI_COMM_BROADCAST = 3,
  CAI_COMM_REDUCE = 4,
  CAI_COMM_ALL_TO_ALL = 5,
  CAI_COMM_SEND = 6,
  CAI_COMM_RECV = 7,
  CAI_COMM_BARRIER = 8,
  CAI_COMM_NUM_OPS = 9
};

/* One collective. Which fields are read depends on `op`:
 *  ALL_REDUCE:     `output` reduced in place with `reduce_op` (`input` ignored).
 *  REDUCE_SCATTER: `input` holds group_size equal chunks; this rank's reduced chunk lands in
 *                  `output` (numel(input) == group_size * numel(output)).
 *  ALL_GATHER:     every rank's `input` concatenated in rank order into `output`
 *                  (numel(output) == group_size * numel(input)). In place when `input` is
 *                  this rank's chunk of `output` (as in NCCL), e.g. ZeRO's updated shard.
 *  BROADCAST:      `output` on rank `root` copied to `output` on every rank.
 *  REDUCE:         `output` reduced into `output` on rank `root` only.
 *  ALL_TO_ALL:     chunk j of `input` goes to rank j; chunk i of `output` comes from rank i.
 *  SEND / RECV:    `input` sent to / `output` received from group rank `peer` with `tag`.
 *  BARRIER:        no tensors.
 * Ranks are ranks within `group`. Tensors are contiguous; dtypes fp32, fp64, bf16, fp16,
 * int32, int64, uint8 (bf16/fp16 are reduced in fp32 precision where the backend cannot).
 */
typedef struct cai_comm_args {
  size_t struct_size;
  cai_extension_base* extension_start;
  cai_comm_group* group; /* NULL = world */
  cai_comm_op op;
  cai_reduce_op reduce_op;
  const cai_tensor* input;
  const cai_tensor* output;
  int32_t root;
  int32_t peer;
  int32_t tag;
  bool async;         /* true: return at once with *work set; false: complete first */
  int64_t timeout_ms; /* 0 = the group's default timeout */
  void* stream;       /* device stream to order against; NULL = current */
} cai_comm_args;
#define CAI_COMM_ARGS_STRUCT_SIZE CAI_STRUCT_SIZE(cai_comm_args, stream)

typedef struct cai_comm_counters {
  size_t struct_size;
  cai_extension_base* extension_start;
  uint64_t calls[CAI_COMM_NUM_OPS]; /* indexed by cai_comm_op */
  uint64_t bytes[CAI_COMM_NUM_OPS]; /* bytes this rank handed to each op (its input size) */
} cai_comm_counters;
#define CAI_COMM_COUNTERS_STRUCT_SIZE CAI_STRUCT_SIZE(cai_comm_counters, bytes)

typedef struct cai_comm_api {
  size_t struct_size;
  cai_extension_base* extension_start;

  /* The world group, owned by the host; never NULL once the host has rendezvoused. */
  cai_comm_group* (*world)(void);
  int32_t (*rank)(const cai_comm_group* group); /* NULL = world */
  int32_t (*size)(const cai_comm_group* group); /* NULL = world */
  /* Creates a sub-group of the given world ranks. Collective: every world rank calls it with
   * the same list, members and non-members alike (non-members get *out = NULL). Fails with
   * INVALID_ARGUMENT on duplicate or out-of-range ranks. */
  cai_status* (*new_group)(const int32_t* world_ranks, size_t count, cai_comm_group** out);
  /* Destroys a group created by new_group. Accepts NULL; ignores the world group. */
  void (*destroy_group)(cai_comm_group* group);

  /* Runs one collective (see cai_comm_args). With args->async, *work receives a handle that
   * must be waited or released; without, `work` may be NULL and the operation has completed
   * on return. A timeout fails with DEADLINE_EXCEEDED naming the operation, group and rank. */
  cai_status* (*run)(const cai_comm_args* args, cai_comm_work** work);
  /* Waits for completion; timeout_ms 0 = the group's default. Returns the operation's error,
   * if any. The handle stays valid until work_release. */
  cai_status* (*work_wait)(cai_comm_work* work, int64_t timeout_ms);
  /* Non-blocking completion test. */
  bool (*work_is_completed)(cai_comm_work* work);
  void (*work_release)(cai_comm_work* work);

  /* Counters since start or the last reset, for `group` (NULL = summed over all groups). */
  cai_status* (*counters)(const cai_comm_group* group, cai_comm_counters* out);
  void (*reset_counters)(void);
  /* Static description of the backend, e.g. "gloo: all_reduce=ring, reduce_scatter=...",
   * including what AVG computes (see CAI_REDUCE_AVG). Lives as long as the host. */
  const char* (*backend_info)(const cai_comm_group* group);
} cai_comm_api;
#define CAI_COMM_API_STRUCT_SIZE CAI_STRUCT_SIZE(cai_comm_api, backend_info)

#ifdef __cplusplus
} /* extern "C" */
#endif

#endif /* CAI_COMM_H_ */
