// One rank's file of a checkpoint (rank-00000.cait): a fixed header, the entries' bytes, then
// an index. Everything little-endian.
//
//   offset 0, 64 bytes: "CAICKPT1", u32 version = 1, u32 rank, u32 world_size, u32 0,
//                       i64 step, u64 index_offset, u64 index_bytes, u64 entry_count, 8 x 0
//   entries' bytes, each starting at a multiple of 64 (so a reader can mmap and vector-load)
//   index, one record per entry: u8 kind (0 tensor, 1 meta), u8 dtype code, u8 dtype bits,
//                       u8 0, u16 lanes, u16 0, u32 ndim, u32 name length, name bytes,
//                       i64 shape[ndim], u64 data offset, u64 data bytes
//
// The index goes last so tensors stream to disk as the strategy produces them; the header is
// written after the index, so a file cut short has no valid magic.
#pragma once

#include <cstdint>
#include <filesystem>
#include <string>
#include <unordered_set>
#include <vector>

#include "cai/core.h"

namespace cai::ckpt {

enum class EntryKind : uint8_t { kTensor = 0, kMeta = 1 };

struct Entry {
  EntryKind kind = EntryKind::kTensor;
  std::string name;
  cai_dtype dtype{CAI_DTYPE_UINT, 8, 1};  // meta values are uint8 bytes
  std::vector<int64_t> shape;
  uint64_t offset = 0;
  uint64_t bytes = 0;
};

inline constexpr size_t kRankFileHeaderBytes = 64;
inline constexpr size_t kRankFileAlignment = 64;

std::string RankFileName(int rank);  // "rank-00003.cait"

// Not thread-safe.
class RankFileWriter {
 public:
  RankFileWriter(const std::filesystem::path& path, int rank, int world_size, int64_t step);
  ~RankFileWriter();
  RankFileWriter(const RankFileWriter&) = delete;
  RankFileWriter& operator=(const RankFileWriter&) = delete;

  // Reserves `bytes` for a new entry and returns their file offset; the caller fills them
  // with Write() and then calls Add(). Tensors and meta entries have separate names;
  // ALREADY_EXISTS for a name used twice within one kind.
  uint64_t Reserve(EntryKind kind, const std::string& name, uint64_t bytes);
  void Write(uint64_t offset, const void* data, size_t bytes);
  void Add(Entry entry);

  // Writes index and header, fsyncs and closes. Nothing may be written afterwards.
  void Finish();

  const std::filesystem::path& path() const { return path_; }

 private:
  std::filesystem::path path_;
  int fd_ = -1;
  int rank_;
  int world_size_;
  int64_t step_;
  uint64_t end_ = kRankFileHeaderBytes;
  std::vector<Entry> entries_;
  std::unordered_set<std::string> names_;
};

// A rank file opened for reading: header and index parsed, data read on demand.
class RankFileReader {
 public:
  // Throws cai::Error (DATA_LOSS, NOT_FOUND) naming the file when it is missing, truncated
  // or malformed.
  explicit RankFileReader(const std::filesystem::path& path);
  ~RankFileReader();
  RankFileReader(RankFileReader&& other) noexcept;
  RankFileReader(const RankFileReader&) = delete;
  RankFileReader& operator=(const RankFileReader&) = delete;
  RankFileReader& operator=(RankFileReader&&) = delete;

  int rank() const { return rank_; }
  int world_size() const { return world_size_; }
  int64_t step() const { return step_; }
  const std::vector<Entry>& entries() const { return entries_; }
  const std::filesystem::path& path() const { return path_; }

  void Read(uint64_t offset, void* data, size_t bytes) const;

 private:
  void Load();

  std::filesystem::path path_;
  int fd_ = -1;
  int rank_ = 0;
  int world_size_ = 0;
  int64_t step_ = 0;
  std::vector<Entry> entries_;
};

}  // namespace cai::ckpt
