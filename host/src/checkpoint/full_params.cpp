#include "checkpoint/full_params.h"

#include "core/status.h"

namespace cai::ckpt {
namespace {

cai_tensor HostTensor(void* data, cai_dtype dtype, int64_t* numel) {
  static int64_t one = 1;
  cai_tensor t{};
  t.data = data;
  t.device = {CAI_DEVICE_CPU, 0};
  t.ndim = 1;
  t.dtype = dtype;
  t.shape = numel;
  t.strides = &one;
  return t;
}

}  // namespace

FullParamReader::FullParamReader(CheckpointReader& reader) : handle_(reader.handle()) {
  const cai_checkpoint_api& api = *CheckpointApi();
  const char* text = nullptr;
  cai_status* status = api.read_meta(handle_, "fsdp.index", &text);
  if (status != nullptr) {
    if (StatusCode(status) == CAI_NOT_FOUND) {
      DestroyStatus(status);
      return;  // the canonical layout alone
    }
    ThrowIfError(status);
  }
  try {
    sharded_ = sdk::ParseShardedIndex(text);
  } catch (const sdk::Error& e) {
    throw Error(e.code(), e.what());
  }
}

std::optional<FullParamReader::Info> FullParamReader::Find(const std::string& param) {
  cai_ckpt_tensor_info info{};
  info.struct_size = CAI_CKPT_TENSOR_INFO_STRUCT_SIZE;
  cai_status* status = CheckpointApi()->tensor_info(handle_, ("model/" + param).c_str(), &info);
  if (status == nullptr) {
    Info out;
    out.dtype = info.dtype;
    out.shape.assign(info.shape, info.shape + info.ndim);
    out.numel = 1;
    for (int64_t d : out.shape) out.numel *= d;
    return out;
  }
  if (StatusCode(status) != CAI_NOT_FOUND) ThrowIfError(status);
  DestroyStatus(status);
  const auto it = sharded_.find(param);
  if (it == sharded_.end()) return std::nullopt;
  Info out;
  out.numel = it->second.numel;
  return out;
}

void FullParamReader::Read(const std::string& param, void* dst, cai_dtype dtype, int64_t numel) {
  const std::optional<Info> info = Find(param);
  if (!info) {
    throw Error(CAI_NOT_FOUND, "the checkpoint has no value of parameter '" + param +
                                   "' (neither 'model/" + param + "' nor an fsdp shard)");
  }
  if (info->numel != numel) {
    throw Error(CAI_INVALID_ARGUMENT, "parameter '" + param + "' has " +
                                          std::to_string(info->numel) +
                                          " elements in the checkpoint, " + std::to_string(numel) +
                                          " asked for: another model saved it");
  }
  // The host's reader puts a parameter of fsdp's sharded layout back together itself.
  cai_tensor t = HostTensor(dst, dtype, &numel);
  ThrowIfError(CheckpointApi()->read_tensor(handle_, ("model/" + param).c_str(), 0, 0, &t));
}

}  // namespace cai::ckpt
