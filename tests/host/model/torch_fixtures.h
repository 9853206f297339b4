// What the model tests that use LibTorch share: token descriptors, a fixed batch and small
// zoo configurations.
#pragma once

#include <torch/torch.h>

#include <cstdint>
#include <vector>

#include "cai/core.h"
#include "model/model.h"

namespace cai::testing {

// An int64 torch tensor as a descriptor; the tensor must outlive it.
struct TokenDesc {
  std::vector<int64_t> shape, strides;
  cai_tensor view;
  explicit TokenDesc(const torch::Tensor& t) : shape(t.sizes().vec()), strides(t.strides().vec()) {
    view = {t.data_ptr(),
            {CAI_DEVICE_CPU, 0},
            int32_t(t.dim()),
            {CAI_DTYPE_INT, 64, 1},
            shape.data(),
            strides.data(),
            0};
  }
};

// A fixed batch [2, 8] of next-token pairs over `vocab` - 1 tokens.
struct Batch {
  torch::Tensor tokens, targets;
  TokenDesc tokens_desc, targets_desc;
  explicit Batch(int64_t vocab)
      : tokens(torch::arange(16, torch::kLong).remainder(vocab - 1).view({2, 8})),
        targets(torch::arange(1, 17, torch::kLong).remainder(vocab - 1).view({2, 8})),
        tokens_desc(tokens),
        targets_desc(targets) {}
};

// A two-block model of each kind (Llama with grouped-query attention).
inline ModelConfig Config(ModelConfig::Arch arch) {
  ModelConfig c;
  c.arch = arch;
  c.vocab_size = 64;
  c.n_ctx = 16;
  c.n_layer = 2;
  c.n_head = 4;
  c.n_kv_head = arch == ModelConfig::Arch::kLlama ? 2 : 0;
  c.n_embd = 32;
  return c;
}

}  // namespace cai::testing
