/* cai ABI v1 — memory pool service.
 *
 * Tiered allocation with per-tier budgets and current/peak accounting, copies between tiers,
 * and the element-wise kernels a plugin needs on raw buffers, so a plugin never needs a
 * framework to touch its shards. On a CPU-only host the DEVICE tier is host memory with its
 * own budget, so budget enforcement and offload behave exactly as on a GPU host.
 *
 * Thread-safety: every function of cai_mem_api is thread-safe. A buffer's contents are not
 * synchronised: callers order their own reads and writes.
 */
#ifndef CAI_MEMPOOL_H_
#define CAI_MEMPOOL_H_

#include "cai/core.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef int32_t cai_mem_tier;
enum {
  CAI_MEM_DEVICE = 0,      /* accelerator memory (host memory with its own budget on CPU) */
  CAI_MEM_PINNED_HOST = 1, /* page-locked host memory (plain host memory on CPU builds) */
  CAI_MEM_HOST = 2,        /* pageable host memory */
  CAI_MEM_NVME = 3,        /* a file under the configured NVMe directory (mapped, or not:
                              CAI_MEM_ALLOC_UNMAPPED) */
  CAI_MEM_NUM_TIERS = 4
};

/* A block of memory from the pool. Opaque; released with cai_mem_api.free. */
typedef struct cai_buffer cai_buffer;

typedef struct cai_mem_alloc_args {
  size_t struct_size;
  cai_extension_base* extension_start;
  cai_mem_tier tier;
  size_t bytes;     /* > 0 */
  size_t alignment; /* power of two, 0 = 64 bytes */
  const char* tag;  /* accounting label ("zero.master", "ddp.bucket"), may be NULL */
  bool zero_fill;   /* contents set to zero before return */
  uint64_t flags;   /* ABI 1.3: CAI_MEM_ALLOC_* bits; a 1.2 host reads none */
} cai_mem_alloc_args;
#define CAI_MEM_ALLOC_ARGS_STRUCT_SIZE CAI_STRUCT_SIZE(cai_mem_alloc_args, flags)

/* ABI 1.3 allocation flags. */
enum {
  /* NVME only: the buffer has no address (data returns NULL, view fails); its bytes live in
   * the file alone and move with cai_mem_api.transfer, through pread/pwrite with O_DIRECT
   * where the filesystem allows, so they occupy neither the process's memory nor the page
   * cache. Starts as zeros. A mapped NVMe buffer (the default, and all a 1.0-1.2 host gives) is
   * a shared mapping of the file: its pages count in the process's memory once touched. */
  CAI_MEM_ALLOC_UNMAPPED = 1u << 0
};

typedef struct cai_mem_usage {
  size_t struct_size;
  cai_extension_base* extension_start;
  uint64_t current_bytes;   /* bytes handed out and not yet freed */
  uint64_t peak_bytes;      /* maximum of current_bytes since start or reset_peak */
  uint64_t budget_bytes;    /* 0 = unlimited */
  uint64_t num_allocations; /* live buffers */
  uint64_t cached_bytes;    /* freed blocks kept for reuse (not counted in current_bytes) */
  /* ABI 1.3, DEVICE tier only (0 on the others): the framework's own tensors on the device
   * (activations, temporaries, the model's parameters while the framework holds them), which
   * count against the same budget as the tier's buffers; their peak; and the peak of
   * current_bytes + framework_bytes together, what the budget bounds. Filled when
   * struct_size covers them (CAI_HAS_FIELD). */
  uint64_t framework_bytes;
  uint64_t framework_peak_bytes;
  uint64_t total_peak_bytes;
} cai_mem_usage;
#define CAI_MEM_USAGE_STRUCT_SIZE CAI_STRUCT_SIZE(cai_mem_usage, total_peak_bytes)

/* Element-wise operations on flat, contiguous tensors (ndim 1, or any ndim with contiguous
 * strides). All operands of one call live on the same device. */
typedef int32_t cai_mem_kernel_op;
enum {
  CAI_KERNEL_COPY = 0,        /* y = x, casting between fp32/bf16/fp16 when dtypes differ */
  CAI_KERNEL_SCALE = 1,       /* y = alpha * y */
  CAI_KERNEL_AXPY = 2,        /* y = alpha * x + y (x may be bf16/fp16 when y is fp32) */
  CAI_KERNEL_FILL = 3,        /* y = alpha */
  CAI_KERNEL_SUM_SQUARES = 4, /* result = sum(y^2) accumulated in fp64 */
  CAI_KERNEL_ALL_FINITE = 5   /* result = 1.0 if every element of y is finite, else 0.0 */
};

typedef struct cai_mem_kernel_args {
  size_t struct_size;
  cai_extension_base* extension_start;
  cai_mem_kernel_op op;
  const cai_tensor* x; /* input; NULL for ops that take none */
  const cai_tensor* y; /* output (or the single operand of reductions) */
  double alpha;
  double* result; /* out: reductions only */
  void* stream;   /* device stream to enqueue on; NULL = synchronous */
} cai_mem_kernel_args;
#define CAI_MEM_KERNEL_ARGS_STRUCT_SIZE CAI_STRUCT_SIZE(cai_mem_kernel_args, stream)

/* ABI 1.3: moving bytes between a buffer's range and addressable memory. */
typedef int32_t cai_mem_direction;
enum {
  CAI_MEM_INTO_BUFFER = 0,  /* memory -> buffer[offset, offset + bytes) */
  CAI_MEM_OUT_OF_BUFFER = 1 /* buffer[offset, offset + bytes) -> memory */
};

/* A transfer in flight; released by cai_mem_api.wait_transfer. */
typedef struct cai_mem_transfer cai_mem_transfer;

typedef struct cai_mem_transfer_args {
  size_t struct_size;
  cai_extension_base* extension_start;
  cai_buffer* buffer; /* any tier, unmapped NVMe included */
  size_t offset;      /* bytes into the buffer */
  void* memory;       /* addressable memory: host memory or a mapped buffer's data */
  size_t bytes;
  cai_mem_direction direction;
  /* false: done before return. true: queued on the host's copy thread (transfers run one at
   * a time, in submission order), *out receives the handle at once; neither the range nor
   * `memory` may be touched until wait_transfer returns. */
  bool async;
} cai_mem_transfer_args;
#define CAI_MEM_TRANSFER_ARGS_STRUCT_SIZE CAI_STRUCT_SIZE(cai_mem_transfer_args, async)

typedef struct cai_mem_api {
  size_t struct_size;
  cai_extension_base* extension_start;

  /* Allocates args->bytes on args->tier. Fails with RESOURCE_EXHAUSTED, naming the tier, the
   * request and the budget, when the tier's budget would be exceeded; with INVALID_ARGUMENT
   * for a bad tier or alignment. Blocks freed earlier are reused before new memory is taken. */
  cai_status* (*alloc)(const cai_mem_alloc_args* args, cai_buffer** out);
  /* Returns the buffer to its tier. Accepts NULL. */
  void (*free)(cai_buffer* buffer);
  /* Fills `out` with a 1-D tensor of `dtype` covering the whole buffer (bytes / element size
   * elements). shape/strides point into the buffer handle and live as long as it does. */
  cai_status* (*view)(cai_buffer* buffer, cai_dtype dtype, cai_tensor* out);
  /* Raw address and size. */
  void* (*data)(cai_buffer* buffer);
  size_t (*size)(const cai_buffer* buffer);
  cai_mem_tier (*tier)(const cai_buffer* buffer);

  /* Per-tier budget; 0 = unlimited. A budget below current use fails with
   * FAILED_PRECONDITION. The DEVICE tier's budget bounds its buffers and the framework's own
   * device tensors together (cai_mem_usage.framework_bytes): a framework allocation beyond it
   * fails the forward or backward that made it with RESOURCE_EXHAUSTED, as a device
   * out-of-memory would. */
  cai_status* (*set_budget)(cai_mem_tier tier, uint64_t bytes);
  cai_status* (*usage)(cai_mem_tier tier, cai_mem_usage* out);
  /* Starts peak accounting of the tier afresh at current use. */
  void (*reset_peak)(cai_mem_tier tier);

  /* Copies `bytes` between any two buffers' addresses (any tiers). With a non-NULL stream
   * the copy is enqueued on it where the device allows, else it completes before return. */
  cai_status* (*copy)(void* dst, const void* src, size_t bytes, void* stream);

  /* Runs one element-wise kernel, vectorised and multi-threaded on the CPU. */
  cai_status* (*kernel)(const cai_mem_kernel_args* args);

  /* ABI 1.3. Moves args->bytes between the buffer's range and args->memory (the only way into
   * an unmapped NVMe buffer). INVALID_ARGUMENT for a range past the buffer's end; a disk
   * error names the buffer's tag and the offset. With args->async, *out is the handle (else
   * NULL) and errors arrive from wait_transfer. */
  cai_status* (*transfer)(const cai_mem_transfer_args* args, cai_mem_transfer** out);
  /* Blocks until the transfer is done, releases the handle and returns its status. Accepts
   * NULL (returns NULL). */
  cai_status* (*wait_transfer)(cai_mem_transfer* transfer);
} cai_mem_api;
#define CAI_MEM_API_STRUCT_SIZE CAI_STRUCT_SIZE(cai_mem_api, wait_transfer)

#ifdef __cplusplus
} /* extern "C" */
#endif

#endif /* CAI_MEMPOOL_H_ */
