// A parameter's full value from any strategy's checkpoint, whatever its world size: the
// canonical "model/<name>" entry when there is one, otherwise the slices of fsdp's sharded
// layout (meta "fsdp.index", docs/checkpoint-layout.md) put back together. Reads go through
// the same cai_checkpoint_api a strategy's load uses. Not thread-safe.
#pragma once

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "cai/sdk/sharded_index.hpp"
#include "checkpoint/checkpoint.h"

namespace cai::ckpt {

class FullParamReader {
 public:
  struct Info {
    cai_dtype dtype{CAI_DTYPE_FLOAT, 32, 1};
    int64_t numel = 0;
    std::vector<int64_t> shape;  // as saved; fsdp's sharded layout keeps no shapes (empty)
  };

  // Throws DATA_LOSS when the checkpoint's fsdp.index is malformed.
  explicit FullParamReader(CheckpointReader& reader);

  // nullopt when the checkpoint holds no value of `param` (a cai parameter name).
  std::optional<Info> Find(const std::string& param);
  // All `numel` elements of `param`, converted to `dtype` (fp32, bf16 or fp16; or the saved
  // dtype), into host memory at `dst`. Throws NOT_FOUND, or INVALID_ARGUMENT for a numel that
  // differs from the saved one.
  void Read(const std::string& param, void* dst, cai_dtype dtype, int64_t numel);

 private:
  cai_checkpoint* handle_;
  std::map<std::string, sdk::ShardedParam> sharded_;
};

}  // namespace cai::ckpt
