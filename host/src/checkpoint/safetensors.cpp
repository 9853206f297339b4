#include "checkpoint/safetensors.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <bit>
#include <cerrno>
#include <cstring>
#include <set>
#include <utility>

#include "core/json.h"
#include "core/status.h"

namespace cai::ckpt {
namespace {

static_assert(std::endian::native == std::endian::little, "safetensors is little-endian");

// The reference implementation refuses headers above 100 MB; so do we.
constexpr uint64_t kMaxHeaderBytes = 100'000'000;

struct DtypeName {
  const char* name;
  cai_dtype dtype;
};
constexpr DtypeName kDtypes[] = {
    {"F32", {CAI_DTYPE_FLOAT, 32, 1}}, {"BF16", {CAI_DTYPE_BFLOAT, 16, 1}},
    {"F16", {CAI_DTYPE_FLOAT, 16, 1}}, {"F64", {CAI_DTYPE_FLOAT, 64, 1}},
    {"I64", {CAI_DTYPE_INT, 64, 1}},   {"I32", {CAI_DTYPE_INT, 32, 1}},
    {"I16", {CAI_DTYPE_INT, 16, 1}},   {"I8", {CAI_DTYPE_INT, 8, 1}},
    {"U8", {CAI_DTYPE_UINT, 8, 1}},    {"BOOL", {CAI_DTYPE_BOOL, 8, 1}},
};

[[noreturn]] void Fail(cai_status_code code, const std::filesystem::path& path,
                       const std::string& what) {
  throw Error(code, "safetensors file " + path.string() + ": " + what);
}

std::string ShapeText(const std::vector<int64_t>& shape) {
  std::string s = "[";
  for (size_t i = 0; i < shape.size(); ++i) s += (i ? ", " : "") + std::to_string(shape[i]);
  return s + "]";
}

// numel * item size, or nullopt on overflow.
std::optional<uint64_t> ShapeBytes(const std::vector<int64_t>& shape, cai_dtype dtype) {
  uint64_t n = dtype.bits / 8u;
  for (int64_t d : shape) {
    if (d < 0) return std::nullopt;
    if (d != 0 && n > UINT64_MAX / static_cast<uint64_t>(d)) return std::nullopt;
    n *= static_cast<uint64_t>(d);
  }
  return n;
}

void WriteAll(int fd, const void* data, size_t bytes, const std::filesystem::path& path) {
  const char* p = static_cast<const char*>(data);
  while (bytes > 0) {
    const ssize_t n = ::write(fd, p, bytes);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) Fail(CAI_DATA_LOSS, path, std::string("write: ") + std::strerror(errno));
    p += n;
    bytes -= static_cast<size_t>(n);
  }
}

void ReadAt(int fd, uint64_t offset, void* data, size_t bytes, const std::filesystem::path& path) {
  char* p = static_cast<char*>(data);
  while (bytes > 0) {
    const ssize_t n = ::pread(fd, p, bytes, static_cast<off_t>(offset));
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) Fail(CAI_DATA_LOSS, path, std::string("read: ") + std::strerror(errno));
    if (n == 0) Fail(CAI_DATA_LOSS, path, "truncated");
    p += n;
    offset += static_cast<uint64_t>(n);
    bytes -= static_cast<size_t>(n);
  }
}

}  // namespace

std::optional<cai_dtype> DtypeFromSafetensors(std::string_view name) {
  for (const DtypeName& d : kDtypes) {
    if (name == d.name) return d.dtype;
  }
  return std::nullopt;
}

const char* SafetensorsDtypeName(cai_dtype dtype) {
  for (const DtypeName& d : kDtypes) {
    if (d.dtype.code == dtype.code && d.dtype.bits == dtype.bits && dtype.lanes == 1) {
      return d.name;
    }
  }
  throw Error(CAI_INVALID_ARGUMENT, "dtype {code " + std::to_string(dtype.code) + ", bits " +
                                        std::to_string(dtype.bits) + ", lanes " +
                                        std::to_string(dtype.lanes) + "} has no safetensors name");
}

// ---- Writing ------------------------------------------------------------------------------

SafetensorsWriter::SafetensorsWriter(const std::filesystem::path& path,
                                     std::vector<SafetensorsTensor> tensors,
                                     const std::map<std::string, std::string>& metadata)
    : path_(path), tensors_(std::move(tensors)) {
  std::set<std::string_view> names;
  JsonObject header;
  JsonObject meta;
  for (const auto& [key, value] : metadata) meta.Add(key, value);
  header.AddRaw("__metadata__", meta.str());
  uint64_t offset = 0;
  for (SafetensorsTensor& t : tensors_) {
    if (t.name.empty() || t.name == "__metadata__" || !names.insert(t.name).second) {
      Fail(CAI_ALREADY_EXISTS, path_,
           "tensor name '" + t.name + "' is empty, reserved or repeated");
    }
    const std::optional<uint64_t> bytes = ShapeBytes(t.shape, t.dtype);
    if (!bytes) Fail(CAI_INVALID_ARGUMENT, path_, "tensor '" + t.name + "' has a bad shape");
    std::vector<std::string> dims;
    for (int64_t d : t.shape) dims.push_back(std::to_string(d));
    t.begin = offset;
    t.end = offset + *bytes;
    offset = t.end;
    JsonObject entry;
    entry.Add("dtype", SafetensorsDtypeName(t.dtype));
    entry.AddRaw("shape", JsonArray(dims));
    entry.AddRaw("data_offsets", JsonArray({std::to_string(t.begin), std::to_string(t.end)}));
    header.AddRaw(t.name, entry.str());
  }
  total_ = offset;
  std::string text = header.str();
  // Pad with spaces so the data starts 8-byte aligned, as the reference writer does.
  text.append((8 - (8 + text.size()) % 8) % 8, ' ');
  data_start_ = 8 + text.size();

  fd_ = ::open(path_.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd_ < 0) {
    Fail(CAI_PERMISSION_DENIED, path_, std::string("cannot create: ") + std::strerror(errno));
  }
  const uint64_t n = text.size();
  WriteAll(fd_, &n, sizeof(n), path_);
  WriteAll(fd_, text.data(), text.size(), path_);
}

SafetensorsWriter::~SafetensorsWriter() {
  if (fd_ >= 0) ::close(fd_);
}

void SafetensorsWriter::Append(const void* data, size_t bytes) {
  if (fd_ < 0) Fail(CAI_FAILED_PRECONDITION, path_, "already finished");
  if (bytes > total_ - written_) {
    Fail(CAI_INVALID_ARGUMENT, path_,
         "more data than the header's " + std::to_string(total_) + " bytes");
  }
  WriteAll(fd_, data, bytes, path_);
  written_ += bytes;
}

void SafetensorsWriter::Finish() {
  if (fd_ < 0) Fail(CAI_FAILED_PRECONDITION, path_, "already finished");
  if (written_ != total_) {
    Fail(CAI_FAILED_PRECONDITION, path_,
         std::to_string(written_) + " of " + std::to_string(total_) + " data bytes written");
  }
  if (::fsync(fd_) != 0) Fail(CAI_DATA_LOSS, path_, std::string("fsync: ") + std::strerror(errno));
  const int fd = std::exchange(fd_, -1);
  if (::close(fd) != 0) Fail(CAI_DATA_LOSS, path_, std::string("close: ") + std::strerror(errno));
}

// ---- Reading ------------------------------------------------------------------------------

SafetensorsReader::SafetensorsReader(const std::filesystem::path& path) : path_(path) {
  fd_ = ::open(path_.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd_ < 0) Fail(CAI_NOT_FOUND, path_, std::string("cannot open: ") + std::strerror(errno));
  // A constructor that throws runs no destructor: close here what a malformed file left open.
  try {
    Load();
  } catch (...) {
    ::close(fd_);
    throw;
  }
}

void SafetensorsReader::Load() {
  struct stat st {};
  if (::fstat(fd_, &st) != 0) Fail(CAI_DATA_LOSS, path_, "cannot stat");
  const uint64_t size = static_cast<uint64_t>(st.st_size);
  if (size < 8) Fail(CAI_DATA_LOSS, path_, "shorter than the 8-byte header length");
  uint64_t n = 0;
  ReadAt(fd_, 0, &n, sizeof(n), path_);
  if (n > kMaxHeaderBytes || n > size - 8) {
    Fail(CAI_DATA_LOSS, path_,
         "header length " + std::to_string(n) + " exceeds the file (" + std::to_string(size) +
             " bytes) or the 100 MB limit");
  }
  std::string text(n, '\0');
  ReadAt(fd_, 8, text.data(), n, path_);
  data_start_ = 8 + n;
  const uint64_t data_bytes = size - data_start_;

  JsonValue header;
  try {
    header = ParseJson(text, "header");
  } catch (const Error& e) {
    Fail(CAI_DATA_LOSS, path_, e.what());
  }
  if (header.type != JsonValue::Type::kObject)
    Fail(CAI_DATA_LOSS, path_, "header is not an object");
  for (const auto& [name, entry] : header.object) {
    if (name == "__metadata__") {
      if (entry.type != JsonValue::Type::kObject) {
        Fail(CAI_DATA_LOSS, path_, "__metadata__ is not an object");
      }
      for (const auto& [key, value] : entry.object) {
        if (value.type != JsonValue::Type::kString) {
          Fail(CAI_DATA_LOSS, path_, "__metadata__ '" + key + "' is not a string");
        }
        metadata_[key] = value.string;
      }
      continue;
    }
    const std::string what = "tensor '" + name + "'";
    const JsonValue* dtype = entry.Find("dtype");
    const JsonValue* shape = entry.Find("shape");
    const JsonValue* offsets = entry.Find("data_offsets");
    if (!dtype || dtype->type != JsonValue::Type::kString || !shape ||
        shape->type != JsonValue::Type::kArray || !offsets ||
        offsets->type != JsonValue::Type::kArray || offsets->array.size() != 2) {
      Fail(CAI_DATA_LOSS, path_,
           what +
               " needs \"dtype\" (a string), \"shape\" (an array) and \"data_offsets\" "
               "([begin, end])");
    }
    SafetensorsTensor t;
    t.name = name;
    const std::optional<cai_dtype> d = DtypeFromSafetensors(dtype->string);
    if (!d) {
      Fail(CAI_DATA_LOSS, path_,
           what + " has dtype '" + dtype->string +
               "', which cai does not read (F32, BF16, F16, F64, I64, I32, I16, I8, U8, BOOL)");
    }
    t.dtype = *d;
    for (const JsonValue& dim : shape->array) {
      if (!dim.is_integer || dim.integer < 0) {
        Fail(CAI_DATA_LOSS, path_, what + " has a shape entry that is not a count");
      }
      t.shape.push_back(dim.integer);
    }
    for (const JsonValue& o : offsets->array) {
      if (!o.is_integer || o.integer < 0) {
        Fail(CAI_DATA_LOSS, path_, what + " has a data offset that is not a byte count");
      }
    }
    t.begin = static_cast<uint64_t>(offsets->array[0].integer);
    t.end = static_cast<uint64_t>(offsets->array[1].integer);
    if (t.begin > t.end || t.end > data_bytes) {
      Fail(CAI_DATA_LOSS, path_,
           what + " has data_offsets [" + std::to_string(t.begin) + ", " + std::to_string(t.end) +
               "] outside the " + std::to_string(data_bytes) + " bytes of data");
    }
    const std::optional<uint64_t> expected = ShapeBytes(t.shape, t.dtype);
    if (!expected || *expected != t.bytes()) {
      Fail(CAI_DATA_LOSS, path_,
           what + ": shape " + ShapeText(t.shape) + " of " + dtype->string + " takes " +
               (expected ? std::to_string(*expected) : std::string("too many")) +
               " bytes, but data_offsets span " + std::to_string(t.bytes()));
    }
    tensors_.push_back(std::move(t));
  }
  std::sort(tensors_.begin(), tensors_.end(),
            [](const auto& a, const auto& b) {  // empty tensors before the one they abut
              return a.begin != b.begin ? a.begin < b.begin : a.end < b.end;
            });
  // As the reference reader: the tensors tile the data exactly, no overlap, gap or tail.
  uint64_t covered = 0;
  for (size_t i = 0; i < tensors_.size(); ++i) {
    if (i > 0 && tensors_[i].begin < tensors_[i - 1].end) {
      Fail(CAI_DATA_LOSS, path_,
           "tensors '" + tensors_[i - 1].name + "' and '" + tensors_[i].name + "' overlap");
    }
    if (tensors_[i].begin != covered) {
      Fail(CAI_DATA_LOSS, path_,
           "tensor '" + tensors_[i].name + "' starts at byte " + std::to_string(tensors_[i].begin) +
               " of the data, leaving bytes " + std::to_string(covered) + ".." +
               std::to_string(tensors_[i].begin) + " unaccounted for");
    }
    covered = tensors_[i].end;
    by_name_.emplace(tensors_[i].name, i);
  }
  if (covered != data_bytes) {
    Fail(CAI_DATA_LOSS, path_,
         "the tensors span " + std::to_string(covered) + " bytes of data, the file holds " +
             std::to_string(data_bytes) + " (truncated, or bytes after the last tensor)");
  }
}

SafetensorsReader::~SafetensorsReader() {
  if (fd_ >= 0) ::close(fd_);
}

SafetensorsReader::SafetensorsReader(SafetensorsReader&& other) noexcept
    : path_(std::move(other.path_)),
      fd_(std::exchange(other.fd_, -1)),
      data_start_(other.data_start_),
      tensors_(std::move(other.tensors_)),
      by_name_(std::move(other.by_name_)),
      metadata_(std::move(other.metadata_)) {}

const SafetensorsTensor* SafetensorsReader::Find(std::string_view name) const {
  const auto it = by_name_.find(name);
  return it == by_name_.end() ? nullptr : &tensors_[it->second];
}

void SafetensorsReader::Read(const SafetensorsTensor& t, uint64_t offset, void* dst,
                             size_t bytes) const {
  if (offset > t.bytes() || bytes > t.bytes() - offset) {
    Fail(CAI_OUT_OF_RANGE, path_,
         "bytes [" + std::to_string(offset) + ", " + std::to_string(offset + bytes) +
             ") of tensor '" + t.name + "', which has " + std::to_string(t.bytes()));
  }
  ReadAt(fd_, data_start_ + t.begin + offset, dst, bytes, path_);
}

}  // namespace cai::ckpt
