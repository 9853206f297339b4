// `cai export`: a checkpoint's model weights as Hugging Face safetensors, and `model.init_from`:
// such weights into a zoo model. Layouts and names: hf_layout.h.
#pragma once

#include <cstdint>
#include <filesystem>
#include <optional>
#include <vector>

#include "cai/core.h"
#include "model/model.h"

namespace cai::interop {

struct ExportOptions {
  // Largest safetensors file (a larger tensor gets a file of its own): transformers'
  // save_pretrained max_shard_size, whose default is 5 GB.
  uint64_t max_shard_bytes = 5'000'000'000;
  // Dtype written (fp32, bf16 or fp16); nullopt: as the checkpoint holds each tensor.
  std::optional<cai_dtype> dtype;
};

struct ExportResult {
  std::vector<std::filesystem::path> files;  // the .safetensors files, in order
  uint64_t bytes = 0;                        // tensor bytes written
  size_t tensors = 0;
};

// Writes the weights of the checkpoint `checkpoint` (a step directory saved by any strategy at
// any world size; fsdp's sharded layout is put back together) for a zoo model of `config` into
// `out_dir`: model.safetensors, or model-0000i-of-0000n.safetensors when they exceed
// max_shard_bytes; model.safetensors.index.json; config.json. One tensor is in memory at a
// time (twice for the transposed GPT-2 weights). Throws cai::Error naming the tensor when the
// checkpoint lacks one or holds another size.
ExportResult ExportSafetensors(const std::filesystem::path& checkpoint, const ModelConfig& config,
                               const std::filesystem::path& out_dir,
                               const ExportOptions& options = {});

// The model described by out_dir/config.json (ModelConfigFromHf).
ModelConfig ReadHfConfig(const std::filesystem::path& dir);

// Overwrites every parameter of `model`, a zoo model built from `config`, with the weights in
// `dir` (what ExportSafetensors writes, or a GPT2LMHeadModel / LlamaForCausalLM saved with
// save_pretrained in safetensors), converting dtypes and layouts. Refuses (INVALID_ARGUMENT)
// a config.json that describes another model, listing the keys that differ; a missing tensor
// or one of another shape (NOT_FOUND / INVALID_ARGUMENT, naming file and tensor); tensors the
// model has no place for; non-zero biases for a GPT-2 built without them.
void LoadHfWeights(const std::filesystem::path& dir, const ModelConfig& config, Model& model);

}  // namespace cai::interop
