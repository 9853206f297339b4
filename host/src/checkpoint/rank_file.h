// One rank's file of a checkpoint (rank-00000.cait): a fixed header, the entries' bytes, then
// an index. Everything little-endian.
//
//   offset 0, 64 bytes: "CAICKPT1", u32 version = 2, u32 rank, u32 world_size,
//                       u32 checksum block bytes, i64 step, u64 index_offset, u64 index_bytes,
//                       u64 entry_count, u32 CRC32C of the index, u32 CRC32C of bytes [0, 60)
//   entries' bytes, each starting at a multiple of 64 (so a reader can mmap and vector-load)
//   index, one record per entry: u8 kind (0 tensor, 1 meta), u8 dtype code, u8 dtype bits,
//                       u8 0, u16 lanes, u16 0, u32 ndim, u32 name length, name bytes,
//                       i64 shape[ndim], u64 data offset, u64 data bytes,
//                       u32 crc32c[ceil(data bytes / checksum block bytes)]
//
// Version 1 files (cai 0.x before checksums) have the same layout with the checksum block
// bytes and both header CRCs 0 and no crc32c array; they still load, unverified.
//
// Checksums: an entry's data is cut into blocks of kChecksumBlockBytes (the last one shorter)
// and each block has its CRC32C in the index. Blocks rather than one CRC per entry because
// strategies read byte ranges of an entry: a sharded load reads 1/N of each tensor on each of
// N ranks. With one CRC per entry every rank would read (and checksum) every whole tensor,
// N times the bytes the load needs; with blocks a read verifies the blocks it touches and
// reads at most one extra partial block at each end (2 x 64 KiB per read). The cost is 4
// bytes of index per 64 KiB of data (0.006%). An entry no longer than a block has one CRC:
// that of the whole entry.
//
// The index goes last so tensors stream to disk as the strategy produces them; the header is
// written after the index, so a file cut short has no valid magic.
#pragma once

#include <cstdint>
#include <filesystem>
#include <optional>
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
  // CRC32C of each checksum block of the data; empty in a version 1 file. Filled by the
  // writer; callers of Add() leave it empty.
  std::vector<uint32_t> block_crc32c;
};

inline constexpr size_t kRankFileHeaderBytes = 64;
inline constexpr size_t kRankFileAlignment = 64;
inline constexpr uint32_t kChecksumBlockBytes = 64 * 1024;

std::string RankFileName(int rank);  // "rank-00003.cait"

// Not thread-safe.
class RankFileWriter {
 public:
  RankFileWriter(const std::filesystem::path& path, int rank, int world_size, int64_t step);
  ~RankFileWriter();
  RankFileWriter(const RankFileWriter&) = delete;
  RankFileWriter& operator=(const RankFileWriter&) = delete;

  // Reserves `bytes` for a new entry and returns their file offset; the caller fills them
  // with Write() and then calls Add() (an entry reserved and never added is left out). Tensors and
  // meta entries have separate names; ALREADY_EXISTS for a name used twice within one kind.
  uint64_t Reserve(EntryKind kind, const std::string& name, uint64_t bytes);
  // Writes the next `bytes` of the entry last reserved: writes go in order, from its offset
  // on, and the checksums are computed from `data` as it goes to disk (no second pass).
  void Write(uint64_t offset, const void* data, size_t bytes);
  // Records the entry last reserved, once all its bytes are written, with their checksums.
  void Add(Entry entry);

  // Writes index and header, fsyncs and closes. Nothing may be written afterwards.
  void Finish();

  const std::filesystem::path& path() const { return path_; }

 private:
  void WriteAt(uint64_t offset, const void* data, size_t bytes);

  std::filesystem::path path_;
  int fd_ = -1;
  int rank_;
  int world_size_;
  int64_t step_;
  uint64_t end_ = kRankFileHeaderBytes;
  std::vector<Entry> entries_;
  std::unordered_set<std::string> names_;
  // The entry between Reserve() and Add(): where its next byte goes, and its checksums so far.
  struct Open {
    uint64_t offset = 0;
    uint64_t bytes = 0;
    uint64_t written = 0;
    uint32_t block_crc = 0;  // of the bytes written into the current block
    std::vector<uint32_t> block_crc32c;
  };
  std::optional<Open> open_;
};

// A rank file opened for reading: header and index parsed, data read on demand.
class RankFileReader {
 public:
  // Throws cai::Error (DATA_LOSS, NOT_FOUND) naming the file when it is missing, truncated
  // or malformed, or its header or index does not match its checksum.
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
  // 1 (no checksums) or 2.
  uint32_t version() const { return version_; }

  // Reads bytes [begin, begin + bytes) of `entry`'s data (one of entries()) into `data`,
  // after checking the CRC32C of every checksum block they lie in. Throws cai::Error
  // DATA_LOSS naming the file and the entry when a block does not match (`data` may then
  // hold some of the bytes read) or the file is shorter than its index says.
  void ReadEntry(const Entry& entry, uint64_t begin, void* data, size_t bytes) const;

 private:
  void Load();
  void Read(uint64_t offset, void* data, size_t bytes) const;
  [[noreturn]] void Damaged(const Entry& entry, uint64_t block) const;

  std::filesystem::path path_;
  int fd_ = -1;
  int rank_ = 0;
  int world_size_ = 0;
  int64_t step_ = 0;
  uint32_t version_ = 0;
  uint32_t block_bytes_ = 0;  // 0: version 1, nothing to verify
  std::vector<Entry> entries_;
};

}  // namespace cai::ckpt
