// Checkpoints of a tensor-parallel model in the canonical (unsplit) layout.
//
// After cai_model_api.apply_tensor_parallel each parameter is this rank's slice of the whole
// (cai_param_info: global_shape, tp_dim, tp_blocks, tp_padded). TensorParallelIo is the
// ParamIo (cai/sdk/flat.hpp) that the flat savers and loaders take: a write all-gathers the
// slices over the tensor-parallel group and rank 0 of the group writes the whole tensor, the
// vocabulary's padding dropped; a read takes the whole tensor from the checkpoint and keeps this
// rank's slice. So a checkpoint saved at one tensor-parallel size loads at any other, and under
// every data-parallel strategy. Writes are collective over the group: every rank of it calls
// them, in one order. Parameters whole on every rank (tp_dim -1) are written by rank 0 alone.
#pragma once

#include <algorithm>
#include <functional>
#include <span>
#include <string>
#include <vector>

#include "cai/sdk.hpp"
#include "cai/sdk/flat.hpp"

namespace cai::sdk {

// How parameter `param` is cut (see cai_param_info).
struct TensorParallelSplit {
  int32_t dim = -1;
  int32_t blocks = 1;
  int64_t padded = 0;
  std::vector<int64_t> local_shape, global_shape;

  TensorParallelSplit(const cai_model* model, uint32_t param) {
    const cai_param_info info = ParamInfo(model, param);
    local_shape.assign(info.shape, info.shape + info.ndim);
    global_shape = local_shape;
    if (!CAI_HAS_FIELD(&info, cai_param_info, tp_padded) || info.tp_dim < 0) return;
    dim = info.tp_dim;
    blocks = info.tp_blocks;
    padded = info.tp_padded;
    global_shape.assign(info.global_shape, info.global_shape + info.ndim);
  }
  static int64_t Numel(const std::vector<int64_t>& shape) {
    int64_t n = 1;
    for (int64_t s : shape) n *= s;
    return n;
  }
  // Calls fn(local_offset, global_offset, count) for every contiguous run of rank `rank`'s
  // elements in the whole tensor (row-major offsets).
  void ForEachRun(int32_t rank, int32_t size,
                  const std::function<void(int64_t, int64_t, int64_t)>& fn) const {
    int64_t outer = 1, inner = 1;
    for (int32_t d = 0; d < dim; ++d) outer *= global_shape[d];
    for (size_t d = dim + 1; d < global_shape.size(); ++d) inner *= global_shape[d];
    const int64_t local = local_shape[dim], whole = global_shape[dim];
    const int64_t block = whole / blocks, part = padded / blocks / size;
    const int64_t first = rank * part;
    const int64_t count = std::clamp<int64_t>(block - first, 0, part);
    if (count == 0) return;
    for (int64_t o = 0; o < outer; ++o) {
      for (int32_t b = 0; b < blocks; ++b) {
        fn((o * local + b * part) * inner, (o * whole + b * block + first) * inner, count * inner);
      }
    }
  }
};

class TensorParallelIo : public ParamIo {
 public:
  TensorParallelIo(cai_model* model, cai_comm_group* group)
      : model_(model),
        group_(group),
        rank_(Host().comm->rank(group)),
        size_(Host().comm->size(group)) {}

  void Write(cai_checkpoint* ckpt, const std::string& name, uint32_t param, const cai_tensor& flat,
             std::span<const int64_t> shape) const override {
    const TensorParallelSplit split(model_, param);
    if (split.dim < 0) {
      if (rank_ == 0) ParamIo::Write(ckpt, name, param, flat, shape);
      return;
    }
    int64_t local = TensorParallelSplit::Numel(split.local_shape);
    int64_t gathered_numel = local * size_;
    const Buffer mine = AllocFlat(CAI_MEM_DEVICE, local, kFloat32, "tp.checkpoint");
    RunKernel(CAI_KERNEL_COPY, &flat, FlatView(mine, kFloat32, 0, &local));
    const Buffer gathered = AllocFlat(CAI_MEM_DEVICE, gathered_numel, kFloat32, "tp.checkpoint");
    const cai_tensor in = FlatView(mine, kFloat32, 0, &local);
    RunCollective(CAI_COMM_ALL_GATHER, &in, FlatView(gathered, kFloat32, 0, &gathered_numel), false,
                  CAI_REDUCE_SUM, group_);
    if (rank_ != 0) return;
    int64_t whole = TensorParallelSplit::Numel(split.global_shape);
    const Buffer canonical = AllocFlat(CAI_MEM_DEVICE, whole, kFloat32, "tp.checkpoint");
    for (int32_t r = 0; r < size_; ++r) {
      split.ForEachRun(r, size_, [&](int64_t from, int64_t to, int64_t n) {
        const cai_tensor src = FlatView(gathered, kFloat32, r * local + from, &n);
        RunKernel(CAI_KERNEL_COPY, &src, FlatView(canonical, kFloat32, to, &n));
      });
    }
    ParamIo::Write(ckpt, name, param, FlatView(canonical, kFloat32, 0, &whole),
                   shape.empty() ? std::span<const int64_t>() : split.global_shape);
  }

  void Read(cai_checkpoint* ckpt, const std::string& name, uint32_t param, int64_t offset,
            int64_t count, const cai_tensor& dst) const override {
    const TensorParallelSplit split(model_, param);
    if (split.dim < 0) return ParamIo::Read(ckpt, name, param, offset, count, dst);
    int64_t whole = TensorParallelSplit::Numel(split.global_shape);
    int64_t local = TensorParallelSplit::Numel(split.local_shape);
    const Buffer canonical = AllocFlat(CAI_MEM_DEVICE, whole, kFloat32, "tp.checkpoint");
    ParamIo::Read(ckpt, name, param, 0, 0, FlatView(canonical, kFloat32, 0, &whole));
    const Buffer mine = AllocFlat(CAI_MEM_DEVICE, local, kFloat32, "tp.checkpoint");  // zeros
    split.ForEachRun(rank_, size_, [&](int64_t to, int64_t from, int64_t n) {
      const cai_tensor src = FlatView(canonical, kFloat32, from, &n);
      RunKernel(CAI_KERNEL_COPY, &src, FlatView(mine, kFloat32, to, &n));
    });
    int64_t n = count == 0 ? local : count;
    const cai_tensor src = FlatView(mine, kFloat32, static_cast<size_t>(offset), &n);
    RunKernel(CAI_KERNEL_COPY, &src, dst);
  }

 private:
  cai_model* model_;
  cai_comm_group* group_;
  int32_t rank_, size_;
};

}  // namespace cai::sdk
