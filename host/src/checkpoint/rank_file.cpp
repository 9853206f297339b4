#include "checkpoint/rank_file.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <bit>
#include <cerrno>
#include <cstddef>
#include <cstdio>
#include <cstring>
#include <utility>

#include "checkpoint/crc32c.h"
#include "core/status.h"

namespace cai::ckpt {
namespace {

static_assert(std::endian::native == std::endian::little,
              "rank files are little-endian and written in place");

constexpr char kMagic[8] = {'C', 'A', 'I', 'C', 'K', 'P', 'T', '1'};
constexpr uint32_t kVersion = 2;
constexpr uint32_t kOldestVersion = 1;  // no checksums
constexpr uint32_t kMaxDims = 8;        // cai_ckpt_tensor_info.shape holds 8

struct Header {
  char magic[8];
  uint32_t version;
  uint32_t rank;
  uint32_t world_size;
  uint32_t checksum_block_bytes;  // 0 in version 1
  int64_t step;
  uint64_t index_offset;
  uint64_t index_bytes;
  uint64_t entry_count;
  uint32_t index_crc32c;   // 0 in version 1
  uint32_t header_crc32c;  // of the bytes before it; 0 in version 1
};
static_assert(sizeof(Header) == kRankFileHeaderBytes);
static_assert(offsetof(Header, header_crc32c) == 60);

uint32_t HeaderCrc(const Header& h) { return Crc32c(0, &h, offsetof(Header, header_crc32c)); }

uint64_t BlockCount(uint64_t bytes, uint64_t block) { return (bytes + block - 1) / block; }

[[noreturn]] void Fail(cai_status_code code, const std::filesystem::path& path,
                       const std::string& what) {
  throw Error(code, "checkpoint file " + path.string() + ": " + what);
}

template <class T>
void Put(std::string& out, T value) {
  out.append(reinterpret_cast<const char*>(&value), sizeof(value));
}

// Reads the index with bounds checks; any overrun is a malformed file.
class Cursor {
 public:
  Cursor(const std::string& data, const std::filesystem::path& path) : data_(data), path_(path) {}
  template <class T>
  T Get() {
    T value;
    std::memcpy(&value, Take(sizeof(T)), sizeof(T));
    return value;
  }
  std::string GetString(size_t n) { return std::string(Take(n), n); }

 private:
  const char* Take(size_t n) {
    if (n > data_.size() - pos_) Fail(CAI_DATA_LOSS, path_, "index is truncated");
    const char* p = data_.data() + pos_;
    pos_ += n;
    return p;
  }
  const std::string& data_;
  const std::filesystem::path& path_;
  size_t pos_ = 0;
};

}  // namespace

std::string RankFileName(int rank) {
  char name[32];
  std::snprintf(name, sizeof(name), "rank-%05d.cait", rank);
  return name;
}

RankFileWriter::RankFileWriter(const std::filesystem::path& path, int rank, int world_size,
                               int64_t step)
    : path_(path), rank_(rank), world_size_(world_size), step_(step) {
  fd_ = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd_ < 0) {
    Fail(CAI_PERMISSION_DENIED, path, std::string("cannot create: ") + std::strerror(errno));
  }
}

RankFileWriter::~RankFileWriter() {
  if (fd_ >= 0) ::close(fd_);
}

uint64_t RankFileWriter::Reserve(EntryKind kind, const std::string& name, uint64_t bytes) {
  open_.reset();  // an entry whose writing failed is never added; its bytes stay unused
  if (!names_.insert(static_cast<char>(kind) + name).second) {
    Fail(CAI_ALREADY_EXISTS, path_,
         (kind == EntryKind::kMeta ? "meta key '" : "tensor '") + name + "' is written twice");
  }
  const uint64_t offset = (end_ + kRankFileAlignment - 1) / kRankFileAlignment * kRankFileAlignment;
  end_ = offset + bytes;
  open_ = Open{};
  open_->offset = offset;
  open_->bytes = bytes;
  return offset;
}

void RankFileWriter::Write(uint64_t offset, const void* data, size_t bytes) {
  if (!open_ || offset != open_->offset + open_->written || bytes > open_->bytes - open_->written) {
    Fail(CAI_INTERNAL, path_,
         "write of " + std::to_string(bytes) + " bytes at " + std::to_string(offset) +
             " is not the next part of the entry last reserved");
  }
  // Checksum each block's part from `data` while it is in cache, just before it is written.
  Open& e = *open_;
  const auto* p = static_cast<const char*>(data);
  for (size_t done = 0; done < bytes;) {
    const uint64_t in_block = e.written % kChecksumBlockBytes;
    const size_t n = std::min<uint64_t>(bytes - done, kChecksumBlockBytes - in_block);
    e.block_crc = Crc32c(in_block == 0 ? 0 : e.block_crc, p + done, n);
    done += n;
    e.written += n;
    if (e.written % kChecksumBlockBytes == 0 || e.written == e.bytes) {
      e.block_crc32c.push_back(e.block_crc);
    }
  }
  WriteAt(offset, data, bytes);
}

void RankFileWriter::WriteAt(uint64_t offset, const void* data, size_t bytes) {
  const auto* p = static_cast<const char*>(data);
  while (bytes > 0) {
    const ssize_t n = ::pwrite(fd_, p, bytes, static_cast<off_t>(offset));
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) Fail(CAI_DATA_LOSS, path_, std::string("write failed: ") + std::strerror(errno));
    p += n;
    offset += static_cast<uint64_t>(n);
    bytes -= static_cast<size_t>(n);
  }
}

void RankFileWriter::Add(Entry entry) {
  if (!open_ || entry.offset != open_->offset || entry.bytes != open_->bytes ||
      open_->written != open_->bytes) {
    Fail(CAI_INTERNAL, path_, "'" + entry.name + "' added before all its bytes were written");
  }
  entry.block_crc32c = std::move(open_->block_crc32c);
  open_.reset();
  entries_.push_back(std::move(entry));
}

void RankFileWriter::Finish() {
  std::string index;
  for (const Entry& e : entries_) {
    Put<uint8_t>(index, static_cast<uint8_t>(e.kind));
    Put<uint8_t>(index, e.dtype.code);
    Put<uint8_t>(index, e.dtype.bits);
    Put<uint8_t>(index, 0);
    Put<uint16_t>(index, e.dtype.lanes);
    Put<uint16_t>(index, 0);
    Put<uint32_t>(index, static_cast<uint32_t>(e.shape.size()));
    Put<uint32_t>(index, static_cast<uint32_t>(e.name.size()));
    index += e.name;
    for (int64_t d : e.shape) Put<int64_t>(index, d);
    Put<uint64_t>(index, e.offset);
    Put<uint64_t>(index, e.bytes);
    for (uint32_t crc : e.block_crc32c) Put<uint32_t>(index, crc);
  }
  Header header{};
  std::memcpy(header.magic, kMagic, sizeof(kMagic));
  header.version = kVersion;
  header.rank = static_cast<uint32_t>(rank_);
  header.world_size = static_cast<uint32_t>(world_size_);
  header.step = step_;
  header.index_offset = end_;
  header.index_bytes = index.size();
  header.entry_count = entries_.size();
  header.checksum_block_bytes = kChecksumBlockBytes;
  header.index_crc32c = Crc32c(0, index.data(), index.size());
  header.header_crc32c = HeaderCrc(header);
  WriteAt(end_, index.data(), index.size());
  WriteAt(0, &header, sizeof(header));
  if (::fsync(fd_) != 0) Fail(CAI_DATA_LOSS, path_, std::string("fsync: ") + std::strerror(errno));
  const int fd = std::exchange(fd_, -1);
  if (::close(fd) != 0) Fail(CAI_DATA_LOSS, path_, std::string("close: ") + std::strerror(errno));
}

RankFileReader::RankFileReader(const std::filesystem::path& path) : path_(path) {
  fd_ = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd_ < 0) {
    const int err = errno;
    Fail(err == ENOENT ? CAI_DATA_LOSS : CAI_PERMISSION_DENIED, path,
         std::string(std::strerror(err)) +
             (err == ENOENT ? " (the checkpoint is missing a rank's file)" : ""));
  }
  try {
    Load();
  } catch (...) {
    ::close(fd_);
    throw;
  }
}

void RankFileReader::Load() {
  const std::filesystem::path& path = path_;
  struct stat st {};
  if (::fstat(fd_, &st) != 0) Fail(CAI_INTERNAL, path, std::strerror(errno));
  const auto size = static_cast<uint64_t>(st.st_size);
  if (size < sizeof(Header)) {
    Fail(CAI_DATA_LOSS, path, "is " + std::to_string(size) + " bytes, shorter than its header");
  }
  Header header{};
  Read(0, &header, sizeof(header));
  if (std::memcmp(header.magic, kMagic, sizeof(kMagic)) != 0) {
    Fail(CAI_DATA_LOSS, path, "is not a cai checkpoint file (bad magic)");
  }
  if (header.version < kOldestVersion || header.version > kVersion) {
    Fail(CAI_DATA_LOSS, path,
         "has format version " + std::to_string(header.version) + "; this cai reads versions " +
             std::to_string(kOldestVersion) + " to " + std::to_string(kVersion) +
             (header.version > kVersion ? " (written by a newer cai?)" : ""));
  }
  if (header.version >= 2) {
    if (header.header_crc32c != HeaderCrc(header)) {
      Fail(CAI_DATA_LOSS, path, "header does not match its checksum: the file is damaged");
    }
    if (header.checksum_block_bytes == 0)
      Fail(CAI_DATA_LOSS, path, "has checksum blocks of 0 bytes");
  }
  version_ = header.version;
  block_bytes_ = header.version >= 2 ? header.checksum_block_bytes : 0;
  if (header.index_offset > size || header.index_bytes > size - header.index_offset) {
    Fail(CAI_DATA_LOSS, path, "index lies beyond the end of the file (truncated?)");
  }
  rank_ = static_cast<int>(header.rank);
  world_size_ = static_cast<int>(header.world_size);
  step_ = header.step;

  std::string index(header.index_bytes, '\0');
  Read(header.index_offset, index.data(), index.size());
  if (block_bytes_ != 0 && Crc32c(0, index.data(), index.size()) != header.index_crc32c) {
    Fail(CAI_DATA_LOSS, path,
         "index (bytes " + std::to_string(header.index_offset) +
             " to the end) does not match its "
             "checksum: the file is damaged");
  }
  Cursor cursor(index, path_);
  for (uint64_t i = 0; i < header.entry_count; ++i) {
    Entry e;
    e.kind = static_cast<EntryKind>(cursor.Get<uint8_t>());
    e.dtype.code = cursor.Get<uint8_t>();
    e.dtype.bits = cursor.Get<uint8_t>();
    cursor.Get<uint8_t>();
    e.dtype.lanes = cursor.Get<uint16_t>();
    cursor.Get<uint16_t>();
    const auto ndim = cursor.Get<uint32_t>();
    const auto name_length = cursor.Get<uint32_t>();
    if (ndim > kMaxDims)
      Fail(CAI_DATA_LOSS, path, "an entry has " + std::to_string(ndim) + " dims");
    e.name = cursor.GetString(name_length);
    for (uint32_t d = 0; d < ndim; ++d) e.shape.push_back(cursor.Get<int64_t>());
    e.offset = cursor.Get<uint64_t>();
    e.bytes = cursor.Get<uint64_t>();
    if (e.offset > header.index_offset || e.bytes > header.index_offset - e.offset) {
      Fail(CAI_DATA_LOSS, path, "data of '" + e.name + "' lies outside the file");
    }
    if (block_bytes_ != 0) {
      const uint64_t blocks = BlockCount(e.bytes, block_bytes_);
      if (blocks > index.size() / sizeof(uint32_t)) Fail(CAI_DATA_LOSS, path, "index is truncated");
      e.block_crc32c.resize(blocks);
      for (uint32_t& crc : e.block_crc32c) crc = cursor.Get<uint32_t>();
    }
    entries_.push_back(std::move(e));
  }
}

RankFileReader::~RankFileReader() {
  if (fd_ >= 0) ::close(fd_);
}

RankFileReader::RankFileReader(RankFileReader&& other) noexcept
    : path_(std::move(other.path_)),
      fd_(std::exchange(other.fd_, -1)),
      rank_(other.rank_),
      world_size_(other.world_size_),
      step_(other.step_),
      version_(other.version_),
      block_bytes_(other.block_bytes_),
      entries_(std::move(other.entries_)) {}

void RankFileReader::ReadEntry(const Entry& e, uint64_t begin, void* data, size_t bytes) const {
  if (begin > e.bytes || bytes > e.bytes - begin) {
    Fail(CAI_OUT_OF_RANGE, path_,
         "bytes [" + std::to_string(begin) + ", " + std::to_string(begin + bytes) + ") of '" +
             e.name + "', which has " + std::to_string(e.bytes));
  }
  if (bytes == 0) return;
  if (block_bytes_ == 0) {  // version 1: nothing to check against
    Read(e.offset + begin, data, bytes);
    return;
  }
  // Blocks wholly inside the range are read straight into `data` in one go and checked there;
  // a block the range covers only in part is read whole into `partial`, checked, and the part
  // copied out.
  auto* out = static_cast<char*>(data);
  const uint64_t end = begin + bytes;
  const uint64_t block = block_bytes_;
  std::vector<char> partial;
  for (uint64_t b = begin / block; b * block < end;) {
    const uint64_t block_begin = b * block;
    const uint64_t block_end = std::min(block_begin + block, e.bytes);
    if (block_begin >= begin && block_end <= end) {
      uint64_t run_end = block_end;  // the run of whole blocks from b on
      uint64_t last = b;
      while (run_end < end && std::min(run_end + block, e.bytes) <= end) {
        run_end = std::min(run_end + block, e.bytes);
        ++last;
      }
      char* dst = out + (block_begin - begin);
      Read(e.offset + block_begin, dst, run_end - block_begin);
      for (uint64_t k = b; k <= last; ++k) {
        const uint64_t k_begin = k * block;
        const uint64_t k_bytes = std::min(k_begin + block, e.bytes) - k_begin;
        if (Crc32c(0, dst + (k_begin - block_begin), k_bytes) != e.block_crc32c[k]) Damaged(e, k);
      }
      b = last + 1;
      continue;
    }
    partial.resize(block_end - block_begin);
    Read(e.offset + block_begin, partial.data(), partial.size());
    if (Crc32c(0, partial.data(), partial.size()) != e.block_crc32c[b]) Damaged(e, b);
    const uint64_t from = std::max(begin, block_begin);
    const uint64_t to = std::min(end, block_end);
    std::memcpy(out + (from - begin), partial.data() + (from - block_begin), to - from);
    ++b;
  }
}

void RankFileReader::Damaged(const Entry& e, uint64_t block) const {
  const uint64_t first = block * block_bytes_;
  const uint64_t last = std::min(first + block_bytes_, e.bytes);
  Fail(CAI_DATA_LOSS, path_,
       std::string(e.kind == EntryKind::kMeta ? "meta entry '" : "tensor '") + e.name +
           "' is damaged: bytes " + std::to_string(first) + " to " + std::to_string(last) +
           " of its data (file offset " + std::to_string(e.offset + first) +
           ") do not match the CRC32C saved with them");
}

void RankFileReader::Read(uint64_t offset, void* data, size_t bytes) const {
  auto* p = static_cast<char*>(data);
  while (bytes > 0) {
    const ssize_t n = ::pread(fd_, p, bytes, static_cast<off_t>(offset));
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      Fail(CAI_DATA_LOSS, path_,
           "short read at byte " + std::to_string(offset) +
               (n < 0 ? std::string(": ") + std::strerror(errno) : std::string(" (truncated?)")));
    }
    p += n;
    offset += static_cast<uint64_t>(n);
    bytes -= static_cast<size_t>(n);
  }
}

}  // namespace cai::ckpt
