/* cai ABI v1 — base types shared by every service table.
 *
 * Pure C11. Includes only <stddef.h>, <stdint.h> and <stdbool.h>; compiles as C and C++.
 *
 * Rules that hold for every header under cai/ (see docs/abi-contract.md):
 *  - Every struct that crosses the boundary starts with `size_t struct_size` followed by
 *    `cai_extension_base* extension_start`. The writer sets struct_size to the size it was
 *    compiled with (the CAI_*_STRUCT_SIZE macro of that struct). A reader uses a field only if
 *    CAI_HAS_FIELD says it lies within the other side's struct_size; a field beyond it reads
 *    as absent (NULL/0). Structs only grow at the end; nothing is reordered, retyped or removed
 *    within a major version.
 *  - Enumerations travel as int32_t, flags as uint64_t; receivers must accept unknown values.
 *  - Errors are values: a function that can fail returns `cai_status*`; NULL means success.
 *    On error, out-parameters are left untouched. No C++ exception ever crosses the boundary.
 *  - Whoever creates an object releases it, through a function of the same table. Release
 *    functions accept NULL.
 *  - Borrowed input pointers (strings, descriptors) are valid for the duration of the call only.
 */
#ifndef CAI_CORE_H_
#define CAI_CORE_H_

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* ---- Versions --------------------------------------------------------------------------- */

/* The major version is part of the entry symbol's name (cai_plugin_init_v1); a plugin built
 * for another major is refused before it is loaded when its manifest says so, and by the
 * negotiation in cai_plugin_init_v1 otherwise. */
#define CAI_ABI_MAJOR 1
/* Bumped for every append to any struct below; see CHANGELOG.md beside these headers. */
#define CAI_ABI_MINOR 2
/* The oldest host minor a plugin built from these headers needs: it reports it at init
 * (cai_plugin_init_args.plugin_min_host_minor), and its manifest's [abi] min_host_minor must
 * say the same (the host refuses a mismatch at load). Defaults to CAI_ABI_MINOR of these
 * headers, so by default a plugin needs a host at least as new as its headers. A plugin
 * author who uses nothing newer than, say, 1.0 defines CAI_TARGET_ABI_MINOR 0 before including
 * cai/abi.h or cai/sdk.hpp so that older hosts accept the plugin, and then checks
 * CAI_HAS_FIELD before using anything newer. */
#ifndef CAI_TARGET_ABI_MINOR
#define CAI_TARGET_ABI_MINOR CAI_ABI_MINOR
#endif

#if defined(_WIN32)
#define CAI_EXPORT __declspec(dllexport)
#else
#define CAI_EXPORT __attribute__((visibility("default")))
#endif

/* Size of `type` up to and including `last_field`: what a writer compiled against the version
 * that ended with `last_field` puts in struct_size. */
#define CAI_STRUCT_SIZE(type, last_field) \
  (offsetof(type, last_field) + sizeof(((type*)0)->last_field))

/* True when `ptr` is non-NULL and its struct_size covers `field`. */
#define CAI_HAS_FIELD(ptr, type, field) \
  ((ptr) != NULL && (ptr)->struct_size >= CAI_STRUCT_SIZE(type, field))

/* Optional, forward-compatible extension chain (PJRT's PJRT_Extension_Base). Experimental
 * features hang here instead of in the core tables. */
typedef struct cai_extension_base {
  size_t struct_size;
  int32_t type;                    /* a CAI_EXT_* value; unknown types are skipped */
  struct cai_extension_base* next; /* NULL ends the chain */
} cai_extension_base;
#define CAI_EXTENSION_BASE_STRUCT_SIZE CAI_STRUCT_SIZE(cai_extension_base, next)

/* ---- Status ----------------------------------------------------------------------------- */

/* Canonical codes (absl / gRPC / PJRT numbering). */
typedef int32_t cai_status_code;
enum {
  CAI_OK = 0,
  CAI_CANCELLED = 1,
  CAI_UNKNOWN = 2,
  CAI_INVALID_ARGUMENT = 3,
  CAI_DEADLINE_EXCEEDED = 4,
  CAI_NOT_FOUND = 5,
  CAI_ALREADY_EXISTS = 6,
  CAI_PERMISSION_DENIED = 7,
  CAI_RESOURCE_EXHAUSTED = 8,
  CAI_FAILED_PRECONDITION = 9,
  CAI_ABORTED = 10,
  CAI_OUT_OF_RANGE = 11,
  CAI_UNIMPLEMENTED = 12,
  CAI_INTERNAL = 13,
  CAI_UNAVAILABLE = 14,
  CAI_DATA_LOSS = 15,
  CAI_UNAUTHENTICATED = 16
};

/* An error: a code plus a UTF-8 message. Opaque; created and destroyed only through
 * cai_host_api.status_create / status_destroy, so it is always freed by the allocator that
 * made it. NULL is success. */
typedef struct cai_status cai_status;

/* ---- Logging ---------------------------------------------------------------------------- */

typedef int32_t cai_log_level;
enum {
  CAI_LOG_TRACE = 0,
  CAI_LOG_DEBUG = 1,
  CAI_LOG_INFO = 2,
  CAI_LOG_WARN = 3,
  CAI_LOG_ERROR = 4
};

/* ---- Tensors: DLPack's DLTensor layout --------------------------------------------------- */

/* Device kinds, numbered as DLPack's DLDeviceType. */
typedef int32_t cai_device_type;
enum {
  CAI_DEVICE_CPU = 1,      /* kDLCPU */
  CAI_DEVICE_CUDA = 2,     /* kDLCUDA */
  CAI_DEVICE_CUDA_HOST = 3 /* kDLCUDAHost: pinned host memory */
};

typedef struct cai_device {
  cai_device_type device_type;
  int32_t device_id;
} cai_device;

/* Type codes, numbered as DLPack's DLDataTypeCode. */
enum {
  CAI_DTYPE_INT = 0,    /* kDLInt */
  CAI_DTYPE_UINT = 1,   /* kDLUInt */
  CAI_DTYPE_FLOAT = 2,  /* kDLFloat: fp16 is {FLOAT, 16, 1}, fp32 {FLOAT, 32, 1} */
  CAI_DTYPE_BFLOAT = 4, /* kDLBfloat: bf16 is {BFLOAT, 16, 1} */
  CAI_DTYPE_BOOL = 6    /* kDLBool */
};

typedef struct cai_dtype {
  uint8_t code; /* CAI_DTYPE_* */
  uint8_t bits;
  uint16_t lanes; /* always 1 in cai */
} cai_dtype;

/* A borrowed view of memory, laid out exactly like DLPack's DLTensor, so a plugin can hand it
 * to any DLPack consumer. Stricter than DLPack: `strides` is never NULL when ndim > 0 (cai
 * always fills it) and `byte_offset` must be honoured. The descriptor does not own data,
 * shape or strides; who filled it says how long they stay valid. */
typedef struct cai_tensor {
  void* data;
  cai_device device;
  int32_t ndim;
  cai_dtype dtype;
  int64_t* shape;
  int64_t* strides; /* in elements, as in DLPack */
  uint64_t byte_offset;
} cai_tensor;

/* ---- Configuration schema --------------------------------------------------------------- */

typedef int32_t cai_config_type;
enum {
  CAI_CONFIG_BOOL = 1,
  CAI_CONFIG_INT = 2,   /* 64-bit signed */
  CAI_CONFIG_FLOAT = 3, /* double; an integer literal is accepted too */
  CAI_CONFIG_STRING = 4
};

/* cai_config_key.flags */
#define CAI_CONFIG_HAS_MIN ((uint64_t)1 << 0) /* min_value bounds INT/FLOAT values (inclusive) */
#define CAI_CONFIG_HAS_MAX ((uint64_t)1 << 1) /* max_value bounds INT/FLOAT values (inclusive) */

/* One key of the TOML table a plugin accepts (the job's [plugin.<name>] table). The host
 * validates the user's table against the plugin's keys before create(): an unknown key is an
 * error naming the nearest valid key, a wrong type or an out-of-range value is an error naming
 * the key; absent keys take their default. All strings are static in the plugin. */
typedef struct cai_config_key {
  size_t struct_size;
  cai_extension_base* extension_start;
  const char* name; /* [a-z0-9_]+ */
  cai_config_type type;
  const char* default_value;  /* TOML literal of the default: "25", "true", "0.5", "\"fp32\"" */
  const char* doc;            /* one sentence, shown by `cai plugins info` */
  const char* const* choices; /* STRING only: NULL-terminated list of allowed values, or NULL */
  uint64_t flags;             /* CAI_CONFIG_HAS_* */
  double min_value;
  double max_value;
} cai_config_key;
#define CAI_CONFIG_KEY_STRUCT_SIZE CAI_STRUCT_SIZE(cai_config_key, max_value)

/* A validated configuration (defaults filled in), owned by the host. Read it through
 * cai_host_api.config_get_*. Valid until the strategy instance it was given to is destroyed. */
typedef struct cai_config cai_config;

#ifdef __cplusplus
} /* extern "C" */
#endif

#endif /* CAI_CORE_H_ */
