// The cai_model_api table: argument checks and cai::Guard around Model. Torch-free.
#include <algorithm>
#include <cstddef>
#include <cstring>
#include <string>

#include "core/status.h"
#include "model/model.h"

namespace cai {
namespace {

Model* Get(cai_model* handle, const char* function) {
  if (handle == nullptr)
    throw Error(CAI_INVALID_ARGUMENT, std::string(function) + ": model is NULL");
  return reinterpret_cast<Model*>(handle);
}
const Model* Get(const cai_model* handle, const char* function) {
  return Get(const_cast<cai_model*>(handle), function);
}

void NotNull(const void* pointer, const char* function, const char* argument) {
  if (pointer == nullptr) {
    throw Error(CAI_INVALID_ARGUMENT, std::string(function) + ": " + argument + " is NULL");
  }
}

// Copies what both sides know into a caller's out-struct, never beyond its struct_size (an
// older caller's struct is smaller), keeping its extension chain; struct_size then says how
// much was filled.
template <class S>
void WriteOut(const S& value, S* out) {
  constexpr size_t kHeader = offsetof(S, extension_start) + sizeof(cai_extension_base*);
  const size_t size = std::min(out->struct_size, value.struct_size);
  std::memcpy(reinterpret_cast<char*>(out) + kHeader,
              reinterpret_cast<const char*>(&value) + kHeader, size - kHeader);
  out->struct_size = size;
}

double OrOne(double v) { return v == 0.0 ? 1.0 : v; }

Activation* FromHandle(cai_activation* handle) { return reinterpret_cast<Activation*>(handle); }

uint32_t NumParams(const cai_model* model) {
  return model ? reinterpret_cast<const Model*>(model)->NumParams() : 0;
}

cai_status* ParamInfo(const cai_model* model, uint32_t index, cai_param_info* out) {
  return Guard([&] {
    const Model* m = Get(model, "param_info");
    RequireStructSize(out, CAI_STRUCT_SIZE(cai_param_info, parallel_dim), "param_info: out");
    WriteOut(m->ParamInfo(index), out);
  });
}

uint32_t NumUnits(const cai_model* model) {
  return model ? reinterpret_cast<const Model*>(model)->NumUnits() : 0;
}

cai_status* UnitInfo(const cai_model* model, uint32_t index, cai_unit_info* out) {
  return Guard([&] {
    const Model* m = Get(model, "unit_info");
    RequireStructSize(out, CAI_STRUCT_SIZE(cai_unit_info, numel), "unit_info: out");
    WriteOut(m->UnitInfo(index), out);
  });
}

const char* Describe(const cai_model* model) {
  return model ? reinterpret_cast<const Model*>(model)->Describe() : "";
}

cai_status* ParamData(cai_model* model, uint32_t index, cai_tensor* out) {
  return Guard([&] {
    Model* m = Get(model, "param_data");
    NotNull(out, "param_data", "out");
    *out = m->ParamData(index);
  });
}

cai_status* ParamGrad(cai_model* model, uint32_t index, cai_tensor* out) {
  return Guard([&] {
    Model* m = Get(model, "param_grad");
    NotNull(out, "param_grad", "out");
    *out = m->ParamGrad(index);
  });
}

uint32_t NumBuffers(const cai_model* model) {
  return model ? reinterpret_cast<const Model*>(model)->NumBuffers() : 0;
}

cai_status* BufferData(cai_model* model, uint32_t index, cai_tensor* out) {
  return Guard([&] {
    Model* m = Get(model, "buffer_data");
    NotNull(out, "buffer_data", "out");
    *out = m->BufferData(index);
  });
}

cai_status* ReplaceParamStorage(cai_model* model, uint32_t index, const cai_tensor* storage) {
  return Guard([&] {
    Model* m = Get(model, "replace_param_storage");
    NotNull(storage, "replace_param_storage", "storage");
    m->ReplaceParamStorage(index, *storage);
  });
}

cai_status* ReleaseParamStorage(cai_model* model, uint32_t index) {
  return Guard([&] { Get(model, "release_param_storage")->ReleaseParamStorage(index); });
}

cai_status* MaterializeParamStorage(cai_model* model, uint32_t index, cai_tensor* out) {
  return Guard([&] {
    Model* m = Get(model, "materialize_param_storage");
    NotNull(out, "materialize_param_storage", "out");
    *out = m->MaterializeParamStorage(index);
  });
}

cai_status* ReplaceGradStorage(cai_model* model, uint32_t index, const cai_tensor* storage) {
  return Guard([&] {
    Model* m = Get(model, "replace_grad_storage");
    NotNull(storage, "replace_grad_storage", "storage");
    m->ReplaceGradStorage(index, *storage);
  });
}

cai_status* ReleaseGrad(cai_model* model, uint32_t index) {
  return Guard([&] { Get(model, "release_grad")->ReleaseGrad(index); });
}

cai_status* ZeroGrad(cai_model* model, bool set_to_none) {
  return Guard([&] { Get(model, "zero_grad")->ZeroGrad(set_to_none); });
}

cai_status* RegisterHook(cai_model* model, const cai_hook_args* args, uint64_t* id) {
  return Guard([&] {
    Model* m = Get(model, "register_hook");
    RequireStructSize(args, CAI_STRUCT_SIZE(cai_hook_args, user_data), "register_hook: args");
    NotNull(id, "register_hook", "id");
    NotNull(reinterpret_cast<const void*>(args->fn), "register_hook", "args->fn");
    const cai_hook_fn fn = args->fn;
    void* user_data = args->user_data;
    *id = m->AddHook(
        args->kind, args->unit, args->param,
        [fn, user_data](const cai_hook_event& event) { ThrowIfError(fn(user_data, &event)); });
  });
}

cai_status* RemoveHook(cai_model* model, uint64_t id) {
  return Guard([&] { Get(model, "remove_hook")->RemoveHook(id); });
}

cai_status* ForwardBackward(cai_model* model, const cai_forward_backward_args* args) {
  return Guard([&] {
    Model* m = Get(model, "forward_backward");
    RequireStructSize(args, CAI_STRUCT_SIZE(cai_forward_backward_args, loss),
                      "forward_backward: args");
    NotNull(args->tokens, "forward_backward", "args->tokens");
    NotNull(args->targets, "forward_backward", "args->targets");
    const double loss = m->ForwardBackward(*args->tokens, *args->targets, args->backward,
                                           OrOne(args->loss_scale), OrOne(args->loss_weight));
    if (args->loss != nullptr) *args->loss = loss;
  });
}

cai_status* StageForward(cai_model* model, const cai_stage_forward_args* args) {
  return Guard([&] {
    Model* m = Get(model, "stage_forward");
    RequireStructSize(args, CAI_STRUCT_SIZE(cai_stage_forward_args, loss), "stage_forward: args");
    const bool is_last = args->last_unit == static_cast<int32_t>(m->NumUnits());
    if (!is_last) NotNull(args->output, "stage_forward", "args->output (non-last stage)");
    const bool no_grad = CAI_HAS_FIELD(args, cai_stage_forward_args, no_grad) && args->no_grad;
    const bool split =
        CAI_HAS_FIELD(args, cai_stage_forward_args, split_backward) && args->split_backward;
    Model::StageResult result = m->StageForward(args->first_unit, args->last_unit, args->tokens,
                                                args->targets, args->input, no_grad, split);
    if (args->output != nullptr) {
      *args->output = reinterpret_cast<cai_activation*>(result.output.release());
    }
    if (args->loss != nullptr && is_last) *args->loss = result.loss;
  });
}

cai_status* StageBackward(cai_model* model, const cai_stage_backward_args* args) {
  return Guard([&] {
    Model* m = Get(model, "stage_backward");
    RequireStructSize(args, CAI_STRUCT_SIZE(cai_stage_backward_args, loss_scale),
                      "stage_backward: args");
    m->StageBackward(FromHandle(args->activation), args->micro_batch, args->grad_output,
                     args->grad_input, OrOne(args->loss_scale));
  });
}

cai_status* StageBackwardWeights(cai_model* model, const cai_stage_backward_weights_args* args) {
  return Guard([&] {
    Model* m = Get(model, "stage_backward_weights");
    RequireStructSize(args, CAI_STRUCT_SIZE(cai_stage_backward_weights_args, micro_batch),
                      "stage_backward_weights: args");
    m->StageBackwardWeights(FromHandle(args->activation), args->micro_batch);
  });
}

void ActivationRelease(cai_activation* activation) { ActivationDeleter()(FromHandle(activation)); }

cai_status* ActivationData(cai_activation* activation, cai_tensor* out) {
  return Guard([&] {
    NotNull(activation, "activation_data", "activation");
    NotNull(out, "activation_data", "out");
    *out = Model::ActivationData(*FromHandle(activation));
  });
}

cai_status* SetComputeDtype(cai_model* model, cai_dtype dtype) {
  return Guard([&] { Get(model, "set_compute_dtype")->SetComputeDtype(dtype); });
}

cai_status* SetBufferDtype(cai_model* model, cai_dtype dtype) {
  return Guard([&] { Get(model, "set_buffer_dtype")->SetBufferDtype(dtype); });
}

cai_status* SetActivationCheckpointing(cai_model* model, bool enabled) {
  return Guard(
      [&] { Get(model, "set_activation_checkpointing")->SetActivationCheckpointing(enabled); });
}

cai_status* ApplyTensorParallel(cai_model* model, const cai_tensor_parallel_args* args) {
  return Guard([&] {
    Model* m = Get(model, "apply_tensor_parallel");
    RequireStructSize(args, CAI_STRUCT_SIZE(cai_tensor_parallel_args, sequence_parallel),
                      "apply_tensor_parallel: args");
    TensorParallelOptions options;
    options.sequence_parallel = args->sequence_parallel;
    if (CAI_HAS_FIELD(args, cai_tensor_parallel_args, vocab_divisible_by)) {
      if (args->vocab_divisible_by < 0) {
        throw Error(CAI_INVALID_ARGUMENT,
                    "apply_tensor_parallel: vocab_divisible_by must be >= 0, got " +
                        std::to_string(args->vocab_divisible_by));
      }
      options.vocab_divisible_by = std::max<int64_t>(1, args->vocab_divisible_by);
    }
    if (CAI_HAS_FIELD(args, cai_tensor_parallel_args, gather_output)) {
      options.gather_output = args->gather_output;
    }
    if (CAI_HAS_FIELD(args, cai_tensor_parallel_args, sequence_parallel_ring)) {
      options.ring = args->sequence_parallel_ring;
      if (options.ring && !options.sequence_parallel) {
        throw Error(CAI_INVALID_ARGUMENT,
                    "apply_tensor_parallel: sequence_parallel_ring overlaps sequence "
                    "parallelism's gathers and reduce-scatters; set sequence_parallel too");
      }
    }
    m->ApplyTensorParallel(args->group, options);
  });
}

cai_status* ApplySequenceParallel(cai_model* model, const cai_sequence_parallel_args* args) {
  return Guard([&] {
    Model* m = Get(model, "apply_sequence_parallel");
    RequireStructSize(args, CAI_SEQUENCE_PARALLEL_ARGS_STRUCT_SIZE,
                      "apply_sequence_parallel: args");
    m->ApplySequenceParallel(args->group, args->mode);
  });
}

cai_status* EnableKernels(cai_model* model, uint64_t kernels) {
  return Guard([&] { Get(model, "enable_kernels")->EnableKernels(kernels); });
}

cai_status* SetUnitCheckpointing(cai_model* model, uint32_t unit, bool enabled) {
  return Guard([&] { Get(model, "set_unit_checkpointing")->SetUnitCheckpointing(unit, enabled); });
}

constexpr cai_model_api kModelApi = {
    CAI_MODEL_API_STRUCT_SIZE,
    nullptr,
    NumParams,
    ParamInfo,
    NumUnits,
    UnitInfo,
    Describe,
    ParamData,
    ParamGrad,
    NumBuffers,
    BufferData,
    ReplaceParamStorage,
    ReleaseParamStorage,
    MaterializeParamStorage,
    ReplaceGradStorage,
    ReleaseGrad,
    ZeroGrad,
    RegisterHook,
    RemoveHook,
    ForwardBackward,
    StageForward,
    StageBackward,
    ActivationRelease,
    ActivationData,
    SetComputeDtype,
    SetActivationCheckpointing,
    ApplyTensorParallel,
    SetBufferDtype,
    EnableKernels,
    SetUnitCheckpointing,
    ApplySequenceParallel,
    StageBackwardWeights,
};

}  // namespace

cai_model* AsHandle(Model* model) { return reinterpret_cast<cai_model*>(model); }

const cai_model_api* ModelApi() { return &kModelApi; }

}  // namespace cai
