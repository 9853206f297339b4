#include "interop/hf_weights.h"

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <map>
#include <set>
#include <sstream>

#include "checkpoint/checkpoint.h"
#include "checkpoint/dtype_convert.h"
#include "checkpoint/full_params.h"
#include "checkpoint/safetensors.h"
#include "core/files.h"
#include "core/json.h"
#include "core/status.h"
#include "interop/hf_layout.h"

namespace fs = std::filesystem;

namespace cai::interop {
namespace {

constexpr char kIndexFile[] = "model.safetensors.index.json";
constexpr char kSingleFile[] = "model.safetensors";
constexpr cai_dtype kFp32{CAI_DTYPE_FLOAT, 32, 1};

int64_t Numel(const std::vector<int64_t>& shape) {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

std::string ShapeText(const std::vector<int64_t>& shape) {
  std::string s = "[";
  for (size_t i = 0; i < shape.size(); ++i) s += (i ? ", " : "") + std::to_string(shape[i]);
  return s + "]";
}

// torch_dtype's spelling in config.json.
std::string TorchDtype(cai_dtype d) {
  if (d.code == CAI_DTYPE_BFLOAT) return "bfloat16";
  if (d.code == CAI_DTYPE_FLOAT && d.bits == 16) return "float16";
  return "float32";
}

// [rows, cols] of `size`-byte elements -> [cols, rows].
void Transpose(const char* src, char* dst, int64_t rows, int64_t cols, size_t size) {
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t c = 0; c < cols; ++c) {
      std::memcpy(dst + (static_cast<size_t>(c * rows + r)) * size,
                  src + (static_cast<size_t>(r * cols + c)) * size, size);
    }
  }
}

void WriteText(const fs::path& path, const std::string& text) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out << text;
  out.close();
  if (!out) throw Error(CAI_PERMISSION_DENIED, path.string() + ": cannot be written");
}

}  // namespace

ExportResult ExportSafetensors(const fs::path& checkpoint, const ModelConfig& config,
                               const fs::path& out_dir, const ExportOptions& options) {
  ckpt::CheckpointReader reader(checkpoint);
  ckpt::FullParamReader params(reader);
  if (options.dtype && !ckpt::IsConvertibleFloat(*options.dtype)) {
    throw Error(CAI_INVALID_ARGUMENT, "export dtype must be fp32, bf16 or fp16");
  }

  // What each HF tensor is written as; zero-filled ones take the dtype of the weights.
  struct Planned {
    HfTensor hf;
    cai_dtype dtype;
  };
  std::vector<Planned> plan;
  std::optional<cai_dtype> weights_dtype = options.dtype;
  for (HfTensor& t : HfLayout(config)) {
    cai_dtype dtype = options.dtype.value_or(kFp32);
    if (!t.cai_name.empty()) {
      const std::optional<ckpt::FullParamReader::Info> info = params.Find(t.cai_name);
      if (!info) {
        throw Error(CAI_NOT_FOUND, "checkpoint " + checkpoint.string() + " has no parameter '" +
                                       t.cai_name + "' (for " + t.hf_name +
                                       "): it was saved from another model, or by a strategy "
                                       "that does not write model weights in the canonical or "
                                       "fsdp-sharded layout");
      }
      if (info->numel != Numel(t.shape)) {
        throw Error(CAI_INVALID_ARGUMENT,
                    "checkpoint " + checkpoint.string() + ": parameter '" + t.cai_name + "' has " +
                        std::to_string(info->numel) + " elements, the job's model " +
                        std::to_string(Numel(t.shape)) + " (" + t.hf_name + " " +
                        ShapeText(t.shape) + "): the job describes another model");
      }
      if (!options.dtype) {
        dtype = info->dtype;
        if (!weights_dtype) weights_dtype = dtype;
      }
    }
    plan.push_back({std::move(t), dtype});
  }
  for (Planned& p : plan) {
    if (p.hf.cai_name.empty()) p.dtype = weights_dtype.value_or(kFp32);
  }

  // Files of at most max_shard_bytes, tensors in HF's order (save_pretrained's sharding).
  std::vector<std::vector<size_t>> shards;
  uint64_t shard_bytes = 0;
  for (size_t i = 0; i < plan.size(); ++i) {
    const uint64_t bytes =
        static_cast<uint64_t>(Numel(plan[i].hf.shape)) * (plan[i].dtype.bits / 8);
    if (shards.empty() || (shard_bytes > 0 && shard_bytes + bytes > options.max_shard_bytes)) {
      shards.emplace_back();
      shard_bytes = 0;
    }
    shards.back().push_back(i);
    shard_bytes += bytes;
  }

  std::error_code ec;
  fs::create_directories(out_dir, ec);
  if (ec) {
    throw Error(CAI_PERMISSION_DENIED, "cannot create " + out_dir.string() + ": " + ec.message());
  }
  ExportResult result;
  JsonObject weight_map;
  const std::map<std::string, std::string> metadata = {{"format", "pt"},
                                                       {"cai_step", std::to_string(reader.step())}};
  std::vector<char> buffer, transposed;
  for (size_t s = 0; s < shards.size(); ++s) {
    char name[64];
    if (shards.size() == 1) {
      std::snprintf(name, sizeof name, "%s", kSingleFile);
    } else {
      std::snprintf(name, sizeof name, "model-%05zu-of-%05zu.safetensors", s + 1, shards.size());
    }
    std::vector<ckpt::SafetensorsTensor> headers;
    for (size_t i : shards[s])
      headers.push_back({plan[i].hf.hf_name, plan[i].dtype, plan[i].hf.shape});
    ckpt::SafetensorsWriter writer(out_dir / name, headers, metadata);
    for (size_t i : shards[s]) {
      const Planned& p = plan[i];
      const int64_t numel = Numel(p.hf.shape);
      const size_t size = p.dtype.bits / 8u;
      buffer.assign(static_cast<size_t>(numel) * size, 0);
      if (!p.hf.cai_name.empty()) params.Read(p.hf.cai_name, buffer.data(), p.dtype, numel);
      if (p.hf.transpose) {
        // cai holds [shape[1], shape[0]] (nn.Linear); HF's Conv1D the transpose.
        transposed.resize(buffer.size());
        Transpose(buffer.data(), transposed.data(), p.hf.shape[1], p.hf.shape[0], size);
        buffer.swap(transposed);
      }
      writer.Append(buffer.data(), buffer.size());
      weight_map.Add(p.hf.hf_name, name);
      result.bytes += buffer.size();
      ++result.tensors;
    }
    writer.Finish();
    result.files.push_back(out_dir / name);
  }
  JsonObject index;
  index.AddRaw("metadata", JsonObject().Add("total_size", result.bytes).str());
  index.AddRaw("weight_map", weight_map.str());
  WriteText(out_dir / kIndexFile, index.str() + "\n");
  WriteText(out_dir / "config.json",
            HfConfigJson(config, TorchDtype(weights_dtype.value_or(kFp32))));
  return result;
}

ModelConfig ReadHfConfig(const fs::path& dir) {
  const fs::path path = dir / "config.json";
  return ModelConfigFromHf(ParseJson(ReadTextFile(path), path.string()), path.string());
}

void LoadHfWeights(const fs::path& dir, const ModelConfig& config, Model& model) {
  const ModelConfig saved = ReadHfConfig(dir);
  if (const std::vector<std::string> diff = ConfigDifferences(config, saved); !diff.empty()) {
    std::string lines;
    for (const std::string& d : diff) lines += "\n  " + d;
    throw Error(CAI_INVALID_ARGUMENT, "model.init_from = \"" + dir.string() +
                                          "\": its config.json describes another model:" + lines +
                                          "\n`cai import " + dir.string() +
                                          "` prints the [model] keys that build it");
  }
  const JsonValue hf_config = ParseJson(ReadTextFile(dir / "config.json"), "config.json");
  const JsonValue* tie = hf_config.Find("tie_word_embeddings");
  const bool tied = tie != nullptr && tie->type == JsonValue::Type::kBool && tie->boolean;

  // The files and which tensor each holds: the index's weight_map, or the one file.
  std::vector<ckpt::SafetensorsReader> files;
  std::map<std::string, std::pair<size_t, const ckpt::SafetensorsTensor*>> where;
  std::vector<std::string> names;
  if (fs::exists(dir / kIndexFile)) {
    const fs::path index_path = dir / kIndexFile;
    const JsonValue index = ParseJson(ReadTextFile(index_path), index_path.string());
    const JsonValue* map = index.Find("weight_map");
    if (map == nullptr || map->type != JsonValue::Type::kObject) {
      throw Error(CAI_DATA_LOSS, index_path.string() + ": no \"weight_map\" object");
    }
    std::set<std::string> file_names;
    for (const auto& [tensor, file] : map->object) {
      if (file.type != JsonValue::Type::kString || file.string.find('/') != std::string::npos) {
        throw Error(CAI_DATA_LOSS, index_path.string() + ": the file of '" + tensor +
                                       "' is not a file name in the directory");
      }
      file_names.insert(file.string);
    }
    for (const std::string& f : file_names) names.push_back(f);
  } else if (fs::exists(dir / kSingleFile)) {
    names.push_back(kSingleFile);
  } else {
    throw Error(CAI_NOT_FOUND, dir.string() + ": neither " + kIndexFile + " nor " + kSingleFile +
                                   " (cai reads safetensors; convert .bin weights with "
                                   "transformers' save_pretrained(safe_serialization=True))");
  }
  for (const std::string& n : names) files.emplace_back(dir / n);
  for (size_t f = 0; f < files.size(); ++f) {
    for (const ckpt::SafetensorsTensor& t : files[f].tensors()) {
      if (!where.emplace(t.name, std::make_pair(f, &t)).second) {
        throw Error(CAI_DATA_LOSS, dir.string() + ": tensor '" + t.name + "' is in " +
                                       files[where[t.name].first].path().filename().string() +
                                       " and " + files[f].path().filename().string());
      }
    }
  }

  std::map<std::string, uint32_t> param_of;
  for (uint32_t i = 0; i < model.NumParams(); ++i) param_of[model.ParamInfo(i).name] = i;
  std::set<std::string> used;
  std::vector<char> buffer, transposed;
  for (const HfTensor& t : HfLayout(config)) {
    // GPT-2 as the "gpt2" hub repositories save it (GPT2Model, without "transformer.");
    // a tied Llama's lm_head from its embedding.
    std::vector<std::string> candidates = {t.hf_name};
    if (t.hf_name.starts_with("transformer.")) candidates.push_back(t.hf_name.substr(12));
    if (t.hf_name == "lm_head.weight" && tied) candidates.push_back("model.embed_tokens.weight");
    auto found = where.end();
    for (const std::string& c : candidates) {
      if (found == where.end()) found = where.find(c);
    }
    if (found == where.end()) {
      throw Error(CAI_NOT_FOUND, dir.string() + " has no tensor '" + t.hf_name + "'");
    }
    used.insert(found->first);
    const ckpt::SafetensorsReader& file = files[found->second.first];
    const ckpt::SafetensorsTensor& st = *found->second.second;
    const std::string what = file.path().string() + ": tensor '" + st.name + "'";
    if (st.shape != t.shape) {
      throw Error(CAI_INVALID_ARGUMENT,
                  what + " has shape " + ShapeText(st.shape) + ", the model " + ShapeText(t.shape));
    }
    if (!ckpt::IsConvertibleFloat(st.dtype)) {
      throw Error(CAI_INVALID_ARGUMENT, what + " is " + ckpt::DtypeName(st.dtype) +
                                            "; weights are read from F32, BF16 or F16");
    }
    const int64_t numel = Numel(t.shape);
    const size_t size = st.dtype.bits / 8u;
    buffer.resize(static_cast<size_t>(numel) * size);
    file.Read(st, 0, buffer.data(), buffer.size());
    if (t.cai_name.empty()) {
      std::vector<float> values(static_cast<size_t>(numel));
      ckpt::ConvertFloats(buffer.data(), st.dtype, values.data(), kFp32, values.size());
      if (std::any_of(values.begin(), values.end(), [](float v) { return v != 0.0f; })) {
        throw Error(CAI_INVALID_ARGUMENT,
                    what + " is not zero, and the model has no biases: set model.bias = true");
      }
      continue;
    }
    if (t.transpose) {
      transposed.resize(buffer.size());
      Transpose(buffer.data(), transposed.data(), t.shape[0], t.shape[1], size);
      buffer.swap(transposed);
    }
    const auto p = param_of.find(t.cai_name);
    if (p == param_of.end()) {
      throw Error(CAI_INTERNAL, "the model has no parameter '" + t.cai_name + "'");
    }
    const cai_tensor dst = model.ParamData(p->second);
    ckpt::ConvertFloats(buffer.data(), st.dtype, static_cast<char*>(dst.data) + dst.byte_offset,
                        dst.dtype, static_cast<size_t>(numel));
  }
  // Buffers transformers has saved over the years, which the model recomputes.
  auto is_buffer = [](const std::string& n) {
    return n.ends_with(".attn.bias") || n.ends_with(".attn.masked_bias") ||
           n.ends_with(".rotary_emb.inv_freq");
  };
  std::vector<std::string> extra;
  for (const auto& [name, loc] : where) {
    if (!used.count(name) && !is_buffer(name) &&
        !(config.arch == ModelConfig::Arch::kGpt2 && name == "lm_head.weight")) {
      extra.push_back(name);
    }
  }
  if (!extra.empty()) {
    std::string list;
    for (size_t i = 0; i < extra.size() && i < 3; ++i) list += (i ? ", '" : "'") + extra[i] + "'";
    throw Error(CAI_INVALID_ARGUMENT, dir.string() + " holds " + std::to_string(extra.size()) +
                                          " tensors the model has no place for (" + list +
                                          (extra.size() > 3 ? ", ..." : "") + ")");
  }
}

}  // namespace cai::interop
