// cai SDK: a header-only C++ layer over the C ABI for plugin authors.
//
// Plugin authors write an ordinary C++ class; the boundary stays C. This header gives
//  - cai::sdk::Error and Check(): host statuses become exceptions inside the plugin, and
//    Guard() turns any exception back into a status at every entry point (none ever crosses);
//  - RAII handles that release through the ABI (Buffer, Work, LossScaler);
//  - typed config access (Config) and config-schema builders (BoolKey, IntKey, ...);
//  - flat-buffer helpers (FlatView, RunKernel), ParamInfo, StateSlots, OnEveryGradReady,
//    RunCollective, RunMicroBatch, WriteAsFp32, and the standard loss-scaler keys and
//    checkpoint state (LossScalerConfig, Save/LoadLossScalerState);
//  - CAI_PLUGIN(Class): defines cai_plugin_init_v1 with two-way version negotiation and the
//    strategy table, with required and optional methods detected at compile time.
//
// The building blocks of data-parallel strategies live beside it, each usable over any
// communicator group (so a strategy can run them over a data-parallel sub-group):
//   cai/sdk/flat.hpp            flat parameter/gradient storage (FlatLayout), the fused update
//                               of any flat range (FlatOptimizer), canonical checkpoint I/O
//   cai/sdk/collectives.hpp     broadcast of parameters and buffers, average over a group
//   cai/sdk/step.hpp            the step epilogue: agreement on norm, overflow and used
//                               parameters, loss scaling, clipping, lr (StepEpilogue)
//   cai/sdk/bucket_reducer.hpp  DDP's bucketed gradient all-reduce (BucketReducer)
//   cai/sdk/zero.hpp            the ZeRO-1/2 partitioned optimizer (ZeroOptimizer)
//
// A strategy class provides:
//   static constexpr const char* kName, kVersion;   static constexpr uint64_t kCapabilities;
//   static std::span<const cai_config_key> ConfigKeys();
//   explicit Class(const cai_create_args&);
//   void Boost(const cai_boost_args&);  void ForwardBackward(const cai_micro_batch&);
//   void Step(cai_step_result&);  void ZeroGrad();
//   void Save(const cai_checkpoint_args&);  void Load(const cai_checkpoint_args&);
//   void Stats(cai_strategy_stats&);
// and optionally NoSync(bool), ExecutePipeline(const cai_pipeline_args&),
//   Evaluate(const cai_micro_batch&),
//   static void EstimateMemory(const cai_memory_estimate_args&, cai_memory_estimate&) and
//   ParallelLayout(cai_parallel_layout&) (ABI 1.3: replicas, which rank reports the loss,
//   pipelining; the host calls it once after Boost).
// Argument structs reach these methods normalised: fields the host did not send read as zero;
// out structs are copied back only as far as the host's struct_size allows.
#ifndef CAI_SDK_HPP_
#define CAI_SDK_HPP_

#include <algorithm>
#include <array>
#include <cstdio>
#include <cstring>
#include <new>
#include <optional>
#include <span>
#include <stdexcept>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "cai/abi.h"

namespace cai::sdk {

// ---- Host and errors ------------------------------------------------------------------------

// The host table, set once by the entry point before anything else runs.
inline const cai_host_api*& HostSlot() {
  static const cai_host_api* host = nullptr;
  return host;
}
inline const cai_host_api& Host() { return *HostSlot(); }

// Name used as the log source; set by the entry point.
inline const char*& PluginNameSlot() {
  static const char* name = "plugin";
  return name;
}

// The directory of the plugin's manifest, set by the entry point: where files shipped beside
// the plugin are (the library itself is loaded from a descriptor, so dladdr and $ORIGIN do not
// name it).
inline std::string& PluginDirSlot() {
  static std::string dir;
  return dir;
}

class Error : public std::runtime_error {
 public:
  Error(cai_status_code code, const std::string& message)
      : std::runtime_error(message), code_(code) {}
  cai_status_code code() const { return code_; }

 private:
  cai_status_code code_;
};

// Throws the status as an Error (and destroys it); does nothing on success (NULL).
inline void Check(cai_status* status) {
  if (!status) return;
  const cai_status_code code = Host().status_code(status);
  std::string message = Host().status_message(status);
  Host().status_destroy(status);
  throw Error(code, message);
}

inline cai_status* MakeStatus(cai_status_code code, std::string_view message) {
  return Host().status_create(code, message.data(), message.size());
}

// Runs fn and returns NULL, or the status of what it threw. Never throws.
template <class F>
cai_status* Guard(F&& fn) noexcept {
  try {
    std::forward<F>(fn)();
    return nullptr;
  } catch (const Error& e) {
    return MakeStatus(e.code(), e.what());
  } catch (const std::bad_alloc&) {
    return MakeStatus(CAI_RESOURCE_EXHAUSTED, std::string(PluginNameSlot()) + ": out of memory");
  } catch (const std::exception& e) {
    return MakeStatus(CAI_INTERNAL, std::string(PluginNameSlot()) + ": " + e.what());
  } catch (...) {
    return MakeStatus(CAI_INTERNAL, std::string(PluginNameSlot()) + ": unknown exception");
  }
}

inline void Log(cai_log_level level, std::string_view message) {
  Host().log(level, PluginNameSlot(), message.data(), message.size());
}

// ---- Config -------------------------------------------------------------------------------

// Typed reads of the plugin's validated table. Keys must be declared in ConfigKeys().
class Config {
 public:
  explicit Config(const cai_config* config) : config_(config) {}
  bool Bool(const char* key) const {
    bool v = false;
    Check(Host().config_get_bool(config_, key, &v));
    return v;
  }
  int64_t Int(const char* key) const {
    int64_t v = 0;
    Check(Host().config_get_int(config_, key, &v));
    return v;
  }
  double Float(const char* key) const {
    double v = 0;
    Check(Host().config_get_float(config_, key, &v));
    return v;
  }
  std::string String(const char* key) const {
    const char* v = nullptr;
    Check(Host().config_get_string(config_, key, &v));
    return v;
  }

 private:
  const cai_config* config_;
};

// Schema builders for a plugin's `static constexpr cai_config_key kKeys[]`.
constexpr cai_config_key BoolKey(const char* name, const char* def, const char* doc) {
  return {CAI_CONFIG_KEY_STRUCT_SIZE, nullptr, name, CAI_CONFIG_BOOL, def, doc, nullptr, 0, 0, 0};
}
constexpr cai_config_key IntKey(const char* name, const char* def, const char* doc, double min = 0,
                                double max = 0, uint64_t flags = 0) {
  return {CAI_CONFIG_KEY_STRUCT_SIZE,
          nullptr,
          name,
          CAI_CONFIG_INT,
          def,
          doc,
          nullptr,
          flags,
          min,
          max};
}
constexpr cai_config_key FloatKey(const char* name, const char* def, const char* doc,
                                  double min = 0, double max = 0, uint64_t flags = 0) {
  return {CAI_CONFIG_KEY_STRUCT_SIZE,
          nullptr,
          name,
          CAI_CONFIG_FLOAT,
          def,
          doc,
          nullptr,
          flags,
          min,
          max};
}
constexpr cai_config_key StringKey(const char* name, const char* def, const char* doc,
                                   const char* const* choices = nullptr) {
  return {CAI_CONFIG_KEY_STRUCT_SIZE, nullptr, name, CAI_CONFIG_STRING, def, doc, choices, 0, 0, 0};
}

// Concatenates key lists, for a schema made of a plugin's own keys and shared sets such as
// LossScalerKeys: `static constexpr auto kKeys = JoinKeys(std::array{...}, LossScalerKeys(...));`
template <size_t... N>
constexpr std::array<cai_config_key, (N + ...)> JoinKeys(
    const std::array<cai_config_key, N>&... lists) {
  std::array<cai_config_key, (N + ...)> out{};
  size_t i = 0;
  ((std::copy(lists.begin(), lists.end(), out.begin() + i), i += N), ...);
  return out;
}

// The fp16 loss scaler's keys that LossScalerConfig reads, with ColossalAI's defaults except
// initial_scale, whose default (and its doc) each plugin chooses.
constexpr std::array<cai_config_key, 7> LossScalerKeys(const char* initial_scale,
                                                       const char* initial_scale_doc) {
  return {
      FloatKey("initial_scale", initial_scale, initial_scale_doc, 1, 0, CAI_CONFIG_HAS_MIN),
      FloatKey("growth_factor", "2.0", "fp16: scale multiplier after growth_interval clean steps.",
               1, 0, CAI_CONFIG_HAS_MIN),
      FloatKey("backoff_factor", "0.5", "fp16: scale multiplier after hysteresis overflows.", 0, 1,
               CAI_CONFIG_HAS_MIN | CAI_CONFIG_HAS_MAX),
      IntKey("growth_interval", "1000", "fp16: clean steps before the scale grows.", 1, 0,
             CAI_CONFIG_HAS_MIN),
      IntKey("hysteresis", "2", "fp16: overflowing steps tolerated before the scale shrinks.", 1, 0,
             CAI_CONFIG_HAS_MIN),
      FloatKey("min_scale", "1.0", "fp16: smallest loss scale.", 0, 0, CAI_CONFIG_HAS_MIN),
      FloatKey("max_scale", "4294967296.0", "fp16: largest loss scale (2^32).", 1, 0,
               CAI_CONFIG_HAS_MIN),
  };
}

// ---- RAII handles -------------------------------------------------------------------------

// Memory from the host's pool; freed through the pool.
class Buffer {
 public:
  Buffer() = default;
  // `flags`: CAI_MEM_ALLOC_* bits (ABI 1.3; a host older than that refuses them).
  static Buffer Alloc(cai_mem_tier tier, size_t bytes, const char* tag, bool zero_fill = false,
                      uint64_t flags = 0) {
    if (flags != 0 && !CAI_HAS_FIELD(Host().mempool, cai_mem_api, transfer)) {
      throw Error(CAI_FAILED_PRECONDITION,
                  std::string(tag ? tag : "buffer") +
                      ": allocation flags (unmapped NVMe buffers) need host ABI 1.3; this "
                      "host's memory pool is older. Upgrade cai");
    }
    cai_mem_alloc_args args{};
    args.struct_size = CAI_MEM_ALLOC_ARGS_STRUCT_SIZE;
    args.tier = tier;
    args.bytes = bytes;
    args.tag = tag;
    args.zero_fill = zero_fill;
    args.flags = flags;
    Buffer b;
    Check(Host().mempool->alloc(&args, &b.buffer_));
    return b;
  }
  Buffer(Buffer&& other) noexcept : buffer_(std::exchange(other.buffer_, nullptr)) {}
  Buffer& operator=(Buffer&& other) noexcept {
    std::swap(buffer_, other.buffer_);
    return *this;
  }
  ~Buffer() {
    if (buffer_) Host().mempool->free(buffer_);
  }
  void* data() const { return buffer_ ? Host().mempool->data(buffer_) : nullptr; }
  size_t size() const { return buffer_ ? Host().mempool->size(buffer_) : 0; }
  cai_buffer* get() const { return buffer_; }

 private:
  cai_buffer* buffer_ = nullptr;
};

// Bytes moving between a buffer's range and addressable memory (cai_mem_api.transfer, ABI
// 1.3): the only way into an unmapped NVMe buffer. Started asynchronously it runs on the
// host's copy thread, in submission order; Wait (or the destructor, which drops its error)
// completes it, and until then neither the range nor the memory may be touched.
class Transfer {
 public:
  Transfer() = default;
  static Transfer Start(const Buffer& buffer, size_t offset, void* memory, size_t bytes,
                        cai_mem_direction direction, bool async) {
    if (!CAI_HAS_FIELD(Host().mempool, cai_mem_api, transfer)) {
      throw Error(CAI_FAILED_PRECONDITION,
                  "transfers between memory tiers need host ABI 1.3; this host's memory pool "
                  "is older. Upgrade cai");
    }
    cai_mem_transfer_args args{};
    args.struct_size = CAI_MEM_TRANSFER_ARGS_STRUCT_SIZE;
    args.buffer = buffer.get();
    args.offset = offset;
    args.memory = memory;
    args.bytes = bytes;
    args.direction = direction;
    args.async = async;
    Transfer t;
    Check(Host().mempool->transfer(&args, async ? &t.transfer_ : nullptr));
    return t;
  }
  Transfer(Transfer&& other) noexcept : transfer_(std::exchange(other.transfer_, nullptr)) {}
  Transfer& operator=(Transfer&& other) noexcept {
    std::swap(transfer_, other.transfer_);
    return *this;
  }
  Transfer(const Transfer&) = delete;
  Transfer& operator=(const Transfer&) = delete;
  ~Transfer() {
    if (transfer_) Host().status_destroy(Host().mempool->wait_transfer(transfer_));
  }
  void Wait() {
    if (transfer_) Check(Host().mempool->wait_transfer(std::exchange(transfer_, nullptr)));
  }

 private:
  cai_mem_transfer* transfer_ = nullptr;
};

// A collective in flight; released (after waiting) through the communicator.
class Work {
 public:
  Work() = default;
  explicit Work(cai_comm_work* work) : work_(work) {}
  Work(Work&& other) noexcept : work_(std::exchange(other.work_, nullptr)) {}
  Work& operator=(Work&& other) noexcept {
    std::swap(work_, other.work_);
    return *this;
  }
  ~Work() {
    if (work_) Host().comm->work_release(work_);
  }
  void Wait(int64_t timeout_ms = 0) {
    if (work_) Check(Host().comm->work_wait(work_, timeout_ms));
  }
  bool valid() const { return work_ != nullptr; }
  // Non-blocking: whether the operation has completed (an empty handle has).
  bool Done() const { return !work_ || Host().comm->work_is_completed(work_); }

 private:
  cai_comm_work* work_ = nullptr;
};

class LossScaler {
 public:
  explicit LossScaler(const cai_loss_scaler_config& config) {
    Check(Host().optimizer->loss_scaler_create(&config, &scaler_));
  }
  LossScaler(const LossScaler&) = delete;
  LossScaler& operator=(const LossScaler&) = delete;
  ~LossScaler() { Host().optimizer->loss_scaler_destroy(scaler_); }
  double scale() const { return Host().optimizer->loss_scaler_scale(scaler_); }
  // Returns true when the step must be skipped.
  bool Update(bool found_inf) { return Host().optimizer->loss_scaler_update(scaler_, found_inf); }
  cai_loss_scaler* get() const { return scaler_; }

 private:
  cai_loss_scaler* scaler_ = nullptr;
};

// ---- Flat buffers, kernels, the model -------------------------------------------------------
// Strategies keep parameters, gradients and optimizer state in flat pool buffers and hand the
// host 1-D views of pieces of them.

inline bool SameDtype(cai_dtype a, cai_dtype b) { return a.code == b.code && a.bits == b.bits; }
inline size_t ElementSize(cai_dtype d) { return d.bits / 8; }

// The dtype train.precision computes in.
inline cai_dtype ComputeDtype(cai_precision precision) {
  if (precision == CAI_PRECISION_BF16) return {CAI_DTYPE_BFLOAT, 16, 1};
  if (precision == CAI_PRECISION_FP16) return {CAI_DTYPE_FLOAT, 16, 1};
  return {CAI_DTYPE_FLOAT, 32, 1};
}
// The dtype a config value "fp32", "bf16" or "fp16" names; `otherwise` for the key's other
// choices ("param", "compute", ...), which its schema already limited.
inline cai_dtype DtypeNamed(std::string_view name, cai_dtype otherwise) {
  if (name == "fp32") return {CAI_DTYPE_FLOAT, 32, 1};
  if (name == "bf16") return {CAI_DTYPE_BFLOAT, 16, 1};
  if (name == "fp16") return {CAI_DTYPE_FLOAT, 16, 1};
  return otherwise;
}

// A 1-D view of `*numel` elements of `dtype` starting `offset` elements into `base`. `numel`
// must outlive every use of the descriptor (which nobody writes through: cai_tensor's shape is
// borrowed and read-only by contract).
inline cai_tensor FlatView(const Buffer& base, cai_dtype dtype, size_t offset,
                           const int64_t* numel) {
  static int64_t unit_stride = 1;  // never written through
  cai_tensor whole{};
  Check(Host().mempool->view(base.get(), dtype, &whole));
  whole.data = static_cast<char*>(whole.data) + whole.byte_offset + offset * ElementSize(dtype);
  whole.byte_offset = 0;
  whole.shape = const_cast<int64_t*>(numel);
  whole.strides = &unit_stride;
  return whole;
}

// Runs one of the memory pool's element-wise kernels (cai_mem_kernel_op) to completion.
inline void RunKernel(cai_mem_kernel_op op, const cai_tensor* x, const cai_tensor& y,
                      double alpha = 0, double* result = nullptr) {
  cai_mem_kernel_args args{};
  args.struct_size = CAI_MEM_KERNEL_ARGS_STRUCT_SIZE;
  args.op = op;
  args.x = x;
  args.y = &y;
  args.alpha = alpha;
  args.result = result;
  Check(Host().mempool->kernel(&args));
}

inline cai_param_info ParamInfo(const cai_model* model, uint32_t index) {
  cai_param_info info{};
  info.struct_size = CAI_PARAM_INFO_STRUCT_SIZE;
  Check(Host().model->param_info(model, index, &info));
  return info;
}

// The model parameters that own storage (tied aliases, tied_to >= 0, share the owner's), in
// registration order; with `trainable`, only those that require a gradient, without, only the
// frozen ones.
inline std::vector<uint32_t> OwnedParams(const cai_model* model, bool trainable) {
  std::vector<uint32_t> out;
  for (uint32_t i = 0; i < Host().model->num_params(model); ++i) {
    const cai_param_info info = ParamInfo(model, i);
    if (info.tied_to >= 0) continue;
    if (((info.flags & CAI_PARAM_REQUIRES_GRAD) != 0) == trainable) out.push_back(i);
  }
  return out;
}

// The optimizer's fp32 state values per element of `group` (2 for Adam, 1 for SGD+momentum),
// and the most of any group.
inline uint32_t StateSlots(const cai_optimizer* optimizer, uint32_t group) {
  cai_optim_group_info info{};
  info.struct_size = CAI_OPTIM_GROUP_INFO_STRUCT_SIZE;
  Check(Host().optimizer->group_info(optimizer, group, &info));
  return info.state_slots;
}
inline uint32_t MaxStateSlots(const cai_optimizer* optimizer) {
  uint32_t slots = 0;
  for (uint32_t g = 0; g < Host().optimizer->num_groups(optimizer); ++g) {
    slots = std::max(slots, StateSlots(optimizer, g));
  }
  return slots;
}

// Calls fn(user_data, event) whenever a trainable parameter's gradient is ready; returns the id
// for cai_model_api.remove_hook.
inline uint64_t OnEveryGradReady(cai_model* model, cai_hook_fn fn, void* user_data) {
  cai_hook_args hook{};
  hook.struct_size = CAI_HOOK_ARGS_STRUCT_SIZE;
  hook.kind = CAI_HOOK_GRAD_READY;
  hook.unit = -1;
  hook.param = -1;
  hook.fn = fn;
  hook.user_data = user_data;
  uint64_t id = 0;
  Check(Host().model->register_hook(model, &hook, &id));
  return id;
}

// One collective on `group` (NULL: the world; see cai_comm_args; `input` NULL for the ops that
// take none, root 0). With `async` the returned Work must be waited for before the buffers are
// touched; without, it is empty and the collective has completed.
inline Work RunCollective(cai_comm_op op, const cai_tensor* input, const cai_tensor& output,
                          bool async, cai_reduce_op reduce = CAI_REDUCE_SUM,
                          cai_comm_group* group = nullptr) {
  cai_comm_args args{};
  args.struct_size = CAI_COMM_ARGS_STRUCT_SIZE;
  args.group = group;
  args.op = op;
  args.reduce_op = reduce;
  args.input = input;
  args.output = &output;
  args.async = async;
  cai_comm_work* work = nullptr;
  Check(Host().comm->run(&args, async ? &work : nullptr));
  return Work(work);
}

// Writes contiguous `data` (fp32, bf16 or fp16) under `name` as fp32, the dtype of the
// canonical checkpoint layout, described with `shape` when given (a flat view of a parameter
// saved in the parameter's shape).
inline void WriteAsFp32(cai_checkpoint* ckpt, const std::string& name, const cai_tensor& data,
                        std::span<const int64_t> shape = {}) {
  constexpr cai_dtype kF32{CAI_DTYPE_FLOAT, 32, 1};
  cai_tensor t = data;
  Buffer converted;
  if (!SameDtype(data.dtype, kF32)) {
    size_t numel = 1;
    for (int32_t d = 0; d < data.ndim; ++d) numel *= static_cast<size_t>(data.shape[d]);
    converted = Buffer::Alloc(CAI_MEM_DEVICE, std::max<size_t>(numel, 1) * 4, "checkpoint");
    t.data = converted.data();
    t.dtype = kF32;
    t.byte_offset = 0;
    RunKernel(CAI_KERNEL_COPY, &data, t);
  }
  std::vector<int64_t> strides(shape.size(), 1);
  if (!shape.empty()) {
    for (size_t d = shape.size(); d-- > 1;) strides[d - 1] = strides[d] * shape[d];
    t.ndim = static_cast<int32_t>(shape.size());
    t.shape = const_cast<int64_t*>(shape.data());
    t.strides = strides.data();
  }
  Check(Host().checkpoint->write_tensor(ckpt, name.c_str(), &t));
}

// One micro-batch through the whole model: forward and, with `backward`, backward of the loss
// times the batch's weight and `loss_scale`.
inline void RunMicroBatch(cai_model* model, const cai_micro_batch& batch, bool backward,
                          double loss_scale = 1) {
  cai_forward_backward_args args{};
  args.struct_size = CAI_FORWARD_BACKWARD_ARGS_STRUCT_SIZE;
  args.tokens = batch.tokens;
  args.targets = batch.targets;
  args.backward = backward;
  args.loss_scale = loss_scale;
  args.loss_weight = backward ? batch.loss_weight : 0;
  args.loss = batch.loss;
  Check(Host().model->forward_backward(model, &args));
}

// Checkpoint metadata `key`, or nothing when the checkpoint has none (a NOT_FOUND status).
inline std::optional<std::string> ReadMetaIfPresent(cai_checkpoint* ckpt, const char* key) {
  const char* value = nullptr;
  cai_status* status = Host().checkpoint->read_meta(ckpt, key, &value);
  if (!status) return std::string(value);
  const cai_status_code code = Host().status_code(status);
  std::string message = Host().status_message(status);
  Host().status_destroy(status);
  if (code != CAI_NOT_FOUND) throw Error(code, message);
  return std::nullopt;
}

// ---- Loss scaling keys and checkpoint state -------------------------------------------------

// The scaler configuration from a plugin's keys initial_scale, growth_factor, backoff_factor,
// growth_interval, hysteresis, min_scale and max_scale; `plugin` names it in errors.
inline cai_loss_scaler_config LossScalerConfig(const Config& config, const std::string& plugin) {
  cai_loss_scaler_config c{};
  c.struct_size = CAI_LOSS_SCALER_CONFIG_STRUCT_SIZE;
  c.initial_scale = config.Float("initial_scale");
  c.growth_factor = config.Float("growth_factor");
  c.backoff_factor = config.Float("backoff_factor");
  c.growth_interval = config.Int("growth_interval");
  c.hysteresis = config.Int("hysteresis");
  c.min_scale = config.Float("min_scale");
  c.max_scale = config.Float("max_scale");
  if (c.min_scale > c.max_scale) {
    throw Error(CAI_INVALID_ARGUMENT, plugin + ": min_scale " + std::to_string(c.min_scale) +
                                          " exceeds max_scale " + std::to_string(c.max_scale) +
                                          "; lower min_scale");
  }
  if (c.initial_scale < c.min_scale || c.initial_scale > c.max_scale) {
    throw Error(CAI_INVALID_ARGUMENT,
                plugin + ": initial_scale " + std::to_string(c.initial_scale) +
                    " lies outside [min_scale, max_scale]; change one of the three");
  }
  return c;
}

// Writes the scaler's state as checkpoint metadata `key` ("scale clean_steps overflows_left"),
// so a resumed run continues bit for bit.
inline void SaveLossScalerState(const LossScaler& scaler, cai_checkpoint* ckpt, const char* key) {
  cai_loss_scaler_state state{};
  state.struct_size = CAI_LOSS_SCALER_STATE_STRUCT_SIZE;
  Check(Host().optimizer->loss_scaler_get_state(scaler.get(), &state));
  char text[128];
  std::snprintf(text, sizeof text, "%.17g %lld %lld", state.scale,
                static_cast<long long>(state.clean_steps),
                static_cast<long long>(state.overflows_left));
  Check(Host().checkpoint->write_meta(ckpt, key, text));
}

inline void LoadLossScalerState(LossScaler& scaler, cai_checkpoint* ckpt, const char* key) {
  const char* text = nullptr;
  Check(Host().checkpoint->read_meta(ckpt, key, &text));
  cai_loss_scaler_state state{};
  state.struct_size = CAI_LOSS_SCALER_STATE_STRUCT_SIZE;
  long long clean = 0, left = 0;
  if (std::sscanf(text, "%lf %lld %lld", &state.scale, &clean, &left) != 3) {
    throw Error(CAI_DATA_LOSS, std::string("checkpoint meta ") + key + " is '" + text +
                                   "', expected 'scale clean_steps overflows_left'");
  }
  state.clean_steps = clean;
  state.overflows_left = left;
  Check(Host().optimizer->loss_scaler_set_state(scaler.get(), &state));
}

// ---- Entry point --------------------------------------------------------------------------

namespace detail {

// A copy of an argument struct with the fields the caller did not send zeroed.
template <class S>
S Normalised(const S* in) {
  S out{};
  if (in) std::memcpy(&out, in, in->struct_size < sizeof(S) ? in->struct_size : sizeof(S));
  out.struct_size = sizeof(S);
  return out;
}

// Copies an out struct back, never beyond the caller's struct_size, keeping its header.
template <class S>
void CopyOut(S* dst, const S& src) {
  constexpr size_t kHeader = sizeof(size_t) + sizeof(cai_extension_base*);
  const size_t limit = dst->struct_size < sizeof(S) ? dst->struct_size : sizeof(S);
  if (limit > kHeader) {
    std::memcpy(reinterpret_cast<char*>(dst) + kHeader,
                reinterpret_cast<const char*>(&src) + kHeader, limit - kHeader);
  }
}

template <class S, class F>
cai_status* WithArgs(const S* args, F&& fn) noexcept {
  if (!args) return MakeStatus(CAI_INVALID_ARGUMENT, "argument struct is NULL");
  return Guard([&] { fn(Normalised(args)); });
}

template <class S, class F>
cai_status* WithOut(S* out, F&& fn) noexcept {
  if (!out) return MakeStatus(CAI_INVALID_ARGUMENT, "result struct is NULL");
  return Guard([&] {
    S full{};
    full.struct_size = sizeof(S);
    fn(full);
    CopyOut(out, full);
  });
}

template <class T>
T* Self(cai_strategy* s) {
  return reinterpret_cast<T*>(s);
}

template <class T>
cai_plugin_api MakeTable() {
  static const std::span<const cai_config_key> keys = T::ConfigKeys();
  cai_plugin_api api{};
  api.struct_size = CAI_PLUGIN_API_STRUCT_SIZE;
  api.name = T::kName;
  api.version = T::kVersion;
  api.capabilities = T::kCapabilities;
  api.config_keys = keys.data();
  api.num_config_keys = keys.size();
  api.create = [](const cai_create_args* args, cai_strategy** out) -> cai_status* {
    if (!out) return MakeStatus(CAI_INVALID_ARGUMENT, "create: out is NULL");
    return WithArgs(
        args, [&](const cai_create_args& a) { *out = reinterpret_cast<cai_strategy*>(new T(a)); });
  };
  api.destroy = [](cai_strategy* s) { delete Self<T>(s); };
  api.boost = [](cai_strategy* s, const cai_boost_args* args) {
    return WithArgs(args, [&](const cai_boost_args& a) { Self<T>(s)->Boost(a); });
  };
  api.forward_backward = [](cai_strategy* s, const cai_micro_batch* batch) {
    return WithArgs(batch, [&](const cai_micro_batch& b) { Self<T>(s)->ForwardBackward(b); });
  };
  if constexpr (requires(T t, const cai_pipeline_args& a) { t.ExecutePipeline(a); }) {
    api.execute_pipeline = [](cai_strategy* s, const cai_pipeline_args* args) {
      return WithArgs(args, [&](const cai_pipeline_args& a) { Self<T>(s)->ExecutePipeline(a); });
    };
  }
  if constexpr (requires(T t) { t.NoSync(true); }) {
    api.no_sync = [](cai_strategy* s, bool enabled) {
      return Guard([&] { Self<T>(s)->NoSync(enabled); });
    };
  }
  api.step = [](cai_strategy* s, cai_step_result* out) {
    return WithOut(out, [&](cai_step_result& r) { Self<T>(s)->Step(r); });
  };
  api.zero_grad = [](cai_strategy* s) { return Guard([&] { Self<T>(s)->ZeroGrad(); }); };
  api.save = [](cai_strategy* s, const cai_checkpoint_args* args) {
    return WithArgs(args, [&](const cai_checkpoint_args& a) { Self<T>(s)->Save(a); });
  };
  api.load = [](cai_strategy* s, const cai_checkpoint_args* args) {
    return WithArgs(args, [&](const cai_checkpoint_args& a) { Self<T>(s)->Load(a); });
  };
  api.stats = [](cai_strategy* s, cai_strategy_stats* out) {
    return WithOut(out, [&](cai_strategy_stats& r) { Self<T>(s)->Stats(r); });
  };
#if CAI_ABI_MINOR >= 1
  if constexpr (requires(const cai_memory_estimate_args& a, cai_memory_estimate& e) {
                  T::EstimateMemory(a, e);
                }) {
    api.estimate_memory = [](const cai_memory_estimate_args* args, cai_memory_estimate* out) {
      if (!out) return MakeStatus(CAI_INVALID_ARGUMENT, "estimate_memory: out is NULL");
      return WithArgs(args, [&](const cai_memory_estimate_args& a) {
        cai_memory_estimate full{};
        full.struct_size = sizeof full;
        T::EstimateMemory(a, full);
        CopyOut(out, full);
      });
    };
  }
  if constexpr (requires(T t, const cai_micro_batch& b) { t.Evaluate(b); }) {
    api.evaluate = [](cai_strategy* s, const cai_micro_batch* batch) {
      return WithArgs(batch, [&](const cai_micro_batch& b) { Self<T>(s)->Evaluate(b); });
    };
  }
#endif
#if CAI_ABI_MINOR >= 3
  if constexpr (requires(T t, cai_parallel_layout & l) { t.ParallelLayout(l); }) {
    api.parallel_layout = [](cai_strategy* s, cai_parallel_layout* out) {
      return WithOut(out, [&](cai_parallel_layout& l) { Self<T>(s)->ParallelLayout(l); });
    };
  }
#endif
  return api;
}

template <class T>
cai_status* Init(cai_plugin_init_args* args) noexcept {
  // Without a usable host table there is no way to create a status: leave the outputs unset,
  // which the host reports as a refused negotiation.
  if (!args || args->struct_size < CAI_PLUGIN_INIT_ARGS_STRUCT_SIZE || !args->host ||
      args->host->struct_size < CAI_STRUCT_SIZE(cai_host_api, status_message)) {
    return nullptr;
  }
  const cai_host_api* host = args->host;
  auto refuse = [&](const std::string& why) {
    return host->status_create(CAI_FAILED_PRECONDITION, why.data(), why.size());
  };
  const std::string built = std::to_string(CAI_ABI_MAJOR) + "." + std::to_string(CAI_ABI_MINOR);
  if (args->host_abi_major != CAI_ABI_MAJOR) {
    return refuse(std::string(T::kName) + " is built for cai ABI " + built + "; the host speaks " +
                  std::to_string(args->host_abi_major) + "." +
                  std::to_string(args->host_abi_minor));
  }
  if (args->host_abi_minor < CAI_TARGET_ABI_MINOR) {
    return refuse(std::string(T::kName) + " needs host ABI " + std::to_string(CAI_ABI_MAJOR) + "." +
                  std::to_string(CAI_TARGET_ABI_MINOR) + " or newer; the host is " +
                  std::to_string(args->host_abi_major) + "." +
                  std::to_string(args->host_abi_minor));
  }
  HostSlot() = host;
  PluginNameSlot() = T::kName;
  return Guard([&] {
    PluginDirSlot() = args->plugin_dir ? args->plugin_dir : "";
    static const cai_plugin_api table = MakeTable<T>();
    args->plugin_abi_minor = CAI_ABI_MINOR;
    args->plugin_min_host_minor = CAI_TARGET_ABI_MINOR;
    args->plugin = &table;
  });
}

}  // namespace detail
}  // namespace cai::sdk

// Defines the plugin's single exported symbol for strategy class T.
#define CAI_PLUGIN(T)                                                                \
  extern "C" CAI_EXPORT cai_status* cai_plugin_init_v1(cai_plugin_init_args* args) { \
    return ::cai::sdk::detail::Init<T>(args);                                        \
  }

#endif  // CAI_SDK_HPP_
