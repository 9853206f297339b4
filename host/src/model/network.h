// What Model runs: a network's parameters, its units and the forward of one unit. Zoo
// networks (zoo.cpp) and TorchScript modules (torchscript.cpp) implement it; Model (model.cpp)
// adds hooks, storage management, checkpointing, stages and the loss around it.
#pragma once

#include <torch/torch.h>

#include <functional>
#include <memory>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "cai/comm.h"
#include "cai/model.h"
#include "model/model.h"

namespace cai {

struct ParamSpec {
  std::string name;         // "blocks.0.attn.qkv.weight"
  std::string module_path;  // "blocks.0.attn.qkv"
  torch::Tensor tensor;     // a leaf; Model changes its storage in place, never the object
  int32_t unit = -1;
  cai_param_role role = CAI_ROLE_OTHER;
  int32_t parallel_dim = -1;
  bool is_bias = false;
  // Tensor parallelism (cai_param_info's tp fields): the unsplit, unpadded shape and how
  // `tensor` is cut from it. Empty global_shape: not applied, the tensor is whole.
  std::vector<int64_t> global_shape;
  int32_t tp_dim = -1;
  int32_t tp_blocks = 1;
  int64_t tp_padded = 0;
  // Draws the parameter's initial values into an fp32 tensor of its (unsplit) shape. Set by
  // the zoo; a lazily initialised model (ModelConfig::lazy_init) calls it on first read.
  std::function<void(const torch::Tensor&)> init;
};

// The group a network's tensor- or sequence-parallel forward and backward communicate over.
// The functions block; every rank of the group calls them in the same order.
struct TensorParallelGroup {
  int32_t rank = 0, size = 1;
  // In place over a contiguous tensor.
  std::function<void(const torch::Tensor&, cai_reduce_op)> all_reduce;
  // `out` (contiguous, size × input's elements) receives every rank's `in`, in rank order.
  std::function<void(const torch::Tensor& in, const torch::Tensor& out)> all_gather;
  // `out` (contiguous) receives the sum over the ranks of the rank-th of `in`'s `size` equal
  // parts (contiguous, size × out's elements).
  std::function<void(const torch::Tensor& in, const torch::Tensor& out)> reduce_scatter;
  // `out` (contiguous, as `in`) receives rank i's i-th of `in`'s `size` equal parts as its
  // i-th part.
  std::function<void(const torch::Tensor& in, const torch::Tensor& out)> all_to_all;
  // Ring attention's step: `send` (contiguous) goes to rank (rank + 1) % size while `recv`
  // (contiguous, as large) receives rank (rank − 1 + size) % size's. Messages on one `channel`
  // (a small integer) arrive in the order sent; different channels may be in flight at once,
  // from threads other than the one that calls the collectives.
  std::function<void(const torch::Tensor& send, const torch::Tensor& recv, int channel)> shift;
};

struct UnitSpec {
  std::string name;
  cai_unit_kind kind = CAI_UNIT_OTHER;
  // Every parameter the unit's forward reads: its own and tied ones held by other units.
  std::vector<uint32_t> reads;
};

class Network {
 public:
  virtual ~Network() = default;

  // Unit 0 takes tokens (int64 [B, T]); the last unit returns logits [B, T, V]; units in
  // between map hidden states [B, T, C] to hidden states.
  virtual torch::Tensor Forward(size_t unit, const torch::Tensor& x) const = 0;
  virtual std::string Describe() const = 0;
  // False when the forward uses the parameters as stored (TorchScript), so it cannot compute
  // in a dtype other than the storage's.
  virtual bool CastsToComputeType() const { return true; }
  // Cuts the parameters into this rank's slices (recording how in their ParamSpec) and makes
  // Forward and CrossEntropy run tensor-parallel over `group`. Networks without the structure
  // (TorchScript) refuse.
  virtual void ApplyTensorParallel(TensorParallelGroup group, const TensorParallelOptions& options);
  // Sequence parallelism over `group` in `mode` (cai_sequence_parallel_mode): each rank runs
  // its shard of the sequence; attention all-to-alls heads against positions (ALL_TO_ALL) or
  // passes keys and values around the ring (RING_ATTN). Networks without the structure
  // (TorchScript) refuse.
  virtual void ApplySequenceParallel(TensorParallelGroup group, int32_t mode);
  // The targets [B, T] of what this rank's last unit computes: its shard under sequence
  // parallelism, all of them otherwise.
  virtual torch::Tensor LocalTargets(const torch::Tensor& targets) const { return targets; }
  // Mean cross-entropy of logits [N, V'] (what the last unit returned, flattened) against
  // targets [N], skipping `ignore_index`, in fp32.
  virtual torch::Tensor CrossEntropy(const torch::Tensor& logits, const torch::Tensor& targets,
                                     int64_t ignore_index) const;

  // CAI_MODEL_KERNEL_* bits; networks without optional kernels (TorchScript) refuse any.
  virtual void EnableKernels(uint64_t kernels);
  uint64_t kernels() const { return kernels_; }

  void SetComputeType(torch::ScalarType type) { compute_type_ = type; }
  torch::ScalarType compute_type() const { return compute_type_; }

  std::vector<ParamSpec> params;
  std::vector<UnitSpec> units;
  std::vector<std::pair<std::string, torch::Tensor>> buffers;
  int64_t vocab_size = 0;       // 0: unknown, tokens are not range-checked
  int64_t n_ctx = 0;            // 0: unknown, sequence length is not checked
  int64_t ignore_index = -100;  // targets the loss skips (besides -1); ParamOptions sets it

 protected:
  // Parameter `index` in the compute dtype; a differentiable cast when storage differs.
  torch::Tensor W(uint32_t index) const {
    const torch::Tensor& t = params[index].tensor;
    return t.scalar_type() == compute_type_ ? t : t.to(compute_type_);
  }

 private:
  torch::ScalarType compute_type_ = torch::kFloat;

 protected:
  uint64_t kernels_ = 0;
};

// `*` matches any run of characters, dots included ("blocks.*.attn.qkv").
bool GlobMatch(std::string_view pattern, std::string_view name);

std::unique_ptr<Network> MakeZooNetwork(const ModelConfig& config, uint64_t seed);
std::unique_ptr<Network> LoadTorchScriptNetwork(const std::string& path,
                                                const std::string& policy_path = "");

// Model over a network (model.cpp), after applying `options` to its parameters.
std::unique_ptr<Model> MakeModel(std::unique_ptr<Network> network,
                                 const ParamOptions& options = {});

}  // namespace cai
