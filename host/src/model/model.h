// The host's model service: the C++ model zoo (GPT-2, Llama), TorchScript models, and the
// cai_model_api table (abi/include/cai/model.h) over them. This header is torch-free; tensors
// cross it as cai_tensor descriptors, errors as cai::Error (core/status.h).
//
// Units. A zoo model has an embedding unit (0), one unit per transformer block (1..n_layer)
// and a head unit (n_layer + 1: final norm and output projection). A TorchScript model is one
// unit: its forward(tokens) -> logits is opaque, so it cannot be entered between children.
//
// Tied weights. GPT-2's output projection is the token embedding: lm_head is not a parameter
// of its own, the head unit reads `wte.weight` (index 0, unit 0), which therefore receives
// gradient from both uses. Every shared tensor is exposed once, so tied_to is -1 throughout;
// TorchScript parameters registered under several names are exposed under the first name.
//
// Parameter groups: ndim >= 2 (matrices, embeddings) -> group 0 (weight decay); biases and
// norm weights -> group 1 (nanoGPT's split).
//
// Buffers. Zoo models have none to broadcast: the Llama RoPE cos/sin tables are a pure
// function of the config (PyTorch's persistent=False), recomputed identically on every rank.
// A TorchScript model exposes its registered buffers.
//
// Hook order for one forward_backward of a zoo model with units 0..N-1 (test pinned in
// tests/host/model/model_test.cpp):
//   PRE_STEP_FORWARD
//   PRE_FORWARD(0) POST_FORWARD(0) ... PRE_FORWARD(N-1) POST_FORWARD(N-1)
//   for u = N-1 down to 0:
//     PRE_BACKWARD(u)
//     [with activation checkpointing, for blocks: PRE_FORWARD(u) POST_FORWARD(u), recompute]
//     GRAD_READY(p) for each trainable parameter p of unit u (order unspecified)
//     POST_BACKWARD(u)
// With a split backward (StageForward's split_backward), a block's projections' GRAD_READY and
// its POST_BACKWARD move from its stage's StageBackward to StageBackwardWeights.
// GRAD_READY(p) fires once per backward, after p.grad holds the sum of every use (the tied
// embedding: after the head's and the embedding's contributions). POST_BACKWARD(u) fires once
// all of u's trainable parameters are ready and the gradient of u's input is computed. Hooks
// of one kind fire in registration order. A hook that throws (or, through the ABI, returns an
// error) aborts the forward/backward, which then fails with that error; gradients accumulated
// so far stay.
//
// Compute dtype. Parameters are cast to the dtype set with SetComputeDtype (fp32, bf16, fp16)
// and the forward runs in it, except that the loss is computed in fp32. LibTorch 1.13 has no
// CPU kernels for fp16 matmul/LayerNorm/GELU/softmax, so on CPU fp16 parameters keep fp16
// storage (and fp16 gradients) while the forward computes in fp32; on CUDA fp16 computes in
// fp16.
//
// Storage follows PyTorch FSDP: ReleaseParamStorage shrinks the parameter's storage to zero
// bytes in place, so the parameter and every view autograd saved of it stay valid and see the
// memory MaterializeParamStorage grows back. A unit's forward (after its PRE_FORWARD hooks)
// and backward (after its PRE_BACKWARD hooks) fail with FAILED_PRECONDITION if a parameter it
// reads is still released. A lazily initialised parameter (ModelConfig::lazy_init) is released
// and pending until first read, which draws its initial values; param_info does not report it
// released, and releasing it before any read drops it undrawn.
//
// Thread-safety: externally synchronised, as the ABI says. Hooks run on the thread running
// forward/backward.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "cai/model.h"

namespace cai {

// Sizes of a zoo model. Zero-valued optional fields take the defaults documented on them.
struct ModelConfig {
  enum class Arch { kGpt2, kLlama };
  Arch arch = Arch::kGpt2;
  int64_t vocab_size = 50257;
  int64_t n_ctx = 1024;  // maximum sequence length
  int64_t n_layer = 12;
  int64_t n_head = 12;
  int64_t n_kv_head = 0;  // Llama grouped-query attention; 0 = n_head. GPT-2: must be 0 or n_head
  int64_t n_embd = 768;
  int64_t ffn_hidden = 0;  // 0 = 4 * n_embd (GPT-2), 256-rounded 8/3 * n_embd (Llama)
  // Only 0 is accepted: a stochastic forward could not be recomputed bit-identically under
  // activation checkpointing, nor match across ranks without shared RNG state.
  double dropout = 0.0;
  bool bias = true;             // biases in linear layers (and LayerNorm for GPT-2)
  double norm_eps = 1e-5;       // LayerNorm (GPT-2) or RMSNorm (Llama) epsilon
  double rope_theta = 10000.0;  // Llama: rotary base (HF's rope_theta)
  // Standard deviation of the normal init of matrices and embeddings (HF's initializer_range);
  // the residual projections take init_std / sqrt(2 * n_layer).
  double init_std = 0.02;
  // Allocate no parameter at build: each is drawn from its generator (the same values as
  // otherwise) when something first reads it — param_data, materialize_param_storage, a
  // forward, tensor parallelism's split — as ColossalAI's LazyInitContext. A strategy that
  // copies the parameters into its shards one at a time and releases them never holds the
  // whole model (model.init_device = "lazy").
  bool lazy_init = false;
};

// cai_tensor_parallel_args' choices beyond the group.
struct TensorParallelOptions {
  int64_t vocab_divisible_by = 1;  // the vocabulary is padded to a multiple of this × tp
  bool gather_output = false;      // all-gather the logits before the loss
  // Megatron-LM's sequence parallelism (ColossalAI's "split_gather"): between the
  // tensor-parallel regions each rank holds 1/tp of the sequence.
  bool sequence_parallel = false;
  // ColossalAI's "ring": with sequence_parallel, the gathers and reduce-scatters around the
  // projections as send/recv rings overlapping the chunks' matmuls.
  bool ring = false;
};

// A stage's output activation (owned tensor with its autograd history). Opaque.
class Activation;
struct ActivationDeleter {
  void operator()(Activation* activation) const;
};
using ActivationPtr = std::unique_ptr<Activation, ActivationDeleter>;

// A model the host owns. Every method throws cai::Error (INVALID_ARGUMENT for bad arguments,
// naming the argument; FAILED_PRECONDITION for calls in the wrong state).
class Model {
 public:
  // Called with the event; throwing aborts the forward/backward in progress.
  using Hook = std::function<void(const cai_hook_event&)>;

  struct Impl;
  explicit Model(std::unique_ptr<Impl> impl);
  ~Model();
  Model(const Model&) = delete;
  Model& operator=(const Model&) = delete;

  // Structure. Pointers in the returned structs live as long as the model. A unit's `reads`
  // are the parameters of other units its forward reads (GPT-2's head: the token embedding).
  uint32_t NumParams() const;
  cai_param_info ParamInfo(uint32_t index) const;
  uint32_t NumUnits() const;
  cai_unit_info UnitInfo(uint32_t index) const;
  const char* Describe() const;

  // Views of current data; shape/strides live until the storage is next replaced, released
  // or materialised. ParamData fails on a released parameter, ParamGrad on an undefined
  // gradient (FAILED_PRECONDITION).
  cai_tensor ParamData(uint32_t index);
  cai_tensor ParamGrad(uint32_t index);
  uint32_t NumBuffers() const;
  cai_tensor BufferData(uint32_t index);

  // Storage; see the header comment. `storage` must be contiguous with the parameter's numel,
  // in fp32, bf16 or fp16; the caller keeps it alive until the next replacement (or release:
  // replacing a released parameter with storage of its dtype refills the released storage in
  // place, which autograd's saved views share). Gradient
  // storage must match the parameter's dtype and numel; gradients then accumulate into it
  // until ReleaseGrad or ZeroGrad(true).
  void ReplaceParamStorage(uint32_t index, const cai_tensor& storage);
  void ReleaseParamStorage(uint32_t index);
  cai_tensor MaterializeParamStorage(uint32_t index);  // contents undefined
  void ReplaceGradStorage(uint32_t index, const cai_tensor& storage);
  void ReleaseGrad(uint32_t index);
  void ZeroGrad(bool set_to_none);
  // After the strategy that drove the model is destroyed: drops its hooks and every parameter
  // data or gradient that points at memory it handed in (replace_*_storage), so nothing dangles
  // into memory it freed. Those parameters are left released (zero bytes): the model runs
  // again only once a new strategy gives them storage.
  void DetachStrategy();

  // `unit` -1 = every unit (unit hooks), `param` -1 = every parameter (GRAD_READY).
  uint64_t AddHook(cai_hook_kind kind, int32_t unit, int32_t param, Hook fn);
  void RemoveHook(uint64_t id);

  // One micro-batch through the whole model: tokens and targets are int64 [batch, seq]
  // (targets equal to ParamOptions::ignore_index, or -1, are ignored). Returns the mean
  // cross-entropy; with `backward`, back-propagates loss * loss_scale * loss_weight, accumulating
  // into gradients.
  double ForwardBackward(const cai_tensor& tokens, const cai_tensor& targets, bool backward,
                         double loss_scale = 1.0, double loss_weight = 1.0);

  // Pipeline stages over units [first_unit, last_unit). The first stage takes tokens, later
  // ones `input` (copied; [batch, seq, n_embd] in any float dtype). The last stage takes
  // targets, returns the loss and no activation; its graph waits under the micro-batch number
  // stage_backward will name: last-stage forwards are numbered 0, 1, ... in call order,
  // starting again after ZeroGrad. PRE_STEP_FORWARD fires for stages with first_unit 0.
  // With `no_grad` (evaluation) no graph is built and gradients are untouched: the last stage
  // returns its loss, keeps nothing and takes no micro-batch number; a non-last stage's output
  // has no history and cannot be back-propagated. Forward hooks fire as in any forward.
  struct StageResult {
    ActivationPtr output;
    double loss = 0.0;
  };
  // With `split_backward`, the stage's StageBackward computes the input gradient and every
  // gradient but the transformer blocks' projection weights and biases, which wait for
  // StageBackwardWeights (zero-bubble schedules); the blocks' POST_BACKWARD fires there.
  StageResult StageForward(int32_t first_unit, int32_t last_unit, const cai_tensor* tokens,
                           const cai_tensor* targets, const cai_tensor* input, bool no_grad = false,
                           bool split_backward = false);
  // `activation` from StageForward (not a no_grad one), or null for the last stage's
  // `micro_batch`. Non-last stages need `grad_output` (shape of the activation); `grad_input`,
  // when given, receives the gradient of the stage's input. The activation's graph is freed
  // afterwards.
  void StageBackward(Activation* activation, int32_t micro_batch, const cai_tensor* grad_output,
                     const cai_tensor* grad_input, double loss_scale = 1.0);
  // The weight pass of a split StageForward, after its StageBackward: `activation` as there
  // (the caller keeps it until now), or null for the last stage's `micro_batch`. Releasing an
  // activation before its weight pass fails every later call until ZeroGrad.
  void StageBackwardWeights(Activation* activation, int32_t micro_batch);
  static cai_tensor ActivationData(Activation& activation);

  // fp32, bf16 or fp16 (see the header comment). Casting drops existing gradients, whose
  // dtype no longer matches. Fails while a parameter is released.
  void SetComputeDtype(cai_dtype dtype);
  // Casts the floating-point buffers to fp32, bf16 or fp16; integer and bool buffers keep
  // their dtype.
  void SetBufferDtype(cai_dtype dtype);
  // Recompute each transformer block's forward during backward instead of keeping its
  // activations; the recomputation fires the block's forward hooks with recompute = true.
  void SetActivationCheckpointing(bool enabled);
  // The same for one block (a CAI_UNIT_BLOCK unit; others are refused).
  void SetUnitCheckpointing(uint32_t unit, bool enabled);
  // Turns on the zoo's optional kernels (CAI_MODEL_KERNEL_*: memory-efficient attention, fused
  // RMSNorm, fused bias+GELU and SwiGLU); TorchScript models refuse any.
  void EnableKernels(uint64_t kernels);
  // Tensor parallelism over `group` (a communicator group; NULL = the world), as
  // cai_model_api.apply_tensor_parallel documents. Collective over the group.
  void ApplyTensorParallel(cai_comm_group* group, const TensorParallelOptions& options);
  // Sequence parallelism over `group` in `mode` (cai_sequence_parallel_mode), as
  // cai_model_api.apply_sequence_parallel documents. Collective over the group.
  void ApplySequenceParallel(cai_comm_group* group, int32_t mode);
  // Charges to the device budget (ChargeExistingBlock) the storage the model still owns: its
  // buffers and the parameters no strategy released or pointed elsewhere. For a model built
  // in host memory (model.init_device = "host"): what the strategy left in the model moves
  // to the device. Returns the bytes charged.
  uint64_t ChargeOwnStorage();
  // Draws every lazily initialised parameter no one has read or released yet (after boost:
  // what the strategy left in the model). Returns the bytes allocated.
  uint64_t InitPendingParams();

 private:
  std::unique_ptr<Impl> impl_;
};

// Choices made about a model's parameters and its loss before training starts.
struct ParamOptions {
  // Name patterns ('*' matches any run of characters) of parameters that do not train: their
  // requires_grad is cleared and strategies leave them out. A pattern that matches no
  // parameter is an error naming it (a typo would otherwise silently train everything).
  std::vector<std::string> frozen;
  // Adds "unused.weight" (1-D, n_embd or 1 element, in no unit, group 1) that requires grad
  // but that forward never reads, as models with conditional branches have: strategies must
  // finish a step without its gradient (PyTorch DDP's find_unused_parameters case).
  bool unused_parameter = false;
  // Targets equal to this value add nothing to the loss (PyTorch's CrossEntropyLoss default,
  // which Hugging Face's labels use). -1, the value the ABI documents, is ignored as well.
  int64_t ignore_index = -100;
};

// A zoo model initialised from `seed`: the same seed gives bit-identical weights in every
// process, independent of thread count (each parameter is drawn on the CPU from its own
// generator seeded by (seed, parameter index)). Init as GPT-2/nanoGPT: N(0, 0.02) for
// matrices and embeddings, N(0, 0.02 / sqrt(2 * n_layer)) for the residual projections
// (attention output, MLP down), zero biases, unit norm weights; init_std replaces 0.02.
std::unique_ptr<Model> MakeZooModel(const ModelConfig& config, uint64_t seed,
                                    const ParamOptions& options = {});

// A TorchScript module saved with torch.jit.save / torch::jit::Module::save whose
// forward(tokens int64 [B, T]) returns logits [B, T, V]. Its parameters keep the names,
// dtypes and requires_grad they were saved with. `tp_policy`, when given, is a policy file
// (README: "TorchScript models under tensor parallelism") that apply_tensor_parallel follows;
// it is read and matched against the module here.
std::unique_ptr<Model> LoadTorchScriptModel(const std::string& path,
                                            const ParamOptions& options = {},
                                            const std::string& tp_policy = "");

// The ABI view of a model. The handle is valid while the model lives.
cai_model* AsHandle(Model* model);
// The static, fully filled cai_model_api table over Model; every entry catches (cai::Guard).
const cai_model_api* ModelApi();

}  // namespace cai
