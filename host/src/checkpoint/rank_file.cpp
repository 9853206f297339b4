#include "checkpoint/rank_file.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <bit>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <utility>

#include "core/status.h"

namespace cai::ckpt {
namespace {

static_assert(std::endian::native == std::endian::little,
              "rank files are little-endian and written in place");

constexpr char kMagic[8] = {'C', 'A', 'I', 'C', 'K', 'P', 'T', '1'};
constexpr uint32_t kVersion = 1;
constexpr uint32_t kMaxDims = 8;  // cai_ckpt_tensor_info.shape holds 8

struct Header {
  char magic[8];
  uint32_t version;
  uint32_t rank;
  uint32_t world_size;
  uint32_t reserved0;
  int64_t step;
  uint64_t index_offset;
  uint64_t index_bytes;
  uint64_t entry_count;
  uint64_t reserved1;
};
static_assert(sizeof(Header) == kRankFileHeaderBytes);

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
  if (!names_.insert(static_cast<char>(kind) + name).second) {
    Fail(CAI_ALREADY_EXISTS, path_,
         (kind == EntryKind::kMeta ? "meta key '" : "tensor '") + name + "' is written twice");
  }
  const uint64_t offset = (end_ + kRankFileAlignment - 1) / kRankFileAlignment * kRankFileAlignment;
  end_ = offset + bytes;
  return offset;
}

void RankFileWriter::Write(uint64_t offset, const void* data, size_t bytes) {
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

void RankFileWriter::Add(Entry entry) { entries_.push_back(std::move(entry)); }

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
  Write(end_, index.data(), index.size());
  Write(0, &header, sizeof(header));
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
  if (header.version != kVersion) {
    Fail(CAI_DATA_LOSS, path,
         "has format version " + std::to_string(header.version) + "; this cai reads version " +
             std::to_string(kVersion));
  }
  if (header.index_offset > size || header.index_bytes > size - header.index_offset) {
    Fail(CAI_DATA_LOSS, path, "index lies beyond the end of the file (truncated?)");
  }
  rank_ = static_cast<int>(header.rank);
  world_size_ = static_cast<int>(header.world_size);
  step_ = header.step;

  std::string index(header.index_bytes, '\0');
  Read(header.index_offset, index.data(), index.size());
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
      entries_(std::move(other.entries_)) {}

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
