// The LibTorch calls below reach under the public tensor API (storage internals, autograd
// accumulator hooks, generators). They exist with these signatures in LibTorch 1.13 and 2.x;
// if a release changes one, this is the only file to touch.
#pragma once

#include <torch/torch.h>

#include <cstdint>
#include <memory>
#include <utility>

namespace cai::torch_compat {

// Frees the tensor's storage in place (zero bytes), as FSDP's storage.resize_(0): the
// StorageImpl object, shared by the tensor and every view autograd saved of it, survives.
inline void ReleaseStorage(const torch::Tensor& tensor) {
  c10::StorageImpl* storage = tensor.storage().unsafeGetStorageImpl();
  storage->set_data_ptr_noswap(c10::DataPtr(nullptr, tensor.device()));
  storage->set_nbytes(0);
}

// Grows a released storage back to `nbytes` (contents undefined). Storage made by from_blob
// has no allocator of its own; the device's default allocator serves it then.
inline void MaterializeStorage(const torch::Tensor& tensor, size_t nbytes) {
  c10::StorageImpl* storage = tensor.storage().unsafeGetStorageImpl();
  c10::Allocator* allocator = storage->allocator();
  if (allocator == nullptr) allocator = c10::GetAllocator(tensor.device().type());
  storage->set_data_ptr_noswap(allocator->allocate(nbytes));
  storage->set_nbytes(nbytes);
}

// Points a released storage at caller memory (not owned, never freed here) that holds the
// tensor's elements from `data` on, keeping the StorageImpl that the tensor and autograd's
// saved views share: FSDP's all-gather straight into the parameters, without a copy.
inline void RefillStorage(const torch::Tensor& tensor, void* data) {
  c10::StorageImpl* storage = tensor.storage().unsafeGetStorageImpl();
  const size_t before = static_cast<size_t>(tensor.storage_offset()) * tensor.element_size();
  storage->set_data_ptr_noswap(c10::DataPtr(static_cast<char*>(data) - before, tensor.device()));
  storage->set_nbytes(before + static_cast<size_t>(tensor.numel()) * tensor.element_size());
}

// A CPU tensor of `shape` whose storage holds no bytes yet (as released), for
// MaterializeStorage to grow: a lazily initialised parameter allocates nothing until read.
inline torch::Tensor UnallocatedTensor(const std::vector<int64_t>& shape,
                                       torch::ScalarType type = torch::kFloat) {
  torch::Tensor t = torch::empty({0}, type);
  t.unsafeGetTensorImpl()->set_sizes_contiguous(shape);
  return t;
}

inline bool StorageReleased(const torch::Tensor& tensor) {
  return tensor.storage().nbytes() == 0 && tensor.numel() > 0;
}

// A CPU generator with its own state: draws depend only on `seed`, not on the global
// generator or on the thread count.
inline torch::Generator CpuGenerator(uint64_t seed) { return at::detail::createCPUGenerator(seed); }

// The node that accumulates a leaf's gradient into .grad. The variable keeps only a weak
// reference to it, so whoever hooks it must hold the returned pointer.
inline std::shared_ptr<torch::autograd::Node> GradAccumulator(const torch::Tensor& leaf) {
  return torch::autograd::impl::grad_accumulator(leaf);
}

// Calls `fn` after the accumulator has added this backward's gradient into .grad (the engine
// sums every use of the leaf before running the accumulator once). PyTorch >= 2.1 also has
// Tensor.register_post_accumulate_grad_hook; the accumulator post hook (what DDP's reducer
// uses) works on 1.13 too.
template <class Fn>
void AddPostAccumulateHook(torch::autograd::Node& accumulator, Fn fn) {
  struct Hook final : torch::autograd::FunctionPostHook {
    explicit Hook(Fn f) : fn(std::move(f)) {}
    torch::autograd::variable_list operator()(const torch::autograd::variable_list& outputs,
                                              const torch::autograd::variable_list&) override {
      fn();
      return outputs;
    }
    Fn fn;
  };
  accumulator.add_post_hook(std::make_unique<Hook>(std::move(fn)));
}

}  // namespace cai::torch_compat
