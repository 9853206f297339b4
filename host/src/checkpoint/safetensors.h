// The safetensors format (github.com/huggingface/safetensors), which Hugging Face's
// save_pretrained writes: u64 little-endian N, an N-byte JSON header
//   {"<name>": {"dtype": "F32", "shape": [2, 3], "data_offsets": [begin, end]}, ...,
//    "__metadata__": {"format": "pt"}}
// padded with spaces so the data starts at a multiple of 8, then the tensors' bytes, row-major,
// little-endian; offsets count from the data's start. Torch-free.
#pragma once

#include <cstdint>
#include <filesystem>
#include <map>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "cai/core.h"

namespace cai::ckpt {

struct SafetensorsTensor {
  std::string name;
  cai_dtype dtype{CAI_DTYPE_FLOAT, 32, 1};
  std::vector<int64_t> shape;
  uint64_t begin = 0;  // data_offsets, from the start of the data
  uint64_t end = 0;
  uint64_t bytes() const { return end - begin; }
};

// "F32", "BF16", "F16", "F64", "I64", "I32", "I16", "I8", "U8", "BOOL" and back; nullopt /
// INVALID_ARGUMENT for dtypes safetensors has no name for.
std::optional<cai_dtype> DtypeFromSafetensors(std::string_view name);
const char* SafetensorsDtypeName(cai_dtype dtype);

// Writes one file: the header first (so every tensor's name, dtype and shape is known up
// front), then the tensors' bytes in the order given, streamed. Not thread-safe.
class SafetensorsWriter {
 public:
  // Lays `tensors` out end to end in the given order (their begin/end are computed) and writes
  // the header. Throws cai::Error naming the file (PERMISSION_DENIED, INVALID_ARGUMENT for a
  // dtype safetensors cannot name, ALREADY_EXISTS for a repeated name).
  SafetensorsWriter(const std::filesystem::path& path, std::vector<SafetensorsTensor> tensors,
                    const std::map<std::string, std::string>& metadata = {});
  ~SafetensorsWriter();
  SafetensorsWriter(const SafetensorsWriter&) = delete;
  SafetensorsWriter& operator=(const SafetensorsWriter&) = delete;

  // The next `bytes` of the data section (tensors in order, each may come in pieces).
  void Append(const void* data, size_t bytes);
  // Checks that every tensor's bytes were written, fsyncs and closes.
  void Finish();

  const std::vector<SafetensorsTensor>& tensors() const { return tensors_; }

 private:
  std::filesystem::path path_;
  int fd_ = -1;
  std::vector<SafetensorsTensor> tensors_;
  uint64_t data_start_ = 0;
  uint64_t written_ = 0;
  uint64_t total_ = 0;
};

// A safetensors file opened for reading: the header parsed and checked against the file (every
// dtype known, shape x item size = the bytes of data_offsets, every range inside the data, the
// ranges tiling the data without overlap, gap or tail, as the reference reader requires), data
// read on demand. Errors (DATA_LOSS, NOT_FOUND) name the file and the
// tensor. Not thread-safe.
class SafetensorsReader {
 public:
  explicit SafetensorsReader(const std::filesystem::path& path);
  ~SafetensorsReader();
  SafetensorsReader(SafetensorsReader&& other) noexcept;
  SafetensorsReader(const SafetensorsReader&) = delete;
  SafetensorsReader& operator=(const SafetensorsReader&) = delete;
  SafetensorsReader& operator=(SafetensorsReader&&) = delete;

  const std::vector<SafetensorsTensor>& tensors() const { return tensors_; }  // by begin
  const std::map<std::string, std::string>& metadata() const { return metadata_; }
  const std::filesystem::path& path() const { return path_; }
  // nullptr when the file has no tensor `name`.
  const SafetensorsTensor* Find(std::string_view name) const;
  // `bytes` of tensor `t` from byte `offset` of its data.
  void Read(const SafetensorsTensor& t, uint64_t offset, void* dst, size_t bytes) const;

 private:
  void Load();  // parses and checks the header

  std::filesystem::path path_;
  int fd_ = -1;
  uint64_t data_start_ = 0;
  std::vector<SafetensorsTensor> tensors_;
  std::map<std::string, size_t, std::less<>> by_name_;
  std::map<std::string, std::string> metadata_;
};

}  // namespace cai::ckpt
