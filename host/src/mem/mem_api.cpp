#include "mem/mem_api.h"

#include <bit>
#include <cstdio>
#include <cstring>
#include <future>
#include <memory>
#include <optional>
#include <string>

#include "core/status.h"
#include "mem/kernels.h"
#include "mem/pool.h"

namespace cai {
namespace {

[[noreturn]] void Invalid(const std::string& message) {
  throw Error(CAI_INVALID_ARGUMENT, message);
}

std::string DtypeName(cai_dtype d) {
  const char* code = d.code == CAI_DTYPE_FLOAT    ? "float"
                     : d.code == CAI_DTYPE_BFLOAT ? "bfloat"
                     : d.code == CAI_DTYPE_INT    ? "int"
                     : d.code == CAI_DTYPE_UINT   ? "uint"
                     : d.code == CAI_DTYPE_BOOL   ? "bool"
                                                  : "code?";
  std::string name = std::string(code) + std::to_string(d.bits);
  if (d.lanes != 1) name += "x" + std::to_string(d.lanes);
  return name;
}

// The kernels' element type of `d`, or nothing for dtypes they do not compute on.
std::optional<FloatType> AsFloatType(cai_dtype d) {
  if (d.lanes != 1) return std::nullopt;
  if (d.code == CAI_DTYPE_FLOAT && d.bits == 32) return FloatType::kF32;
  if (d.code == CAI_DTYPE_FLOAT && d.bits == 16) return FloatType::kF16;
  if (d.code == CAI_DTYPE_BFLOAT && d.bits == 16) return FloatType::kBF16;
  return std::nullopt;
}

// Element size of a dtype a buffer may be viewed as, 0 for anything else.
size_t ViewElementSize(cai_dtype d) {
  if (d.lanes != 1) return 0;
  switch (d.code) {
    case CAI_DTYPE_INT:
    case CAI_DTYPE_UINT:
      return d.bits == 8 || d.bits == 16 || d.bits == 32 || d.bits == 64 ? d.bits / 8u : 0;
    case CAI_DTYPE_FLOAT:
      return d.bits == 16 || d.bits == 32 || d.bits == 64 ? d.bits / 8u : 0;
    case CAI_DTYPE_BFLOAT:
      return d.bits == 16 ? 2 : 0;
    case CAI_DTYPE_BOOL:
      return d.bits == 8 ? 1 : 0;
    default:
      return 0;
  }
}

struct Operand {
  void* data = nullptr;
  size_t numel = 0;
  FloatType type = FloatType::kF32;
  cai_dtype dtype{};
};

// Checks that `t` is a dense CPU-addressable tensor and returns its base address and size.
Operand CheckTensor(const cai_tensor* t, const char* name) {
  if (!t) Invalid(std::string("kernel operand ") + name + " is NULL");
  const std::string where = std::string("kernel operand ") + name;
  if (t->device.device_type != CAI_DEVICE_CPU && t->device.device_type != CAI_DEVICE_CUDA_HOST) {
    Invalid(where + " is on device type " + std::to_string(t->device.device_type) +
            "; this host was built for the CPU and runs kernels on host memory only");
  }
  if (t->ndim < 0 || (t->ndim > 0 && !t->shape)) {
    Invalid(where + " has ndim " + std::to_string(t->ndim) + " and shape " +
            (t->shape ? "set" : "NULL"));
  }
  size_t numel = 1;
  int64_t expected_stride = 1;
  for (int32_t i = t->ndim - 1; i >= 0; --i) {
    const int64_t extent = t->shape[i];
    if (extent < 0) Invalid(where + " has negative extent in dimension " + std::to_string(i));
    // A dimension of extent 1 may carry any stride (DLPack allows it); others must be dense.
    if (t->strides && extent != 1 && t->strides[i] != expected_stride) {
      Invalid(where + " is not contiguous (dimension " + std::to_string(i) + " has stride " +
              std::to_string(t->strides[i]) + ", expected " + std::to_string(expected_stride) +
              "); kernels work on dense row-major buffers");
    }
    expected_stride *= extent;
    numel *= static_cast<size_t>(extent);
  }
  Operand op;
  op.numel = numel;
  op.dtype = t->dtype;
  if (numel > 0 && !t->data)
    Invalid(where + " has " + std::to_string(numel) + " elements but data is NULL");
  op.data = t->data ? static_cast<char*>(t->data) + t->byte_offset : nullptr;
  return op;
}

FloatType RequireFloat(const Operand& op, const char* name, const char* kernel) {
  auto type = AsFloatType(op.dtype);
  if (!type) {
    Invalid(std::string(kernel) + ": operand " + name + " has dtype " + DtypeName(op.dtype) +
            "; expected float32, bfloat16 or float16");
  }
  return *type;
}

void RunKernel(const cai_mem_kernel_args* args) {
  RequireStructSize(args, CAI_STRUCT_SIZE(cai_mem_kernel_args, stream), "cai_mem_kernel_args");
  const char* kernel = "";
  bool takes_x = false, reduces = false;
  switch (args->op) {
    case CAI_KERNEL_COPY:
      kernel = "COPY", takes_x = true;
      break;
    case CAI_KERNEL_SCALE:
      kernel = "SCALE";
      break;
    case CAI_KERNEL_AXPY:
      kernel = "AXPY", takes_x = true;
      break;
    case CAI_KERNEL_FILL:
      kernel = "FILL";
      break;
    case CAI_KERNEL_SUM_SQUARES:
      kernel = "SUM_SQUARES", reduces = true;
      break;
    case CAI_KERNEL_ALL_FINITE:
      kernel = "ALL_FINITE", reduces = true;
      break;
    default:
      Invalid("unknown kernel op " + std::to_string(args->op));
  }
  if (reduces && !args->result) Invalid(std::string(kernel) + ": result is NULL");
  const Operand y = CheckTensor(args->y, "y");
  const FloatType y_type =
      args->op == CAI_KERNEL_COPY ? FloatType::kF32 : RequireFloat(y, "y", kernel);
  const float alpha = static_cast<float>(args->alpha);

  if (takes_x) {
    const Operand x = CheckTensor(args->x, "x");
    if (x.numel != y.numel) {
      Invalid(std::string(kernel) + ": x has " + std::to_string(x.numel) + " elements, y has " +
              std::to_string(y.numel));
    }
    if (args->op == CAI_KERNEL_COPY) {
      const bool same = x.dtype.code == y.dtype.code && x.dtype.bits == y.dtype.bits &&
                        x.dtype.lanes == y.dtype.lanes;
      if (same && ViewElementSize(x.dtype) != 0) {
        ParallelMemcpy(y.data, x.data, x.numel * ViewElementSize(x.dtype));
        return;
      }
      const auto xt = AsFloatType(x.dtype), yt = AsFloatType(y.dtype);
      if (!xt || !yt) {
        Invalid("COPY from " + DtypeName(x.dtype) + " to " + DtypeName(y.dtype) +
                ": casts are between float32, bfloat16 and float16 only");
      }
      CastCopy(x.data, *xt, y.data, *yt, y.numel);
      return;
    }
    if (y_type != FloatType::kF32) {
      Invalid("AXPY: y has dtype " + DtypeName(y.dtype) + "; it must be float32");
    }
    Axpy(alpha, x.data, RequireFloat(x, "x", kernel), static_cast<float*>(y.data), y.numel);
    return;
  }
  switch (args->op) {
    case CAI_KERNEL_SCALE:
      Scale(y.data, y_type, y.numel, alpha);
      break;
    case CAI_KERNEL_FILL:
      Fill(y.data, y_type, y.numel, alpha);
      break;
    case CAI_KERNEL_SUM_SQUARES:
      *args->result = SumSquares(y.data, y_type, y.numel);
      break;
    case CAI_KERNEL_ALL_FINITE:
      *args->result = AllFinite(y.data, y_type, y.numel) ? 1.0 : 0.0;
      break;
    default:
      break;
  }
}

cai_status* Alloc(const cai_mem_alloc_args* args, cai_buffer** out) {
  return Guard([&] {
    RequireStructSize(args, CAI_STRUCT_SIZE(cai_mem_alloc_args, zero_fill), "cai_mem_alloc_args");
    if (!out) Invalid("cai_mem_api.alloc: out is NULL");
    const uint64_t flags = CAI_HAS_FIELD(args, cai_mem_alloc_args, flags) ? args->flags : 0;
    if ((flags & ~uint64_t{CAI_MEM_ALLOC_UNMAPPED}) != 0) {
      Invalid("cai_mem_api.alloc: unknown flags 0x" + [&] {
        char hex[24];
        std::snprintf(hex, sizeof hex, "%llx",
                      static_cast<unsigned long long>(flags & ~uint64_t{CAI_MEM_ALLOC_UNMAPPED}));
        return std::string(hex);
      }() + " (this host knows CAI_MEM_ALLOC_UNMAPPED only)");
    }
    *out = MemoryPool::Global().Allocate(args->tier, args->bytes, args->alignment,
                                         args->tag ? args->tag : "", args->zero_fill,
                                         (flags & CAI_MEM_ALLOC_UNMAPPED) != 0);
  });
}

void Free(cai_buffer* buffer) {
  if (buffer) MemoryPool::Global().Free(buffer);
}

cai_status* View(cai_buffer* buffer, cai_dtype dtype, cai_tensor* out) {
  return Guard([&] {
    if (!buffer || !out) Invalid("cai_mem_api.view: buffer or out is NULL");
    const size_t size = ViewElementSize(dtype);
    if (size == 0) Invalid("cai_mem_api.view: unsupported dtype " + DtypeName(dtype));
    if (buffer->data == nullptr) {
      throw Error(CAI_FAILED_PRECONDITION,
                  "cai_mem_api.view: buffer \"" + buffer->tag +
                      "\" is an unmapped NVMe buffer, which has no address: move its bytes "
                      "with cai_mem_api.transfer");
    }
    out->data = buffer->data;
    out->device = cai_device{CAI_DEVICE_CPU, 0};
    out->ndim = 1;
    out->dtype = dtype;
    out->shape = &buffer->elements[std::countr_zero(size)];
    out->strides = &buffer->unit_stride;
    out->byte_offset = 0;
  });
}

void* Data(cai_buffer* buffer) { return buffer ? buffer->data : nullptr; }
size_t Size(const cai_buffer* buffer) { return buffer ? buffer->bytes : 0; }
cai_mem_tier TierOf(const cai_buffer* buffer) { return buffer ? buffer->tier : CAI_MEM_NUM_TIERS; }

cai_status* SetBudget(cai_mem_tier tier, uint64_t bytes) {
  return Guard([&] { MemoryPool::Global().SetBudget(tier, bytes); });
}

cai_status* Usage(cai_mem_tier tier, cai_mem_usage* out) {
  return Guard([&] {
    RequireStructSize(out, CAI_STRUCT_SIZE(cai_mem_usage, cached_bytes), "cai_mem_usage");
    const TierUsage u = MemoryPool::Global().Usage(tier);
    out->current_bytes = u.current_bytes;
    out->peak_bytes = u.peak_bytes;
    out->budget_bytes = u.budget_bytes;
    out->num_allocations = u.num_allocations;
    out->cached_bytes = u.cached_bytes;
    if (CAI_HAS_FIELD(out, cai_mem_usage, total_peak_bytes)) {
      out->framework_bytes = u.framework_bytes;
      out->framework_peak_bytes = u.framework_peak_bytes;
      out->total_peak_bytes = u.total_peak_bytes;
    }
  });
}

void ResetPeak(cai_mem_tier tier) {
  if (tier >= 0 && tier < CAI_MEM_NUM_TIERS) MemoryPool::Global().ResetPeak(tier);
}

// The stream is ignored: on the CPU every copy completes before return.
cai_status* Copy(void* dst, const void* src, size_t bytes, void* /*stream*/) {
  return Guard([&] {
    if (bytes == 0) return;
    if (!dst || !src) Invalid("cai_mem_api.copy: dst or src is NULL");
    const auto* d = static_cast<const char*>(dst);
    const auto* s = static_cast<const char*>(src);
    if (d < s + bytes && s < d + bytes) {
      std::memmove(dst, src, bytes);
    } else {
      ParallelMemcpy(dst, src, bytes);
    }
  });
}

cai_status* Kernel(const cai_mem_kernel_args* args) {
  return Guard([&] { RunKernel(args); });
}

}  // namespace
}  // namespace cai

// The handle of an asynchronous transfer: what the copy thread will report.
struct cai_mem_transfer {
  std::future<void> done;
};

namespace cai {
namespace {

cai_status* Transfer(const cai_mem_transfer_args* args, cai_mem_transfer** out) {
  return Guard([&] {
    RequireStructSize(args, CAI_MEM_TRANSFER_ARGS_STRUCT_SIZE, "cai_mem_transfer_args");
    if (out) *out = nullptr;
    if (args->direction != CAI_MEM_INTO_BUFFER && args->direction != CAI_MEM_OUT_OF_BUFFER) {
      Invalid("cai_mem_api.transfer: direction " + std::to_string(args->direction) +
              " is neither CAI_MEM_INTO_BUFFER (0) nor CAI_MEM_OUT_OF_BUFFER (1)");
    }
    const cai_mem_transfer_args a = *args;
    auto run = [a] {
      if (a.direction == CAI_MEM_INTO_BUFFER) {
        MemoryPool::Write(a.buffer, a.offset, a.memory, a.bytes);
      } else {
        MemoryPool::Read(a.buffer, a.offset, a.memory, a.bytes);
      }
    };
    if (!a.async) {
      run();
      return;
    }
    if (!out) Invalid("cai_mem_api.transfer: async needs out, for the handle to wait on");
    auto* handle = new cai_mem_transfer{MemoryPool::Global().Submit(std::move(run))};
    *out = handle;
  });
}

cai_status* WaitTransfer(cai_mem_transfer* transfer) {
  if (transfer == nullptr) return nullptr;
  std::unique_ptr<cai_mem_transfer> owned(transfer);
  return Guard([&] { owned->done.get(); });
}

}  // namespace

const cai_mem_api* MemApi() {
  static const cai_mem_api api = {
      .struct_size = CAI_MEM_API_STRUCT_SIZE,
      .extension_start = nullptr,
      .alloc = Alloc,
      .free = Free,
      .view = View,
      .data = Data,
      .size = Size,
      .tier = TierOf,
      .set_budget = SetBudget,
      .usage = Usage,
      .reset_peak = ResetPeak,
      .copy = Copy,
      .kernel = Kernel,
      .transfer = Transfer,
      .wait_transfer = WaitTransfer,
  };
  return &api;
}

}  // namespace cai
