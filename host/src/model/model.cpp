// Model: a Network plus what strategies need around it — metadata, hooks, FSDP-style storage
// release, gradient storage, activation checkpointing, pipeline stages and the loss.
#include "model/model.h"

#include <algorithm>
#include <map>
#include <optional>
#include <unordered_map>
#include <utility>

#include "comm/comm_api.h"
#include "core/status.h"
#include "model/framework_allocator.h"
#include "model/network.h"
#include "model/torch_compat.h"
#include "model/weight_grad.h"

namespace cai {
namespace {

[[noreturn]] void Fail(cai_status_code code, const std::string& message) {
  throw Error(code, message);
}

torch::ScalarType ToScalarType(cai_dtype d, const char* what) {
  if (d.lanes == 1) {
    if (d.code == CAI_DTYPE_FLOAT && d.bits == 32) return torch::kFloat;
    if (d.code == CAI_DTYPE_FLOAT && d.bits == 16) return torch::kHalf;
    if (d.code == CAI_DTYPE_FLOAT && d.bits == 64) return torch::kDouble;
    if (d.code == CAI_DTYPE_BFLOAT && d.bits == 16) return torch::kBFloat16;
    if (d.code == CAI_DTYPE_INT && d.bits == 64) return torch::kLong;
    if (d.code == CAI_DTYPE_INT && d.bits == 32) return torch::kInt;
    if (d.code == CAI_DTYPE_UINT && d.bits == 8) return torch::kByte;
    if (d.code == CAI_DTYPE_BOOL && d.bits == 8) return torch::kBool;
  }
  Fail(CAI_INVALID_ARGUMENT, std::string(what) + ": unsupported dtype {code " +
                                 std::to_string(d.code) + ", bits " + std::to_string(d.bits) +
                                 ", lanes " + std::to_string(d.lanes) + "}");
}

cai_dtype ToDtype(torch::ScalarType t) {
  switch (t) {
    case torch::kFloat:
      return {CAI_DTYPE_FLOAT, 32, 1};
    case torch::kHalf:
      return {CAI_DTYPE_FLOAT, 16, 1};
    case torch::kDouble:
      return {CAI_DTYPE_FLOAT, 64, 1};
    case torch::kBFloat16:
      return {CAI_DTYPE_BFLOAT, 16, 1};
    case torch::kLong:
      return {CAI_DTYPE_INT, 64, 1};
    case torch::kInt:
      return {CAI_DTYPE_INT, 32, 1};
    case torch::kByte:
      return {CAI_DTYPE_UINT, 8, 1};
    case torch::kBool:
      return {CAI_DTYPE_BOOL, 8, 1};
    default:
      Fail(CAI_INTERNAL, std::string("no cai dtype for ") + c10::toString(t));
  }
}

bool IsFloatingStorage(torch::ScalarType t) {
  return t == torch::kFloat || t == torch::kBFloat16 || t == torch::kHalf;
}

// A tensor over the caller's memory (no copy). CUDA_HOST (pinned) memory is CPU memory.
torch::Tensor ViewOf(const cai_tensor& d, const char* what) {
  if (d.ndim < 0 || (d.ndim > 0 && (d.shape == nullptr || d.strides == nullptr))) {
    Fail(CAI_INVALID_ARGUMENT, std::string(what) + ": ndim " + std::to_string(d.ndim) +
                                   " needs non-NULL shape and strides");
  }
  torch::Device device = torch::kCPU;
  if (d.device.device_type == CAI_DEVICE_CUDA) {
    device = torch::Device(torch::kCUDA, static_cast<c10::DeviceIndex>(d.device.device_id));
  } else if (d.device.device_type != CAI_DEVICE_CPU &&
             d.device.device_type != CAI_DEVICE_CUDA_HOST) {
    Fail(CAI_INVALID_ARGUMENT,
         std::string(what) + ": unsupported device type " + std::to_string(d.device.device_type));
  }
  std::vector<int64_t> shape(d.shape, d.shape + d.ndim), strides(d.strides, d.strides + d.ndim);
  const torch::ScalarType type = ToScalarType(d.dtype, what);
  int64_t numel = 1;
  for (int64_t s : shape) numel *= s;
  if (numel > 0 && d.data == nullptr)
    Fail(CAI_INVALID_ARGUMENT, std::string(what) + ": data is NULL");
  return torch::from_blob(static_cast<char*>(d.data) + d.byte_offset, shape, strides,
                          torch::TensorOptions().dtype(type).device(device));
}

// Shape and strides a descriptor points at; kept by whoever hands the descriptor out.
struct DescribedShape {
  std::vector<int64_t> shape, strides;
};

cai_tensor DescribeTensor(const torch::Tensor& t, DescribedShape& keep) {
  keep.shape = t.sizes().vec();
  keep.strides = t.strides().vec();
  cai_tensor out{};
  out.data = t.data_ptr();
  out.device =
      t.is_cuda() ? cai_device{CAI_DEVICE_CUDA, t.device().index()} : cai_device{CAI_DEVICE_CPU, 0};
  out.ndim = static_cast<int32_t>(t.dim());
  out.dtype = ToDtype(t.scalar_type());
  out.shape = keep.shape.data();
  out.strides = keep.strides.data();
  out.byte_offset = 0;
  return out;
}

}  // namespace

// A stage's forward, kept until its backward.
class Activation {
 public:
  int32_t first = 0, last = 0;
  torch::Tensor input;   // the stage's input leaf (stages after the first), for grad_input
  torch::Tensor output;  // hidden states with history (non-last stages)
  torch::Tensor loss;    // last stage
  std::vector<char> input_needs_grad;  // per unit in [first, last)
  bool no_grad = false;                // forward only: nothing to back-propagate
  DescribedShape described;
  // Split backward: the blocks' deferred weight gradients, filled by stage_backward and
  // emptied by stage_backward_weights. The queue's address is in the graph, so it never moves.
  std::unique_ptr<WeightGradQueue> weight_grads;
  bool weights_done = false;
  Model::Impl* owner = nullptr;
  bool AwaitsWeights() const { return weight_grads && !weights_done && !weight_grads->empty(); }
};

void Network::ApplyTensorParallel(TensorParallelGroup, const TensorParallelOptions&) {
  throw Error(CAI_UNIMPLEMENTED,
              "apply_tensor_parallel: this model (" + Describe() +
                  ") has no structure to split: tensor parallelism needs a zoo model "
                  "(model.kind = \"gpt2\" or \"llama\")");
}

void Network::ApplySequenceParallel(TensorParallelGroup, int32_t) {
  throw Error(CAI_UNIMPLEMENTED,
              "apply_sequence_parallel: this model (" + Describe() +
                  ") has no sequence to split between its layers: sequence parallelism needs a "
                  "zoo model (model.kind = \"gpt2\" or \"llama\")");
}

void Network::EnableKernels(uint64_t kernels) {
  if (kernels == 0) return;
  throw Error(CAI_UNIMPLEMENTED, "enable_kernels: this model (" + Describe() +
                                     ") has no optional kernels: they are the zoo models' "
                                     "(model.kind = \"gpt2\" or \"llama\")");
}

torch::Tensor Network::CrossEntropy(const torch::Tensor& logits, const torch::Tensor& targets,
                                    int64_t ignore_index) const {
  return torch::nn::functional::cross_entropy(
      logits.to(torch::kFloat), targets,
      torch::nn::functional::CrossEntropyFuncOptions().ignore_index(ignore_index));
}

struct Model::Impl {
  struct Param {
    ParamSpec* spec = nullptr;
    std::vector<int64_t> shape;
    bool released = false;
    // Lazily initialised and not yet read (released too): the first read draws its values.
    bool pending_init = false;
    // Data or .grad point at memory a strategy handed in (replace_*_storage), not the model's.
    bool foreign_data = false, foreign_grad = false;
    std::shared_ptr<torch::autograd::Node> accumulator;  // keeps the GRAD_READY hook alive
    DescribedShape data_view, grad_view;
  };
  struct Unit {
    std::vector<uint32_t> params;  // held by this unit
    std::vector<uint32_t> reads;   // held by other units, read by this unit's forward
    int trainable = 0;
    int64_t numel = 0;
  };
  struct HookEntry {
    uint64_t id;
    cai_hook_kind kind;
    int32_t unit, param;
    Hook fn;
  };

  std::unique_ptr<Network> net;
  std::vector<Param> params;
  // Each parameter's index by its tensor, which keeps its identity for the model's lifetime
  // (storage and dtype change in place): how a deferred weight gradient finds its parameter.
  std::unordered_map<const c10::TensorImpl*, uint32_t> param_index;
  std::vector<Unit> units;
  std::vector<DescribedShape> buffer_views;
  std::string description;
  std::vector<HookEntry> hooks;
  uint64_t next_hook_id = 1;
  std::vector<char> checkpointed;  // per unit: recompute its forward in backward

  // Backward bookkeeping: a unit is active while a backward over it runs; pending counts
  // what POST_BACKWARD still waits for (trainable parameters, input gradient).
  std::vector<char> active;
  std::vector<int> pending;
  // The first hook error of the current call; autograd may wrap what a hook throws, so the
  // entry points rethrow this one.
  std::optional<Error> hook_error;

  std::map<int32_t, std::unique_ptr<Activation>> last_stage;  // by micro-batch number
  // Last stages back-propagated with their weight gradients still deferred (split backward).
  std::map<int32_t, std::unique_ptr<Activation>> last_stage_weights;
  int32_t next_micro_batch = 0;
  // An activation went with its deferred weight gradients never computed: this step's
  // gradients lack them, so every call fails until ZeroGrad.
  bool lost_weight_grads = false;

  explicit Impl(std::unique_ptr<Network> network) : net(std::move(network)) {
    units.resize(net->units.size());
    for (size_t i = 0; i < net->params.size(); ++i) {
      ParamSpec& spec = net->params[i];
      Param param;
      param.spec = &spec;
      param.shape = spec.tensor.sizes().vec();
      param.pending_init = spec.init && torch_compat::StorageReleased(spec.tensor);
      param.released = param.pending_init;
      params.push_back(std::move(param));
      param_index[spec.tensor.unsafeGetTensorImpl()] = static_cast<uint32_t>(i);
      if (spec.unit >= 0) {
        Unit& u = units[spec.unit];
        u.params.push_back(static_cast<uint32_t>(i));
        u.numel += spec.tensor.numel();
        u.trainable += spec.tensor.requires_grad() ? 1 : 0;
      }
    }
    for (size_t u = 0; u < units.size(); ++u) {
      for (uint32_t i : net->units[u].reads) {
        if (net->params[i].unit != static_cast<int32_t>(u)) units[u].reads.push_back(i);
      }
      std::sort(units[u].reads.begin(), units[u].reads.end());
    }
    buffer_views.resize(net->buffers.size());
    active.assign(units.size(), 0);
    pending.assign(units.size(), 0);
    checkpointed.assign(units.size(), 0);
    int64_t numel = 0;
    for (const Param& p : params) numel += p.spec->tensor.numel();
    description = net->Describe() + " params=" + std::to_string(numel);
  }

  torch::Tensor& T(uint32_t index) { return params[index].spec->tensor; }
  torch::Device device() const {
    return params.empty() ? torch::Device(torch::kCPU) : params[0].spec->tensor.device();
  }

  void CheckParam(uint32_t index, const char* function) const {
    if (index >= params.size()) {
      Fail(CAI_INVALID_ARGUMENT, std::string(function) + ": parameter index " +
                                     std::to_string(index) + " out of range (the model has " +
                                     std::to_string(params.size()) + " parameters)");
    }
  }
  std::string ParamName(uint32_t index) const {
    return "parameter " + std::to_string(index) + " '" + params[index].spec->name + "'";
  }

  // ---- Hooks -------------------------------------------------------------------------------

  // Runs matching hooks in registration order. A failure is remembered for the entry point
  // (autograd may rewrap it on its way out) and rethrown.
  void Fire(cai_hook_kind kind, int32_t unit, int32_t param, bool recompute) {
    const cai_hook_event event{CAI_HOOK_EVENT_STRUCT_SIZE, nullptr, kind, unit, param, recompute};
    std::vector<Hook> matching;
    for (const HookEntry& h : hooks) {
      if (h.kind != kind) continue;
      if (kind == CAI_HOOK_GRAD_READY ? (h.param != -1 && h.param != param)
                                      : (h.unit != -1 && h.unit != unit)) {
        continue;
      }
      matching.push_back(h.fn);
    }
    try {
      for (const Hook& fn : matching) fn(event);
    } catch (const Error& e) {
      if (!hook_error) hook_error = e;
      throw;
    } catch (const std::exception& e) {
      if (!hook_error) hook_error = Error(CAI_UNKNOWN, std::string("hook: ") + e.what());
      throw;
    }
  }

  // Draws a lazily initialised parameter's initial values into new storage of its dtype.
  void InitPending(uint32_t index) {
    Param& p = params[index];
    if (!p.pending_init) return;
    const torch::Tensor& t = T(index);
    torch_compat::MaterializeStorage(t, (t.storage_offset() + t.numel()) * t.element_size());
    torch::NoGradGuard no_grad;
    if (t.scalar_type() == torch::kFloat) {
      p.spec->init(t);
    } else {  // set_compute_dtype came first: draw in fp32, as an eager model would have
      torch::Tensor values = torch::empty(p.shape, torch::kFloat);
      p.spec->init(values);
      t.copy_(values);
    }
    p.pending_init = false;
    p.released = false;
  }

  void CheckMaterialized(size_t unit, const char* phase) {
    for (uint32_t i : net->units[unit].reads) {
      InitPending(i);
      if (params[i].released) {
        Fail(CAI_FAILED_PRECONDITION,
             ParamName(i) + " is released but unit '" + net->units[unit].name + "' needs it for " +
                 phase + "; materialize it (e.g. in a PRE_" +
                 (std::string(phase) == "forward" ? "FORWARD" : "BACKWARD") + " hook)");
      }
    }
  }

  // Hooks each trainable parameter's gradient accumulator once; casting a parameter to
  // another dtype makes autograd create a new accumulator, so this runs before every forward.
  void EnsureGradReadyHooks() {
    for (uint32_t i = 0; i < params.size(); ++i) {
      const torch::Tensor& t = T(i);
      if (!t.requires_grad()) continue;
      std::shared_ptr<torch::autograd::Node> acc = torch_compat::GradAccumulator(t);
      if (acc == params[i].accumulator) continue;
      torch_compat::AddPostAccumulateHook(*acc, [this, i] { OnGradReady(i); });
      params[i].accumulator = std::move(acc);
    }
  }

  void OnGradReady(uint32_t index) {
    Fire(CAI_HOOK_GRAD_READY, -1, static_cast<int32_t>(index), false);
    const int32_t unit = params[index].spec->unit;
    if (unit >= 0) CountDown(unit);
  }
  void OnOutputGrad(size_t unit) {
    // Backward reaches the units last to first: what it allocates from here is this unit's.
    AllocationSite::Set("backward", static_cast<int32_t>(unit), &net->units[unit].name);
    Fire(CAI_HOOK_PRE_BACKWARD, static_cast<int32_t>(unit), -1, false);
    CheckMaterialized(unit, "backward");
    if (active[unit] && pending[unit] == 0) FinishUnit(unit);
  }
  void CountDown(size_t unit) {
    if (active[unit] && pending[unit] > 0 && --pending[unit] == 0) FinishUnit(unit);
  }
  void FinishUnit(size_t unit) {
    active[unit] = 0;
    Fire(CAI_HOOK_POST_BACKWARD, static_cast<int32_t>(unit), -1, false);
  }

  // ---- Execution ---------------------------------------------------------------------------

  // Runs units [first, last) on x, with the boundary hooks that drive the backward unit hooks:
  // a view of each unit's input whose gradient marks the unit's input done, and the unit's
  // output whose gradient fires PRE_BACKWARD. With `defer`, the blocks' projections leave their
  // weight gradients to it (split backward).
  torch::Tensor RunUnits(int32_t first, int32_t last, torch::Tensor x,
                         std::vector<char>& input_needs_grad, WeightGradQueue* defer = nullptr) {
    const bool grad = torch::GradMode::is_enabled();
    input_needs_grad.assign(last - first, 0);
    for (int32_t u = first; u < last; ++u) {
      AllocationSite site("forward", u, &net->units[u].name);
      Fire(CAI_HOOK_PRE_FORWARD, u, -1, false);
      CheckMaterialized(u, "forward");
      const bool track_input = grad && x.requires_grad();
      input_needs_grad[u - first] = track_input;
      if (track_input) {
        x = x.view_as(x);
        x.register_hook([this, u](const torch::Tensor&) { CountDown(u); });
      }
      // Checkpointing needs an input that requires grad: a reentrant recompute is reached
      // only through it (PyTorch's reentrant checkpoint has the same rule).
      const bool checkpoint = checkpointed[u] && track_input;
      // Only blocks defer: the head's projection is the tied embedding on GPT-2, whose
      // gradient must be whole when the embedding's backward reports it.
      DeferWeightGrads scope(net->units[u].kind == CAI_UNIT_BLOCK ? defer : nullptr);
      torch::Tensor y = checkpoint ? Checkpoint(u, x) : net->Forward(u, x);
      if (grad && y.requires_grad()) {
        y.register_hook([this, u](const torch::Tensor&) { OnOutputGrad(u); });
      }
      Fire(CAI_HOOK_POST_FORWARD, u, -1, false);
      x = y;
    }
    return x;
  }

  torch::Tensor Checkpoint(int32_t unit, const torch::Tensor& x);

  // Recomputation of a checkpointed unit inside backward.
  torch::Tensor Recompute(int32_t unit, const torch::Tensor& x) {
    AllocationSite site("the recomputed forward (activation checkpointing)", unit,
                        &net->units[unit].name);
    Fire(CAI_HOOK_PRE_FORWARD, unit, -1, true);
    CheckMaterialized(unit, "forward");
    torch::Tensor y = net->Forward(unit, x);
    Fire(CAI_HOOK_POST_FORWARD, unit, -1, true);
    return y;
  }

  // Back-propagates with the unit hooks of [first, last) armed.
  template <class F>
  void Backward(int32_t first, int32_t last, const std::vector<char>& input_needs_grad, F run) {
    for (int32_t u = first; u < last; ++u) {
      active[u] = 1;
      pending[u] = units[u].trainable + input_needs_grad[u - first];
    }
    struct Disarm {
      Impl* impl;
      ~Disarm() { impl->active.assign(impl->active.size(), 0); }
    } disarm{this};
    AllocationSite site("backward");
    run();
  }

  void CheckNoLostWeightGrads(const char* function) const {
    if (!lost_weight_grads) return;
    Fail(CAI_FAILED_PRECONDITION,
         std::string(function) +
             ": an activation whose forward was split (split_backward) was released before "
             "stage_backward_weights computed its weight gradients, so this step's gradients "
             "are incomplete; call zero_grad to start the step again");
  }

  // The weight pass of a split backward over units [first, last): each deferred projection's
  // dW (and db) accumulates into the parameter's gradient as autograd would, GRAD_READY fires
  // once a parameter's last deferred contribution is in, and POST_BACKWARD once a unit's are
  // (its stage_backward left them pending).
  void ComputeDeferredWeights(int32_t first, int32_t last, const WeightGradQueue& queue) {
    auto index_of = [&](const torch::Tensor& p) { return param_index.at(p.unsafeGetTensorImpl()); };
    std::map<uint32_t, int> remaining;  // by parameter
    auto each = [&](auto&& visit) {
      for (const DeferredLinear& item : queue) {
        if (item.weight.defined()) visit(item, item.weight, true);
        if (item.bias.defined()) visit(item, item.bias, false);
      }
    };
    each([&](const DeferredLinear&, const torch::Tensor& p, bool) { ++remaining[index_of(p)]; });
    for (int32_t u = first; u < last; ++u) {
      active[u] = 0;
      pending[u] = 0;
    }
    for (const auto& [index, count] : remaining) {
      const int32_t unit = params[index].spec->unit;
      if (unit >= first && unit < last) {
        active[unit] = 1;
        ++pending[unit];
      }
    }
    struct Disarm {
      Impl* impl;
      ~Disarm() { impl->active.assign(impl->active.size(), 0); }
    } disarm{this};
    torch::NoGradGuard no_grad;
    each([&](const DeferredLinear& item, const torch::Tensor& p, bool is_weight) {
      const uint32_t index = index_of(p);
      AllocationSite site("the weight-gradient pass (split backward)", params[index].spec->unit,
                          &net->units[params[index].spec->unit].name);
      torch::Tensor g = is_weight ? WeightGradient(item) : BiasGradient(item);
      torch::Tensor& grad = T(index).mutable_grad();
      if (grad.defined()) {
        grad.add_(g);
      } else {
        grad = std::move(g);
      }
      if (--remaining[index] == 0) OnGradReady(index);
    });
  }

  // Runs an entry point; a hook's error wins over however autograd rewrapped it.
  template <class F>
  auto Guarded(F fn) -> decltype(fn()) {
    hook_error.reset();
    try {
      return fn();
    } catch (...) {
      if (hook_error) {
        Error e = *hook_error;
        hook_error.reset();
        throw e;
      }
      throw;
    }
  }

  torch::Tensor Tokens(const cai_tensor& d, const char* what) {
    torch::Tensor view = ViewOf(d, what);
    if (view.scalar_type() != torch::kLong || view.dim() != 2) {
      Fail(CAI_INVALID_ARGUMENT, std::string(what) + " must be int64 [batch, seq]");
    }
    if (net->n_ctx > 0 && view.size(1) > net->n_ctx) {
      Fail(CAI_INVALID_ARGUMENT, std::string(what) + ": sequence length " +
                                     std::to_string(view.size(1)) + " exceeds n_ctx " +
                                     std::to_string(net->n_ctx));
    }
    // A copy: the caller's memory is borrowed for this call only, autograd keeps the indices.
    return view.to(device(), torch::kLong, /*non_blocking=*/false, /*copy=*/true);
  }

  void CheckRange(const torch::Tensor& t, int64_t low, const char* what) const {
    if (net->vocab_size <= 0 || t.numel() == 0) return;
    const int64_t lo = t.min().item<int64_t>(), hi = t.max().item<int64_t>();
    if (lo < low || hi >= net->vocab_size) {
      Fail(CAI_INVALID_ARGUMENT, std::string(what) + " values must lie in [" + std::to_string(low) +
                                     ", " + std::to_string(net->vocab_size) + "), found " +
                                     std::to_string(lo) + ".." + std::to_string(hi));
    }
  }

  torch::Tensor Loss(const torch::Tensor& logits, const cai_tensor* targets) {
    AllocationSite site("the loss (cross-entropy over the logits)");
    if (targets == nullptr) Fail(CAI_INVALID_ARGUMENT, "targets is NULL");
    torch::Tensor t = net->LocalTargets(Tokens(*targets, "targets"));
    if (t.sizes() != logits.sizes().slice(0, 2)) {
      Fail(CAI_INVALID_ARGUMENT, "targets must have the tokens' shape [batch, seq]");
    }
    // Both the configured ignore_index (PyTorch's -100 by default) and the ABI's -1 are
    // ignored: cross_entropy takes one value, so -1 becomes ignore_index first.
    const int64_t ignore = net->ignore_index;
    const torch::Tensor skipped = t.eq(ignore).logical_or(t.eq(-1));
    const std::string what = "targets other than " + std::to_string(ignore) +
                             " (model.ignore_index)" + (ignore != -1 ? " and -1" : "");
    CheckRange(t.masked_select(skipped.logical_not()), 0, what.c_str());
    if (ignore != -1) t = t.masked_fill(t.eq(-1), ignore);
    return net->CrossEntropy(logits.reshape({-1, logits.size(-1)}), t.reshape({-1}), ignore);
  }
};

// Reentrant activation checkpointing (Chen et al. 2016, "Training deep nets with sublinear
// memory cost"; PyTorch's use_reentrant=True): forward without saving activations, and in
// backward recompute the unit with grad enabled and back-propagate through the recomputation.
struct CheckpointFunction : torch::autograd::Function<CheckpointFunction> {
  static torch::Tensor forward(torch::autograd::AutogradContext* ctx, torch::Tensor x,
                               Model::Impl* impl, int64_t unit) {
    ctx->save_for_backward({x});
    // The context stores IValues; the model outlives every graph it builds.
    ctx->saved_data["impl"] = static_cast<int64_t>(reinterpret_cast<intptr_t>(impl));
    ctx->saved_data["unit"] = unit;
    // The recomputation defers weight gradients where the forward would have.
    ctx->saved_data["defer"] =
        static_cast<int64_t>(reinterpret_cast<intptr_t>(DeferWeightGrads::Current()));
    return impl->net->Forward(static_cast<size_t>(unit), x);
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grad_outputs) {
    auto* impl =
        reinterpret_cast<Model::Impl*>(static_cast<intptr_t>(ctx->saved_data["impl"].toInt()));
    const auto unit = static_cast<int32_t>(ctx->saved_data["unit"].toInt());
    torch::Tensor x = ctx->get_saved_variables()[0].detach().requires_grad_(true);
    torch::Tensor y;
    {
      torch::AutoGradMode enable(true);
      DeferWeightGrads scope(reinterpret_cast<WeightGradQueue*>(
          static_cast<intptr_t>(ctx->saved_data["defer"].toInt())));
      y = impl->Recompute(unit, x);
    }
    torch::autograd::backward({y}, {grad_outputs[0]});
    return {x.grad(), torch::Tensor(), torch::Tensor()};
  }
};

void ActivationDeleter::operator()(Activation* activation) const {
  if (activation != nullptr && activation->AwaitsWeights()) {
    activation->owner->lost_weight_grads = true;
  }
  delete activation;
}

torch::Tensor Model::Impl::Checkpoint(int32_t unit, const torch::Tensor& x) {
  return CheckpointFunction::apply(x, this, static_cast<int64_t>(unit));
}

bool GlobMatch(std::string_view pattern, std::string_view name) {
  if (pattern.empty()) return name.empty();
  if (pattern[0] == '*') {
    for (size_t i = 0; i <= name.size(); ++i) {
      if (GlobMatch(pattern.substr(1), name.substr(i))) return true;
    }
    return false;
  }
  return !name.empty() && pattern[0] == name[0] && GlobMatch(pattern.substr(1), name.substr(1));
}

namespace {

void ApplyParamOptions(Network& net, const ParamOptions& options) {
  net.ignore_index = options.ignore_index;
  for (const std::string& pattern : options.frozen) {
    bool matched = false;
    for (ParamSpec& spec : net.params) {
      if (GlobMatch(pattern, spec.name)) {
        spec.tensor.requires_grad_(false);
        matched = true;
      }
    }
    if (!matched) {
      throw Error(CAI_INVALID_ARGUMENT, "freeze pattern '" + pattern + "' matches no parameter (" +
                                            "they are named like '" + net.params.front().name +
                                            "' and '" + net.params.back().name + "')");
    }
  }
  if (options.unused_parameter) {
    const int64_t size = net.params.empty() ? 1 : net.params.back().tensor.size(-1);
    torch::Tensor unused = torch::full({size}, 0.02, torch::kFloat).requires_grad_(true);
    net.params.push_back(ParamSpec{
        "unused.weight", "unused", unused, -1, CAI_ROLE_OTHER, -1, false, {}, -1, 1, 0, {}});
  }
}

}  // namespace

std::unique_ptr<Model> MakeModel(std::unique_ptr<Network> network, const ParamOptions& options) {
  ApplyParamOptions(*network, options);
  return std::make_unique<Model>(std::make_unique<Model::Impl>(std::move(network)));
}

Model::Model(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
Model::~Model() = default;

// ---- Structure ---------------------------------------------------------------------------

uint32_t Model::NumParams() const { return static_cast<uint32_t>(impl_->params.size()); }

cai_param_info Model::ParamInfo(uint32_t index) const {
  impl_->CheckParam(index, "param_info");
  const Impl::Param& p = impl_->params[index];
  const torch::Tensor& t = p.spec->tensor;
  cai_param_info info{};
  info.struct_size = CAI_PARAM_INFO_STRUCT_SIZE;
  info.name = p.spec->name.c_str();
  info.module_path = p.spec->module_path.c_str();
  info.ndim = static_cast<int32_t>(p.shape.size());
  info.shape = p.shape.data();
  info.numel = t.numel();
  info.dtype = ToDtype(t.scalar_type());
  info.flags = (t.requires_grad() ? CAI_PARAM_REQUIRES_GRAD : 0) |
               (p.spec->is_bias ? CAI_PARAM_IS_BIAS : 0) |
               (p.released && !p.pending_init ? CAI_PARAM_RELEASED : 0);
  info.group = p.shape.size() >= 2 ? 0 : 1;
  info.tied_to = -1;
  info.unit = p.spec->unit;
  info.role = p.spec->role;
  info.parallel_dim = p.spec->parallel_dim;
  const std::vector<int64_t>& global =
      p.spec->global_shape.empty() ? p.shape : p.spec->global_shape;
  info.global_shape = global.data();
  info.tp_dim = p.spec->tp_dim;
  info.tp_blocks = p.spec->tp_blocks;
  info.tp_padded = p.spec->tp_padded;
  return info;
}

uint32_t Model::NumUnits() const { return static_cast<uint32_t>(impl_->units.size()); }

cai_unit_info Model::UnitInfo(uint32_t index) const {
  if (index >= impl_->units.size()) {
    Fail(CAI_INVALID_ARGUMENT, "unit_info: unit index " + std::to_string(index) +
                                   " out of range (the model has " +
                                   std::to_string(impl_->units.size()) + " units)");
  }
  const Impl::Unit& u = impl_->units[index];
  cai_unit_info info{};
  info.struct_size = CAI_UNIT_INFO_STRUCT_SIZE;
  info.name = impl_->net->units[index].name.c_str();
  info.kind = impl_->net->units[index].kind;
  info.num_params = static_cast<uint32_t>(u.params.size());
  info.params = u.params.data();
  info.numel = u.numel;
  info.num_reads = static_cast<uint32_t>(u.reads.size());
  info.reads = u.reads.empty() ? nullptr : u.reads.data();
  return info;
}

const char* Model::Describe() const { return impl_->description.c_str(); }

// ---- Views -------------------------------------------------------------------------------

cai_tensor Model::ParamData(uint32_t index) {
  impl_->CheckParam(index, "param_data");
  impl_->InitPending(index);
  Impl::Param& p = impl_->params[index];
  if (p.released) {
    Fail(CAI_FAILED_PRECONDITION,
         "param_data: " + impl_->ParamName(index) + " is released; materialize it first");
  }
  return DescribeTensor(p.spec->tensor, p.data_view);
}

cai_tensor Model::ParamGrad(uint32_t index) {
  impl_->CheckParam(index, "param_grad");
  Impl::Param& p = impl_->params[index];
  const torch::Tensor& grad = p.spec->tensor.grad();
  if (!grad.defined()) {
    Fail(CAI_FAILED_PRECONDITION, "param_grad: " + impl_->ParamName(index) +
                                      " has no gradient (none produced, or released)");
  }
  return DescribeTensor(grad, p.grad_view);
}

uint32_t Model::NumBuffers() const { return static_cast<uint32_t>(impl_->net->buffers.size()); }

cai_tensor Model::BufferData(uint32_t index) {
  if (index >= impl_->net->buffers.size()) {
    Fail(CAI_INVALID_ARGUMENT, "buffer_data: buffer index " + std::to_string(index) +
                                   " out of range (the model has " +
                                   std::to_string(impl_->net->buffers.size()) + " buffers)");
  }
  return DescribeTensor(impl_->net->buffers[index].second, impl_->buffer_views[index]);
}

// ---- Storage -----------------------------------------------------------------------------

void Model::ReplaceParamStorage(uint32_t index, const cai_tensor& storage) {
  impl_->CheckParam(index, "replace_param_storage");
  Impl::Param& p = impl_->params[index];
  torch::Tensor& t = p.spec->tensor;
  torch::Tensor view = ViewOf(storage, "replace_param_storage: storage");
  if (!IsFloatingStorage(view.scalar_type())) {
    Fail(CAI_INVALID_ARGUMENT, "replace_param_storage: storage for " + impl_->ParamName(index) +
                                   " must be fp32, bf16 or fp16");
  }
  if (view.numel() != t.numel() || !view.is_contiguous()) {
    Fail(CAI_INVALID_ARGUMENT, "replace_param_storage: storage for " + impl_->ParamName(index) +
                                   " must be contiguous with " + std::to_string(t.numel()) +
                                   " elements, got " + std::to_string(view.numel()));
  }
  if (p.released && view.scalar_type() == t.scalar_type() && view.device() == t.device()) {
    // Views autograd saved in forward share the released storage: refill it, do not swap it.
    torch_compat::RefillStorage(t, view.data_ptr());
    p.released = false;
    p.pending_init = false;  // the strategy's storage holds the values now
    p.foreign_data = true;
    return;
  }
  if (view.scalar_type() != t.scalar_type()) t.mutable_grad().reset();
  t.set_data(view.view(p.shape));
  p.released = false;
  p.pending_init = false;  // the strategy's storage holds the values now
  p.foreign_data = true;
}

void Model::ReleaseParamStorage(uint32_t index) {
  impl_->CheckParam(index, "release_param_storage");
  Impl::Param& p = impl_->params[index];
  p.pending_init = false;  // released before any read: nothing needs its values
  if (p.released) return;
  torch_compat::ReleaseStorage(p.spec->tensor);
  p.released = true;
  p.foreign_data = false;
}

cai_tensor Model::MaterializeParamStorage(uint32_t index) {
  impl_->CheckParam(index, "materialize_param_storage");
  impl_->InitPending(index);
  Impl::Param& p = impl_->params[index];
  const torch::Tensor& t = p.spec->tensor;
  if (p.released) {
    torch_compat::MaterializeStorage(t, (t.storage_offset() + t.numel()) * t.element_size());
    p.released = false;
    p.foreign_data = false;
  }
  return DescribeTensor(t, p.data_view);
}

void Model::ReplaceGradStorage(uint32_t index, const cai_tensor& storage) {
  impl_->CheckParam(index, "replace_grad_storage");
  Impl::Param& p = impl_->params[index];
  torch::Tensor& t = p.spec->tensor;
  if (!t.requires_grad()) {
    Fail(CAI_FAILED_PRECONDITION,
         "replace_grad_storage: " + impl_->ParamName(index) + " does not require grad");
  }
  torch::Tensor view = ViewOf(storage, "replace_grad_storage: storage");
  if (view.scalar_type() != t.scalar_type() || view.numel() != t.numel() || !view.is_contiguous() ||
      view.device() != t.device()) {
    Fail(CAI_INVALID_ARGUMENT, "replace_grad_storage: storage for " + impl_->ParamName(index) +
                                   " must be contiguous, on the parameter's device, with its " +
                                   "dtype and " + std::to_string(t.numel()) + " elements");
  }
  torch::Tensor grad = view.view(p.shape);
  // Like DDP's gradient_as_bucket_view: the buffer takes over the gradient so far.
  const torch::Tensor& old = t.grad();
  if (old.defined()) {
    grad.copy_(old);
  } else {
    grad.zero_();
  }
  t.mutable_grad() = grad;
  p.foreign_grad = true;
}

void Model::ReleaseGrad(uint32_t index) {
  impl_->CheckParam(index, "release_grad");
  impl_->T(index).mutable_grad().reset();
  impl_->params[index].foreign_grad = false;
}

void Model::DetachStrategy() {
  impl_->hooks.clear();
  for (uint32_t i = 0; i < impl_->params.size(); ++i) {
    Impl::Param& p = impl_->params[i];
    if (p.foreign_grad) impl_->T(i).mutable_grad().reset();
    if (p.foreign_data && !p.released) {
      torch_compat::ReleaseStorage(p.spec->tensor);
      p.released = true;
    }
    p.foreign_data = p.foreign_grad = false;
  }
}

void Model::ZeroGrad(bool set_to_none) {
  for (uint32_t i = 0; i < impl_->params.size(); ++i) {
    torch::Tensor& grad = impl_->T(i).mutable_grad();
    if (!grad.defined()) continue;
    if (set_to_none) {
      grad.reset();
      impl_->params[i].foreign_grad = false;
    } else {
      grad.zero_();
    }
  }
  impl_->next_micro_batch = 0;
  impl_->last_stage_weights.clear();
  impl_->lost_weight_grads = false;
}

// ---- Hooks -------------------------------------------------------------------------------

uint64_t Model::AddHook(cai_hook_kind kind, int32_t unit, int32_t param, Hook fn) {
  if (kind < CAI_HOOK_PRE_FORWARD || kind > CAI_HOOK_PRE_STEP_FORWARD) {
    Fail(CAI_INVALID_ARGUMENT, "register_hook: unknown hook kind " + std::to_string(kind));
  }
  if (unit < -1 || unit >= static_cast<int32_t>(NumUnits())) {
    Fail(CAI_INVALID_ARGUMENT, "register_hook: unit " + std::to_string(unit) +
                                   " out of range (-1 or 0.." + std::to_string(NumUnits()) + ")");
  }
  if (param < -1 || param >= static_cast<int32_t>(NumParams())) {
    Fail(CAI_INVALID_ARGUMENT, "register_hook: param " + std::to_string(param) +
                                   " out of range (-1 or 0.." + std::to_string(NumParams()) + ")");
  }
  if (!fn) Fail(CAI_INVALID_ARGUMENT, "register_hook: fn is empty");
  const uint64_t id = impl_->next_hook_id++;
  impl_->hooks.push_back({id, kind, unit, param, std::move(fn)});
  return id;
}

void Model::RemoveHook(uint64_t id) {
  auto& hooks = impl_->hooks;
  for (auto it = hooks.begin(); it != hooks.end(); ++it) {
    if (it->id == id) {
      hooks.erase(it);
      return;
    }
  }
  Fail(CAI_NOT_FOUND, "remove_hook: no hook with id " + std::to_string(id));
}

// ---- Execution ---------------------------------------------------------------------------

double Model::ForwardBackward(const cai_tensor& tokens, const cai_tensor& targets, bool backward,
                              double loss_scale, double loss_weight) {
  Impl& m = *impl_;
  m.CheckNoLostWeightGrads("forward_backward");
  return m.Guarded([&] {
    AllocationSite site("the micro-batch's inputs");
    torch::Tensor x = m.Tokens(tokens, "tokens");
    m.CheckRange(x, 0, "tokens");
    m.Fire(CAI_HOOK_PRE_STEP_FORWARD, -1, -1, false);
    torch::AutoGradMode grad_mode(backward);
    if (backward) m.EnsureGradReadyHooks();
    const auto n = static_cast<int32_t>(m.units.size());
    std::vector<char> input_needs_grad;
    torch::Tensor loss = m.Loss(m.RunUnits(0, n, x, input_needs_grad), &targets);
    const double value = loss.item<double>();
    if (backward) {
      m.Backward(0, n, input_needs_grad,
                 [&] { torch::autograd::backward({loss * (loss_scale * loss_weight)}); });
    }
    return value;
  });
}

Model::StageResult Model::StageForward(int32_t first_unit, int32_t last_unit,
                                       const cai_tensor* tokens, const cai_tensor* targets,
                                       const cai_tensor* input, bool no_grad, bool split_backward) {
  Impl& m = *impl_;
  m.CheckNoLostWeightGrads("stage_forward");
  if (no_grad && split_backward) {
    Fail(CAI_INVALID_ARGUMENT,
         "stage_forward: split_backward with no_grad: a forward-only stage has no backward to "
         "split; set one of them");
  }
  const auto n = static_cast<int32_t>(m.units.size());
  if (first_unit < 0 || first_unit >= last_unit || last_unit > n) {
    Fail(CAI_INVALID_ARGUMENT, "stage_forward: units [" + std::to_string(first_unit) + ", " +
                                   std::to_string(last_unit) +
                                   ") must be a non-empty range in [0, " + std::to_string(n) + "]");
  }
  const bool is_last = last_unit == n;
  if (is_last && !no_grad && m.last_stage.count(m.next_micro_batch)) {
    Fail(CAI_FAILED_PRECONDITION, "stage_forward: last-stage micro-batch " +
                                      std::to_string(m.next_micro_batch) +
                                      " still awaits its stage_backward");
  }
  return m.Guarded([&] {
    AllocationSite site("the stage's inputs");
    auto act = std::make_unique<Activation>();
    act->first = first_unit;
    act->last = last_unit;
    act->no_grad = no_grad;
    act->owner = &m;
    if (split_backward) act->weight_grads = std::make_unique<WeightGradQueue>();
    torch::Tensor x;
    if (first_unit == 0) {
      if (tokens == nullptr)
        Fail(CAI_INVALID_ARGUMENT, "stage_forward: the first stage needs tokens");
      x = m.Tokens(*tokens, "tokens");
      m.CheckRange(x, 0, "tokens");
      m.Fire(CAI_HOOK_PRE_STEP_FORWARD, -1, -1, false);
    } else {
      if (input == nullptr) {
        Fail(CAI_INVALID_ARGUMENT, "stage_forward: a stage after the first needs input");
      }
      torch::Tensor view = ViewOf(*input, "stage_forward: input");
      if (!IsFloatingStorage(view.scalar_type()) || view.dim() != 3) {
        Fail(CAI_INVALID_ARGUMENT, "stage_forward: input must be a float [batch, seq, hidden]");
      }
      x = view.to(m.device(), m.net->compute_type(), false, /*copy=*/true);
      if (!no_grad) {
        x.requires_grad_(true);
        act->input = x;
      }
    }
    // Evaluation builds no graph: autograd saves nothing and no gradient hook can fire.
    torch::AutoGradMode grad_mode(!no_grad);
    if (!no_grad) m.EnsureGradReadyHooks();
    torch::Tensor y =
        m.RunUnits(first_unit, last_unit, x, act->input_needs_grad, act->weight_grads.get());
    StageResult result;
    if (is_last) {
      torch::Tensor loss = m.Loss(y, targets);
      result.loss = loss.item<double>();
      if (!no_grad) {
        act->loss = loss;
        m.last_stage[m.next_micro_batch++] = std::move(act);
      }
    } else {
      act->output = y;
      result.output.reset(act.release());
    }
    return result;
  });
}

void Model::StageBackward(Activation* activation, int32_t micro_batch,
                          const cai_tensor* grad_output, const cai_tensor* grad_input,
                          double loss_scale) {
  Impl& m = *impl_;
  m.CheckNoLostWeightGrads("stage_backward");
  std::unique_ptr<Activation> owned;
  if (activation == nullptr) {
    auto it = m.last_stage.find(micro_batch);
    if (it == m.last_stage.end()) {
      Fail(CAI_NOT_FOUND, "stage_backward: no last-stage forward waits under micro_batch " +
                              std::to_string(micro_batch));
    }
    owned = std::move(it->second);
    m.last_stage.erase(it);
    activation = owned.get();
  }
  Activation& act = *activation;
  if (act.no_grad) {
    Fail(CAI_FAILED_PRECONDITION,
         "stage_backward: this activation comes from a no_grad stage_forward, which keeps no "
         "graph; run the stage's forward without no_grad to back-propagate it");
  }
  if (!act.loss.defined() && !act.output.defined()) {
    Fail(CAI_FAILED_PRECONDITION, "stage_backward: this activation was already back-propagated");
  }
  torch::Tensor grad;
  if (act.output.defined()) {
    if (grad_output == nullptr) {
      Fail(CAI_INVALID_ARGUMENT, "stage_backward: grad_output is NULL for a non-last stage");
    }
    torch::Tensor view = ViewOf(*grad_output, "stage_backward: grad_output");
    if (view.sizes() != act.output.sizes()) {
      Fail(CAI_INVALID_ARGUMENT, "stage_backward: grad_output must have the activation's shape");
    }
    // A split stage's weight pass reads this gradient after the caller's buffer has gone.
    grad = view.to(act.output.device(), act.output.scalar_type(), /*non_blocking=*/false,
                   /*copy=*/act.weight_grads != nullptr);
  }
  if (grad_input != nullptr && !act.input.defined()) {
    Fail(CAI_INVALID_ARGUMENT,
         "stage_backward: grad_input given, but the first stage's input "
         "is tokens, which have no gradient");
  }
  m.Guarded([&] {
    m.Backward(act.first, act.last, act.input_needs_grad, [&] {
      if (act.loss.defined()) {
        torch::autograd::backward({act.loss * loss_scale});
      } else {
        torch::autograd::backward({act.output}, {grad});
      }
    });
  });
  act.loss = torch::Tensor();
  act.output = torch::Tensor();
  if (grad_input != nullptr) {
    torch::Tensor out = ViewOf(*grad_input, "stage_backward: grad_input");
    if (out.sizes() != act.input.sizes()) {
      Fail(CAI_INVALID_ARGUMENT, "stage_backward: grad_input must have the stage input's shape");
    }
    const torch::Tensor& g = act.input.grad();
    if (g.defined()) {
      out.copy_(g);
    } else {
      out.zero_();
    }
  }
  act.input = torch::Tensor();
  if (owned && owned->weight_grads) m.last_stage_weights[micro_batch] = std::move(owned);
}

void Model::StageBackwardWeights(Activation* activation, int32_t micro_batch) {
  Impl& m = *impl_;
  m.CheckNoLostWeightGrads("stage_backward_weights");
  std::unique_ptr<Activation> owned;
  if (activation == nullptr) {
    auto it = m.last_stage_weights.find(micro_batch);
    if (it == m.last_stage_weights.end()) {
      Fail(m.last_stage.count(micro_batch) ? CAI_FAILED_PRECONDITION : CAI_NOT_FOUND,
           "stage_backward_weights: no last-stage micro_batch " + std::to_string(micro_batch) +
               " awaits its weight gradients" +
               (m.last_stage.count(micro_batch) ? " (run its stage_backward first)" : ""));
    }
    owned = std::move(it->second);
    m.last_stage_weights.erase(it);
    activation = owned.get();
  }
  Activation& act = *activation;
  if (!act.weight_grads) {
    Fail(CAI_FAILED_PRECONDITION,
         "stage_backward_weights: this stage's forward was not split (stage_forward's "
         "split_backward), so its stage_backward computed every gradient already");
  }
  if (act.loss.defined() || act.output.defined()) {
    Fail(CAI_FAILED_PRECONDITION,
         "stage_backward_weights: run the stage's stage_backward first; the weight gradients "
         "need the output gradients it computes");
  }
  if (act.weights_done) {
    Fail(CAI_FAILED_PRECONDITION,
         "stage_backward_weights: this stage's weight gradients were already computed");
  }
  m.Guarded([&] { m.ComputeDeferredWeights(act.first, act.last, *act.weight_grads); });
  act.weight_grads->clear();
  act.weights_done = true;
}

cai_tensor Model::ActivationData(Activation& activation) {
  if (!activation.output.defined()) {
    Fail(CAI_FAILED_PRECONDITION, "activation_data: the activation was already back-propagated");
  }
  activation.output = activation.output.contiguous();
  return DescribeTensor(activation.output, activation.described);
}

// ---- Configuration -----------------------------------------------------------------------

void Model::SetComputeDtype(cai_dtype dtype) {
  Impl& m = *impl_;
  const torch::ScalarType type = ToScalarType(dtype, "set_compute_dtype");
  if (!IsFloatingStorage(type)) {
    Fail(CAI_INVALID_ARGUMENT, "set_compute_dtype: only fp32, bf16 and fp16 are supported");
  }
  // LibTorch has no CPU fp16 kernels for matmul/LayerNorm/GELU/softmax: compute in fp32.
  const torch::ScalarType compute =
      type == torch::kHalf && !m.device().is_cuda() ? torch::kFloat : type;
  if (compute != type && !m.net->CastsToComputeType()) {
    Fail(CAI_INVALID_ARGUMENT, "set_compute_dtype: fp16 needs CUDA for this model (" +
                                   m.net->Describe() +
                                   " runs on its stored dtype and LibTorch "
                                   "has no CPU fp16 kernels)");
  }
  for (uint32_t i = 0; i < m.params.size(); ++i) {
    torch::Tensor& t = m.T(i);
    if (t.scalar_type() == type) continue;
    t.mutable_grad().reset();
    if (m.params[i].released) {
      // No values to convert: the storage materialize grows back is of the new dtype.
      t.set_data(torch_compat::UnallocatedTensor(m.params[i].shape, type));
    } else {
      t.set_data(t.detach().to(type));
    }
  }
  m.net->SetComputeType(compute);
}

void Model::SetBufferDtype(cai_dtype dtype) {
  const torch::ScalarType type = ToScalarType(dtype, "set_buffer_dtype");
  if (!IsFloatingStorage(type)) {
    Fail(CAI_INVALID_ARGUMENT, "set_buffer_dtype: only fp32, bf16 and fp16 are supported");
  }
  // In place: the TorchScript module holds the same tensor and sees the cast.
  for (auto& [name, buffer] : impl_->net->buffers) {
    if (buffer.is_floating_point() && buffer.scalar_type() != type) {
      buffer.set_data(buffer.detach().to(type));
    }
  }
}

void Model::SetActivationCheckpointing(bool enabled) {
  for (size_t u = 0; u < impl_->units.size(); ++u) {
    impl_->checkpointed[u] = enabled && impl_->net->units[u].kind == CAI_UNIT_BLOCK;
  }
}

void Model::SetUnitCheckpointing(uint32_t unit, bool enabled) {
  if (unit >= impl_->units.size() || impl_->net->units[unit].kind != CAI_UNIT_BLOCK) {
    Fail(CAI_INVALID_ARGUMENT,
         "set_unit_checkpointing: unit " + std::to_string(unit) +
             (unit < impl_->units.size() ? " ('" + impl_->net->units[unit].name + "')" : "") +
             " is not a transformer block; only blocks recompute their forward");
  }
  impl_->checkpointed[unit] = enabled;
}

void Model::EnableKernels(uint64_t kernels) { impl_->net->EnableKernels(kernels); }

namespace {

// The tag of the rings' point-to-point messages (ring attention on a sequence-parallel group,
// the ring mode's gathers and reduce-scatters on a tensor-parallel one), plus the channel;
// matched in order per pair of ranks, as every rank runs the same steps.
constexpr int32_t kRingTag = 0x52494e47;  // "RING"

// `group` of the host's communicator as the collectives a network calls; `what` names the call
// in errors. Fails unless every parameter still has the storage the model gave it.
TensorParallelGroup NetworkGroup(const Model::Impl& m, cai_comm_group* group,
                                 const std::string& what) {
  for (uint32_t i = 0; i < m.params.size(); ++i) {
    const Model::Impl::Param& p = m.params[i];
    if ((p.released && !p.pending_init) || p.foreign_data || p.foreign_grad) {
      Fail(CAI_FAILED_PRECONDITION, what + ": " + m.ParamName(i) +
                                        " has had its storage released or replaced; split the "
                                        "model first, before a strategy takes the parameters "
                                        "over");
    }
  }
  const cai_comm_api* comm = CommApi();
  TensorParallelGroup g;
  g.rank = comm->rank(group);
  g.size = comm->size(group);
  if (g.rank < 0 || g.size < 1) {
    Fail(CAI_FAILED_PRECONDITION, what +
                                      ": this rank is not in the group (or the communicator is "
                                      "not initialised)");
  }
  auto run = [comm, group](cai_comm_op op, cai_reduce_op reduce, const torch::Tensor* in,
                           const torch::Tensor& out) {
    DescribedShape keep_in, keep_out;
    cai_tensor d_out = DescribeTensor(out, keep_out);
    cai_tensor d_in = in ? DescribeTensor(*in, keep_in) : d_out;
    cai_comm_args a{};
    a.struct_size = CAI_COMM_ARGS_STRUCT_SIZE;
    a.group = group;
    a.op = op;
    a.reduce_op = reduce;
    a.input = &d_in;
    a.output = &d_out;
    ThrowIfError(comm->run(&a, nullptr));
  };
  g.all_reduce = [run](const torch::Tensor& t, cai_reduce_op op) {
    run(CAI_COMM_ALL_REDUCE, op, nullptr, t);
  };
  g.all_gather = [run](const torch::Tensor& in, const torch::Tensor& out) {
    run(CAI_COMM_ALL_GATHER, CAI_REDUCE_SUM, &in, out);
  };
  g.reduce_scatter = [run](const torch::Tensor& in, const torch::Tensor& out) {
    run(CAI_COMM_REDUCE_SCATTER, CAI_REDUCE_SUM, &in, out);
  };
  g.all_to_all = [run](const torch::Tensor& in, const torch::Tensor& out) {
    run(CAI_COMM_ALL_TO_ALL, CAI_REDUCE_SUM, &in, out);
  };
  // Both posted before either is waited for: every rank sends and receives at once, and a
  // blocking send first would wait on a peer that is itself sending.
  g.shift = [comm, group, rank = g.rank, size = g.size](const torch::Tensor& send,
                                                        const torch::Tensor& recv, int channel) {
    if (size == 1) {
      recv.copy_(send);
      return;
    }
    DescribedShape keep_send, keep_recv;
    const cai_tensor d_send = DescribeTensor(send, keep_send);
    const cai_tensor d_recv = DescribeTensor(recv, keep_recv);
    auto post = [&](cai_comm_op op, int32_t peer) {
      cai_comm_args a{};
      a.struct_size = CAI_COMM_ARGS_STRUCT_SIZE;
      a.group = group;
      a.op = op;
      a.input = &d_send;
      a.output = &d_recv;
      a.peer = peer;
      a.tag = kRingTag + channel;
      a.async = true;
      cai_comm_work* work = nullptr;
      ThrowIfError(comm->run(&a, &work));
      return std::unique_ptr<cai_comm_work, void (*)(cai_comm_work*)>(work, comm->work_release);
    };
    auto received = post(CAI_COMM_RECV, (rank - 1 + size) % size);
    auto sent = post(CAI_COMM_SEND, (rank + 1) % size);
    ThrowIfError(comm->work_wait(received.get(), 0));
    ThrowIfError(comm->work_wait(sent.get(), 0));
  };
  return g;
}

}  // namespace

void Model::ApplyTensorParallel(cai_comm_group* group, const TensorParallelOptions& options) {
  Impl& m = *impl_;
  TensorParallelGroup g = NetworkGroup(m, group, "apply_tensor_parallel");
  // The split slices the unsplit values: draw the lazy ones (each rank keeps 1/tp after).
  for (uint32_t i = 0; i < m.params.size(); ++i) m.InitPending(i);
  for (Impl::Param& p : m.params) p.spec->tensor.mutable_grad().reset();
  m.net->ApplyTensorParallel(std::move(g), options);
  for (Impl::Unit& u : m.units) u.numel = 0;
  for (Impl::Param& p : m.params) {
    p.shape = p.spec->tensor.sizes().vec();
    if (p.spec->unit >= 0) m.units[p.spec->unit].numel += p.spec->tensor.numel();
  }
}

void Model::ApplySequenceParallel(cai_comm_group* group, int32_t mode) {
  if (mode != CAI_SEQUENCE_PARALLEL_ALL_TO_ALL && mode != CAI_SEQUENCE_PARALLEL_RING_ATTN) {
    Fail(CAI_UNIMPLEMENTED, "apply_sequence_parallel: mode " + std::to_string(mode) +
                                " is not in this version; CAI_SEQUENCE_PARALLEL_ALL_TO_ALL "
                                "(DeepSpeed-Ulysses) and CAI_SEQUENCE_PARALLEL_RING_ATTN (ring "
                                "attention) are");
  }
  impl_->net->ApplySequenceParallel(NetworkGroup(*impl_, group, "apply_sequence_parallel"), mode);
}

uint64_t Model::InitPendingParams() {
  uint64_t bytes = 0;
  for (uint32_t i = 0; i < impl_->params.size(); ++i) {
    if (!impl_->params[i].pending_init) continue;
    impl_->InitPending(i);
    bytes += impl_->T(i).storage().nbytes();
  }
  return bytes;
}

uint64_t Model::ChargeOwnStorage() {
  uint64_t charged = 0;
  auto charge = [&](const torch::Tensor& t) {
    if (!t.defined() || !t.has_storage()) return;
    const c10::DataPtr& data = t.storage().data_ptr();
    if (ChargeExistingBlock(data.get(), data.get_deleter())) charged += t.storage().nbytes();
  };
  for (uint32_t i = 0; i < impl_->params.size(); ++i) {
    const Impl::Param& p = impl_->params[i];
    if (!p.released && !p.foreign_data) charge(impl_->T(i));
  }
  for (auto& [name, buffer] : impl_->net->buffers) charge(buffer);
  return charged;
}

}  // namespace cai
