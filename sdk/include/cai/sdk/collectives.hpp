// cai SDK: the collectives every data-parallel strategy runs on the model, over any group.
//
// Groups are communicator groups (NULL: the world); ranks and roots are ranks within the group.
// Small values (norms, flags) travel through device-tier pool memory, so the same code works
// where the communicator only takes device memory (NCCL).
#ifndef CAI_SDK_COLLECTIVES_HPP_
#define CAI_SDK_COLLECTIVES_HPP_

#include <span>
#include <vector>

#include "cai/sdk.hpp"

namespace cai::sdk {

inline int32_t GroupRank(const cai_comm_group* group) { return Host().comm->rank(group); }
inline int32_t GroupSize(const cai_comm_group* group) { return Host().comm->size(group); }

// Copies `t` from group rank `root` to every rank of `group`, in place.
inline void Broadcast(const cai_tensor& t, cai_comm_group* group = nullptr, int32_t root = 0) {
  cai_comm_args args{};
  args.struct_size = CAI_COMM_ARGS_STRUCT_SIZE;
  args.group = group;
  args.op = CAI_COMM_BROADCAST;
  args.output = &t;
  args.root = root;
  Check(Host().comm->run(&args, nullptr));
}

// Broadcasts the given parameters' current values from `root`.
inline void BroadcastParams(cai_model* model, std::span<const uint32_t> params,
                            cai_comm_group* group = nullptr, int32_t root = 0) {
  if (GroupSize(group) == 1) return;
  for (uint32_t i : params) {
    cai_tensor data{};
    Check(Host().model->param_data(model, i, &data));
    Broadcast(data, group, root);
  }
}

// Broadcasts the model's buffers (running statistics, caches) from `root`.
inline void BroadcastBuffers(cai_model* model, cai_comm_group* group = nullptr, int32_t root = 0) {
  if (GroupSize(group) == 1) return;
  for (uint32_t i = 0; i < Host().model->num_buffers(model); ++i) {
    cai_tensor data{};
    Check(Host().model->buffer_data(model, i, &data));
    Broadcast(data, group, root);
  }
}

// Every parameter that owns storage, trainable or frozen, and every buffer from `root`, so the
// ranks of `group` start from one model whatever each loaded (PyTorch DDP's and FSDP's
// sync_module_states).
inline void BroadcastModel(cai_model* model, cai_comm_group* group = nullptr, int32_t root = 0) {
  BroadcastParams(model, OwnedParams(model, true), group, root);
  BroadcastParams(model, OwnedParams(model, false), group, root);
  BroadcastBuffers(model, group, root);
}

// Replaces `t` by its mean over `group` (an AVG all-reduce). For parameters and optimizer
// state (local SGD's periodic averaging); gradients are summed, never averaged: the host's
// loss_weight already divides by the global batch (cai/plugin.h, cai_micro_batch).
inline void AverageOverGroup(const cai_tensor& t, cai_comm_group* group = nullptr) {
  if (GroupSize(group) == 1) return;
  RunCollective(CAI_COMM_ALL_REDUCE, nullptr, t, /*async=*/false, CAI_REDUCE_AVG, group);
}

// Reduces `values` element-wise over `group` in place (one all-reduce of fp64 values).
inline void AllReduceValues(std::span<double> values, cai_comm_group* group = nullptr,
                            cai_reduce_op op = CAI_REDUCE_SUM) {
  if (values.empty() || GroupSize(group) == 1) return;
  constexpr cai_dtype kF64{CAI_DTYPE_FLOAT, 64, 1};
  Buffer wire = Buffer::Alloc(CAI_MEM_DEVICE, values.size_bytes(), "sdk.values");
  Check(Host().mempool->copy(wire.data(), values.data(), values.size_bytes(), nullptr));
  int64_t n = static_cast<int64_t>(values.size());
  RunCollective(CAI_COMM_ALL_REDUCE, nullptr, FlatView(wire, kF64, 0, &n), false, op, group);
  Check(Host().mempool->copy(values.data(), wire.data(), values.size_bytes(), nullptr));
}

}  // namespace cai::sdk

#endif  // CAI_SDK_COLLECTIVES_HPP_
