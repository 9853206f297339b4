// Hugging Face's names and layouts for the zoo's models (GPT2LMHeadModel, LlamaForCausalLM),
// and their config.json, both ways. Torch-free.
//
// GPT-2: cai's fused qkv is HF's c_attn with q, k, v in the same order along the output
// dimension; HF's Conv1D stores every linear weight as [in, out], the transpose of cai's
// [out, in] (nn.Linear). The output projection is tied to wte and written once, as HF does.
// A cai GPT-2 without biases is HF's with zero biases (HF's GPT-2 always has them).
// Llama: one-to-one names, no transposes. cai's rotary embedding pairs each element of a
// head's first half with the matching one of its second half (rotate_half), HF's convention,
// so q and k need no permutation (Meta's original checkpoints interleave pairs; HF's
// convert_llama_weights_to_hf permutes them into this order).
#pragma once

#include <string>
#include <vector>

#include "core/json.h"
#include "model/model.h"

namespace cai::interop {

struct HfTensor {
  std::string hf_name;         // "transformer.h.0.attn.c_attn.weight"
  std::string cai_name;        // "blocks.0.attn.qkv.weight"; empty: not in cai's model
  std::vector<int64_t> shape;  // HF's shape
  bool transpose = false;      // a 2-D tensor whose cai shape is HF's reversed
};

// Every tensor of the HF checkpoint for `config`, in HF's order (embeddings, layers, final
// norm, head). Entries with an empty cai_name are zero in cai's model (GPT-2 without biases).
std::vector<HfTensor> HfLayout(const ModelConfig& config);

// config.json for `config`; torch_dtype names the dtype the weights are written in.
std::string HfConfigJson(const ModelConfig& config, const std::string& torch_dtype);

// The model config.json describes (model_type gpt2 or llama). Throws INVALID_ARGUMENT naming
// `what` and the field for other model types and for what cai's zoo does not compute (rope
// scaling, another activation, dropout, GPT-2 variants).
ModelConfig ModelConfigFromHf(const JsonValue& config, const std::string& what);

// The [model] keys of a job that builds `config` ("kind = \"llama\"\nn_layer = 2\n...").
std::string ModelKeysToml(const ModelConfig& config);

// Every difference between two configs, as "model.n_layer = 4 (config.json: 12)" lines; empty
// when they build the same model.
std::vector<std::string> ConfigDifferences(const ModelConfig& job, const ModelConfig& saved);

}  // namespace cai::interop
