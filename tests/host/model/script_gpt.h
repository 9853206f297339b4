// A GPT written in TorchScript (as a user would torch.jit.script their own model) and the
// tensor-parallel policy that splits it, for the tests of TorchScript models under tensor
// parallelism. Free of LibTorch, so job-level tests include it without compiling LibTorch.
#pragma once

#include <cstdint>
#include <string>

namespace cai::testing {

struct ScriptGptShape {
  int64_t vocab = 256, n_ctx = 64, n_layer = 2, n_head = 4, n_embd = 32;
  // "matmul": the output projection is a [C, V] matrix used by torch.matmul (plus a bias);
  // "transposed": torch.matmul(h, weight.t()), which a policy cannot split.
  std::string head = "matmul";
};

// Saves the model (seeded: one file per shape gives the same weights) at `path`; returns it.
std::string SaveScriptGpt(const std::string& path, const ScriptGptShape& shape = {});

// Splits q/k/v (fused, 3 blocks), the MLP up projection and the head column-wise (the head's
// output gathered), the attention and MLP output projections row-wise, and divides n_head.
constexpr const char* kScriptGptPolicy =
    R"(column = ["blocks.*.attn.qkv", "blocks.*.mlp.fc", "head"]
row = ["blocks.*.attn.proj", "blocks.*.mlp.proj"]
heads = ["blocks.*.attn.n_head"]
gather_output = ["head"]

[fused]
"blocks.*.attn.qkv" = 3
)";

// Writes `text` to `path`; returns the path.
std::string WriteText(const std::string& path, const std::string& text);

}  // namespace cai::testing
