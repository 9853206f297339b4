// cai SDK: parameters, gradients and optimizer state as flat pool buffers.
//
// A FlatLayout places model parameters end to end (with optional padding); every flat buffer
// a strategy keeps for them (fp32 weights, 16-bit copies, gradients, optimizer state slots) is
// laid out alike, so one offset finds a parameter in all of them and one fused optimizer call
// updates any run of them. The model computes on views of such a buffer
// (replace_param_storage), and .grad can accumulate straight into one (replace_grad_storage).
//
// Canonical checkpoint layout (docs/checkpoint-layout.md): "model/<name>" holds a parameter's
// weights as fp32 in its shape, "optim/<name>/<slot>" optimizer state slot k as flat fp32.
// Every strategy that writes it can be resumed by any other.
#ifndef CAI_SDK_FLAT_HPP_
#define CAI_SDK_FLAT_HPP_

#include <algorithm>
#include <span>
#include <string>
#include <vector>

#include "cai/sdk.hpp"

namespace cai::sdk {

inline constexpr cai_dtype kFloat32{CAI_DTYPE_FLOAT, 32, 1};

// A parameter's place in a flat layout.
struct FlatSlot {
  uint32_t param;  // model parameter index
  uint32_t group;  // optimizer parameter group
  int64_t numel;
  size_t offset;  // elements into the flat buffers
  std::vector<int64_t> shape;
  std::string name;
};

class FlatLayout {
 public:
  // Appends model parameter `param` after everything added so far.
  void Add(const cai_model* model, uint32_t param) {
    const cai_param_info info = ParamInfo(model, param);
    if (slot_of_.size() <= param) slot_of_.resize(param + 1, -1);
    slot_of_[param] = static_cast<int32_t>(slots_.size());
    slots_.push_back({param, info.group, info.numel, numel_,
                      std::vector<int64_t>(info.shape, info.shape + info.ndim), info.name});
    numel_ += static_cast<size_t>(info.numel);
  }
  // Leaves `elements` unused elements (zero in every buffer) after the last parameter.
  void Pad(size_t elements) { numel_ += elements; }

  size_t numel() const { return numel_; }  // parameters and padding
  size_t size() const { return slots_.size(); }
  bool empty() const { return slots_.empty(); }
  const FlatSlot& operator[](size_t i) const { return slots_[i]; }
  const std::vector<FlatSlot>& slots() const { return slots_; }
  // Slot index of model parameter `param`, or -1 when the layout does not hold it.
  int32_t SlotOf(uint32_t param) const { return param < slot_of_.size() ? slot_of_[param] : -1; }
  // Slot i's elements in `buffer`, a flat buffer of this layout holding `dtype` elements. The
  // descriptor stays valid while the layout and the buffer live.
  cai_tensor View(const Buffer& buffer, cai_dtype dtype, size_t i) const {
    return FlatView(buffer, dtype, slots_[i].offset, const_cast<int64_t*>(&slots_[i].numel));
  }

 private:
  std::vector<FlatSlot> slots_;
  std::vector<int32_t> slot_of_;
  size_t numel_ = 0;
};

// Calls fn(offset, count, group) for each maximal run of consecutive slots of one optimizer
// group, skipping the slots whose `include` flag is zero (all slots when `include` is empty):
// the pieces one fused update each can take.
template <class F>
void ForEachGroupRun(const FlatLayout& layout, std::span<const uint8_t> include, F&& fn) {
  auto included = [&](size_t i) { return include.empty() || include[i] != 0; };
  for (size_t first = 0; first < layout.size();) {
    if (!included(first)) {
      ++first;
      continue;
    }
    size_t last = first + 1;
    while (last < layout.size() && included(last) && layout[last].group == layout[first].group) {
      ++last;
    }
    const size_t offset = layout[first].offset;
    fn(offset, layout[last - 1].offset + static_cast<size_t>(layout[last - 1].numel) - offset,
       layout[first].group);
    first = last;
  }
}

// A zero-filled pool buffer of `numel` elements of `dtype` (at least one byte).
inline Buffer AllocFlat(cai_mem_tier tier, size_t numel, cai_dtype dtype, const char* tag) {
  return Buffer::Alloc(tier, std::max<size_t>(numel * ElementSize(dtype), 1), tag,
                       /*zero_fill=*/true);
}

// Refuses a model whose parameters are not fp32: strategies keep fp32 weights (or masters)
// and cast to train.precision themselves.
inline void RequireFp32Params(const cai_model* model, const char* strategy) {
  for (uint32_t i = 0; i < Host().model->num_params(model); ++i) {
    const cai_param_info info = ParamInfo(model, i);
    if (info.tied_to < 0 && !SameDtype(info.dtype, kFloat32)) {
      throw Error(CAI_FAILED_PRECONDITION,
                  std::string(strategy) + ": parameter '" + info.name + "' is not fp32 at boost; " +
                      strategy +
                      " keeps fp32 weights and casts them to train.precision itself, so save "
                      "the model in fp32");
    }
  }
}

// Copies every slot's current values from the model into `buffer` (cast to `dtype`).
inline void CopyParamsInto(cai_model* model, const FlatLayout& layout, const Buffer& buffer,
                           cai_dtype dtype) {
  for (size_t i = 0; i < layout.size(); ++i) {
    cai_tensor data{};
    Check(Host().model->param_data(model, layout[i].param, &data));
    RunKernel(CAI_KERNEL_COPY, &data, layout.View(buffer, dtype, i));
  }
}

// Copies parameter `param`'s values into `out` and releases the model's storage of it: a
// strategy taking the model into its own shards this way, one parameter at a time, never holds
// it whole (under model.init_device = "lazy" the read draws the parameter, so no rank ever
// does).
inline void MoveParamInto(cai_model* model, uint32_t param, const cai_tensor& out) {
  cai_tensor data{};
  Check(Host().model->param_data(model, param, &data));
  RunKernel(CAI_KERNEL_COPY, &data, out);
  Check(Host().model->release_param_storage(model, param));
}

// The model's parameters become views of `buffer` (which must hold the model's dtype for
// them); the strategy keeps `buffer` alive and its size unchanged while the model uses them.
inline void PointParamsAt(cai_model* model, const FlatLayout& layout, const Buffer& buffer,
                          cai_dtype dtype) {
  for (size_t i = 0; i < layout.size(); ++i) {
    cai_tensor view = layout.View(buffer, dtype, i);
    Check(Host().model->replace_param_storage(model, layout[i].param, &view));
  }
}

// Gradients accumulate straight into `buffer` (PyTorch DDP's gradient_as_bucket_view).
inline void PointGradsAt(cai_model* model, const FlatLayout& layout, const Buffer& buffer,
                         cai_dtype dtype) {
  for (size_t i = 0; i < layout.size(); ++i) {
    cai_tensor view = layout.View(buffer, dtype, i);
    Check(Host().model->replace_grad_storage(model, layout[i].param, &view));
  }
}

// How a parameter's checkpoint tensors are written and read. This one takes them as they are;
// TensorParallelIo (cai/sdk/tensor_parallel.hpp) converts between a rank's slice and the
// canonical tensor. `flat` holds the parameter's local values (all of them); a non-empty
// `shape` writes "model/<name>" in the parameter's shape, an empty one flat
// ("optim/<name>/<k>"). Read fills `dst` with elements [offset, offset + count) of the
// parameter's local flat values (count 0 = all), converting the dtype.
class ParamIo {
 public:
  virtual ~ParamIo() = default;
  virtual void Write(cai_checkpoint* ckpt, const std::string& name, uint32_t /*param*/,
                     const cai_tensor& flat, std::span<const int64_t> shape) const {
    if (shape.empty()) {
      Check(Host().checkpoint->write_tensor(ckpt, name.c_str(), &flat));
    } else {
      WriteAsFp32(ckpt, name, flat, shape);
    }
  }
  virtual void Read(cai_checkpoint* ckpt, const std::string& name, uint32_t /*param*/,
                    int64_t offset, int64_t count, const cai_tensor& dst) const {
    cai_tensor t = dst;
    Check(Host().checkpoint->read_tensor(ckpt, name.c_str(), offset, count, &t));
  }
};
inline const ParamIo& DirectIo() {
  static const ParamIo io;
  return io;
}

// Name of optimizer state slot `slot` of parameter `param` in the canonical layout.
inline std::string OptimStateName(const std::string& param, uint32_t slot) {
  return "optim/" + param + "/" + std::to_string(slot);
}

// The optimizer state of a flat range of `numel` fp32 parameters: one fp32 buffer per state
// slot (2 for Adam, 1 for SGD with momentum), laid out like the parameters, and the host's
// fused update over any piece of it.
class FlatOptimizer {
 public:
  // One piece to update: elements [offset, offset + count) of the range, all of one group.
  // `param` (fp32) and `grad` point at the piece's first element; `lowp`, when set, receives
  // the updated values in `lowp_dtype` (the 16-bit copy the model computes with).
  struct Piece {
    uint32_t group = 0;
    size_t offset = 0;
    size_t count = 0;
    float* param = nullptr;
    const void* grad = nullptr;
    cai_dtype grad_dtype = kFloat32;
    void* lowp = nullptr;
    cai_dtype lowp_dtype = kFloat32;
  };

  FlatOptimizer() = default;
  FlatOptimizer(cai_optimizer* optimizer, size_t numel, cai_mem_tier tier, const char* tag)
      : optimizer_(optimizer) {
    for (uint32_t k = 0; k < MaxStateSlots(optimizer); ++k) {
      state_.push_back(AllocFlat(tier, numel, kFloat32, tag));
    }
    // The fused update runs where the pool keeps this tier: the CPU, or the accelerator.
    Buffer probe = state_.empty() ? AllocFlat(tier, 1, kFloat32, tag) : Buffer();
    int64_t one = 1;
    device_ = FlatView(state_.empty() ? probe : state_[0], kFloat32, 0, &one).device;
  }

  // Applies the optimizer step `step` (1-based) of the piece's group, with the gradient
  // multiplied by `grad_scale` first (1/loss_scale times the clip coefficient).
  void Update(const Piece& p, int64_t step, double grad_scale) const {
    float* states[4] = {};  // cai_optim_update_args.state's size
    for (uint32_t k = 0; k < StateSlots(optimizer_, p.group); ++k) {
      states[k] = static_cast<float*>(state_[k].data()) + p.offset;
    }
    Update(optimizer_, device_, p, states, step, grad_scale);
  }
  // The same with the piece's state slots at `states[k]` (p.offset unused) on `device`: for
  // state kept elsewhere and staged for the update (an unmapped NVMe buffer's).
  static void Update(cai_optimizer* optimizer, cai_device device, const Piece& p,
                     float* const* states, int64_t step, double grad_scale) {
    if (p.count == 0) return;
    cai_optim_update_args u{};
    u.struct_size = CAI_OPTIM_UPDATE_ARGS_STRUCT_SIZE;
    u.optimizer = optimizer;
    u.group = p.group;
    u.param = p.param;
    u.grad = p.grad;
    u.grad_dtype = p.grad_dtype;
    for (uint32_t k = 0; k < StateSlots(optimizer, p.group); ++k) u.state[k] = states[k];
    u.param_lowp = p.lowp;
    u.param_lowp_dtype = p.lowp_dtype;
    u.numel = p.count;
    u.step = step;
    u.lr = Host().optimizer->lr_at(optimizer, p.group, step);
    u.grad_scale = grad_scale;
    u.device = device;
    Check(Host().optimizer->update(&u));
  }

  size_t num_slots() const { return state_.size(); }
  // State slots group `group` uses (fewer than num_slots() for SGD beside Adam groups).
  uint32_t SlotsOf(uint32_t group) const { return StateSlots(optimizer_, group); }
  const Buffer& state(size_t k) const { return state_[k]; }
  // Elements [offset, offset + *count) of slot k.
  cai_tensor View(size_t k, size_t offset, const int64_t* count) const {
    return FlatView(state_[k], kFloat32, offset, const_cast<int64_t*>(count));
  }
  uint64_t bytes() const {
    uint64_t b = 0;
    for (const Buffer& s : state_) b += s.size();
    return b;
  }

 private:
  cai_optimizer* optimizer_ = nullptr;
  std::vector<Buffer> state_;
  cai_device device_{CAI_DEVICE_CPU, 0};
};

// Frozen parameters are model state too: every rank keeps them whole, and the canonical
// layout holds them as "model/<name>" fp32 (whatever they compute in). Save on one rank.
inline void SaveFrozenParams(cai_model* model, cai_checkpoint* ckpt) {
  for (uint32_t p : OwnedParams(model, /*trainable=*/false)) {
    cai_tensor data{};
    Check(Host().model->param_data(model, p, &data));
    WriteAsFp32(ckpt, "model/" + std::string(ParamInfo(model, p).name), data);
  }
}
inline void LoadFrozenParams(cai_model* model, cai_checkpoint* ckpt) {
  for (uint32_t p : OwnedParams(model, /*trainable=*/false)) {
    cai_tensor data{};
    Check(Host().model->param_data(model, p, &data));
    const std::string name = "model/" + std::string(ParamInfo(model, p).name);
    Check(Host().checkpoint->read_tensor(ckpt, name.c_str(), 0, 0, &data));
  }
}
inline uint64_t FrozenParamBytes(const cai_model* model) {
  uint64_t bytes = 0;
  for (uint32_t p : OwnedParams(model, /*trainable=*/false)) {
    const cai_param_info info = ParamInfo(model, p);
    bytes += static_cast<uint64_t>(info.numel) * ElementSize(info.dtype);
  }
  return bytes;
}

// Saves the canonical layout of a replicated flat model: every slot's fp32 `weights` as
// "model/<name>" in its shape, every frozen parameter as "model/<name>", and the optimizer
// state as "optim/<name>/<k>". Call it on one rank (the others hold the same values).
inline void SaveFlatReplica(cai_model* model, const cai_checkpoint_args& args,
                            const FlatLayout& layout, const Buffer& weights,
                            const FlatOptimizer& optim) {
  if (args.model) {
    for (size_t i = 0; i < layout.size(); ++i) {
      WriteAsFp32(args.checkpoint, "model/" + layout[i].name, layout.View(weights, kFloat32, i),
                  layout[i].shape);
    }
    SaveFrozenParams(model, args.checkpoint);
  }
  if (args.optimizer) {
    for (size_t i = 0; i < layout.size(); ++i) {
      for (uint32_t k = 0; k < optim.SlotsOf(layout[i].group); ++k) {
        cai_tensor t = optim.View(k, layout[i].offset, &layout[i].numel);
        Check(Host().checkpoint->write_tensor(args.checkpoint,
                                              OptimStateName(layout[i].name, k).c_str(), &t));
      }
    }
  }
}

// Reads what SaveFlatReplica wrote (or any strategy's canonical checkpoint) on every rank.
inline void LoadFlatReplica(cai_model* model, const cai_checkpoint_args& args,
                            const FlatLayout& layout, const Buffer& weights,
                            const FlatOptimizer& optim) {
  const cai_checkpoint_api& ckpt = *Host().checkpoint;
  if (args.model) {
    for (size_t i = 0; i < layout.size(); ++i) {
      cai_tensor t = layout.View(weights, kFloat32, i);
      Check(ckpt.read_tensor(args.checkpoint, ("model/" + layout[i].name).c_str(), 0, 0, &t));
    }
    LoadFrozenParams(model, args.checkpoint);
  }
  if (args.optimizer) {
    for (size_t i = 0; i < layout.size(); ++i) {
      for (uint32_t k = 0; k < optim.SlotsOf(layout[i].group); ++k) {
        cai_tensor t = optim.View(k, layout[i].offset, &layout[i].numel);
        Check(
            ckpt.read_tensor(args.checkpoint, OptimStateName(layout[i].name, k).c_str(), 0, 0, &t));
      }
    }
  }
}

// A whole fp32 replica of the model's trainable parameters in flat buffers the model works on
// directly: the parameters are views of `weights`, their .grad views of `grads`, plus the
// optimizer state. What a replicated strategy (plain data parallelism, local SGD) keeps.
// As in torch.optim, a parameter that got no gradient since the last ZeroGrad is not updated
// (a GRAD_READY hook records which did; AgreeOnUsed makes that "on any rank of the group").
// Memory: (4 + 4 + 4k)Ψ for Ψ trainable elements and k optimizer state slots.
// Not movable: the hook holds its address.
class FlatReplica {
 public:
  FlatReplica(cai_model* model, cai_optimizer* optimizer) : model_(model) {
    RequireFp32Params(model, PluginNameSlot());
    for (uint32_t p : OwnedParams(model, /*trainable=*/true)) layout_.Add(model, p);
    numel_ = static_cast<int64_t>(layout_.numel());
    weights_ = AllocFlat(CAI_MEM_DEVICE, layout_.numel(), kFloat32, "replica.param");
    grads_ = AllocFlat(CAI_MEM_DEVICE, layout_.numel(), kFloat32, "replica.grad");
    CopyParamsInto(model, layout_, weights_, kFloat32);
    PointParamsAt(model, layout_, weights_, kFloat32);
    PointGradsAt(model, layout_, grads_, kFloat32);
    optim_ = FlatOptimizer(optimizer, layout_.numel(), CAI_MEM_DEVICE, "replica.optim_state");
    used_.assign(layout_.size(), 0);
    hook_id_ = OnEveryGradReady(model, &FlatReplica::OnGradReady, this);
  }
  FlatReplica(const FlatReplica&) = delete;
  FlatReplica& operator=(const FlatReplica&) = delete;
  ~FlatReplica() { Host().status_destroy(Host().model->remove_hook(model_, hook_id_)); }

  const FlatLayout& layout() const { return layout_; }
  cai_tensor weights() const { return FlatView(weights_, kFloat32, 0, &numel_); }
  cai_tensor grads() const { return FlatView(grads_, kFloat32, 0, &numel_); }
  cai_tensor state(size_t k) const { return optim_.View(k, 0, &numel_); }
  size_t num_state_slots() const { return optim_.num_slots(); }
  double GradSumSquares() const {
    double sq = 0;
    RunKernel(CAI_KERNEL_SUM_SQUARES, nullptr, grads(), 0, &sq);
    return sq;
  }
  // Whether each slot got a gradient since ZeroGrad: on this rank, or, after AgreeOnUsed, on
  // any rank of `group` (collective).
  const std::vector<uint8_t>& used() const { return used_; }
  void AgreeOnUsed(cai_comm_group* group = nullptr) {
    std::vector<double> flags(used_.begin(), used_.end());
    if (flags.empty() || Host().comm->size(group) == 1) return;
    constexpr cai_dtype kF64{CAI_DTYPE_FLOAT, 64, 1};
    Buffer wire = AllocFlat(CAI_MEM_DEVICE, flags.size(), kF64, "replica.used");
    Check(Host().mempool->copy(wire.data(), flags.data(), wire.size(), nullptr));
    int64_t n = static_cast<int64_t>(flags.size());
    RunCollective(CAI_COMM_ALL_REDUCE, nullptr, FlatView(wire, kF64, 0, &n), false, CAI_REDUCE_MAX,
                  group);
    Check(Host().mempool->copy(flags.data(), wire.data(), wire.size(), nullptr));
    for (size_t i = 0; i < used_.size(); ++i) used_[i] = flags[i] > 0;
  }
  // The fused update at optimizer step `step` of every used parameter, gradients times
  // grad_scale.
  void Update(int64_t step, double grad_scale) const {
    ForEachGroupRun(layout_, used_, [&](size_t at, size_t count, uint32_t group) {
      optim_.Update({group, at, count, static_cast<float*>(weights_.data()) + at,
                     static_cast<float*>(grads_.data()) + at},
                    step, grad_scale);
    });
  }
  void ZeroGrad() {
    RunKernel(CAI_KERNEL_FILL, nullptr, grads(), 0);
    std::fill(used_.begin(), used_.end(), 0);
  }
  // The canonical layout; save on one rank, load on every rank.
  void Save(const cai_checkpoint_args& args) const {
    SaveFlatReplica(model_, args, layout_, weights_, optim_);
  }
  void Load(const cai_checkpoint_args& args) const {
    LoadFlatReplica(model_, args, layout_, weights_, optim_);
  }
  void AddStats(cai_strategy_stats& stats) const {
    stats.param_bytes += weights_.size() + FrozenParamBytes(model_);
    stats.grad_bytes += grads_.size();
    stats.optimizer_state_bytes += optim_.bytes();
  }

 private:
  static cai_status* OnGradReady(void* self, const cai_hook_event* event) {
    auto* r = static_cast<FlatReplica*>(self);
    const int32_t slot = event->param < 0 ? -1 : r->layout_.SlotOf(event->param);
    if (slot >= 0) r->used_[slot] = 1;
    return nullptr;
  }

  cai_model* model_ = nullptr;
  FlatLayout layout_;
  int64_t numel_ = 0;
  Buffer weights_, grads_;
  FlatOptimizer optim_;
  std::vector<uint8_t> used_;
  uint64_t hook_id_ = 0;
};

}  // namespace cai::sdk

#endif  // CAI_SDK_FLAT_HPP_
