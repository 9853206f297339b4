#include "data/token_file.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <bit>
#include <cerrno>
#include <cstring>
#include <fstream>
#include <string>
#include <utility>

#include "core/status.h"

namespace cai::data {
namespace {

// Both layouts are little-endian; reading them in place needs a little-endian host.
static_assert(std::endian::native == std::endian::little, "token files are little-endian");

[[noreturn]] void Fail(cai_status_code code, const std::filesystem::path& path,
                       const std::string& what) {
  throw Error(code, "token file " + path.string() + ": " + what);
}

class Fd {
 public:
  explicit Fd(int fd) : fd_(fd) {}
  ~Fd() {
    if (fd_ >= 0) ::close(fd_);
  }
  Fd(const Fd&) = delete;
  Fd& operator=(const Fd&) = delete;
  int get() const { return fd_; }

 private:
  int fd_;
};

}  // namespace

TokenFile TokenFile::Open(const std::filesystem::path& path, int vocab_size) {
  Fd fd(::open(path.c_str(), O_RDONLY | O_CLOEXEC));
  if (fd.get() < 0) {
    const int err = errno;
    Fail(err == ENOENT ? CAI_NOT_FOUND : CAI_PERMISSION_DENIED, path,
         std::string(std::strerror(err)) + (err == ENOENT ? " (check data.path)" : ""));
  }
  struct stat st {};
  if (::fstat(fd.get(), &st) != 0) Fail(CAI_INTERNAL, path, std::strerror(errno));
  if (!S_ISREG(st.st_mode)) Fail(CAI_INVALID_ARGUMENT, path, "not a regular file");
  const auto size = static_cast<size_t>(st.st_size);

  TokenFile file;
  file.path_ = path;
  if (size > 0) {
    void* map = ::mmap(nullptr, size, PROT_READ, MAP_PRIVATE, fd.get(), 0);
    if (map == MAP_FAILED) Fail(CAI_INTERNAL, path, std::string("mmap: ") + std::strerror(errno));
    file.map_ = map;
    file.map_bytes_ = size;
    // Sampling jumps around the file; readahead of neighbouring pages would be wasted.
    ::madvise(map, size, MADV_RANDOM);
  }
  const auto* bytes = static_cast<const unsigned char*>(file.map_);

  size_t data_offset = 0;
  int32_t magic = 0;
  if (size >= sizeof(magic)) std::memcpy(&magic, bytes, sizeof(magic));
  if (magic == kLlmcMagic) {
    file.layout_ = TokenFileLayout::kLlmc;
    if (size < kLlmcHeaderBytes) {
      Fail(CAI_DATA_LOSS, path,
           "has the llm.c magic but is " + std::to_string(size) +
               " bytes, shorter than the 1024-byte header");
    }
    int32_t header[3];
    std::memcpy(header, bytes, sizeof(header));
    if (header[1] != kLlmcVersion) {
      Fail(CAI_DATA_LOSS, path,
           "llm.c header version " + std::to_string(header[1]) +
               " is not supported (only version 1, uint16 tokens)");
    }
    const auto count = static_cast<uint64_t>(static_cast<uint32_t>(header[2]));
    if (header[2] < 0 || kLlmcHeaderBytes + count * sizeof(Token) != size) {
      Fail(CAI_DATA_LOSS, path,
           "llm.c header says " + std::to_string(header[2]) + " tokens (" +
               std::to_string(kLlmcHeaderBytes + count * sizeof(Token)) +
               " bytes) but the file is " + std::to_string(size) + " bytes");
    }
    data_offset = kLlmcHeaderBytes;
  } else if (size % sizeof(Token) != 0) {
    Fail(CAI_DATA_LOSS, path,
         "size " + std::to_string(size) +
             " bytes is odd, so it is not an array of uint16 tokens (truncated copy?)");
  }

  const size_t count = (size - data_offset) / sizeof(Token);
  // mmap returns page-aligned memory and both data offsets are even, so the cast is aligned.
  file.tokens_ = {reinterpret_cast<const Token*>(bytes + data_offset), count};
  for (size_t i = 0; i < count; ++i) {
    if (file.tokens_[i] >= vocab_size) {
      Fail(CAI_DATA_LOSS, path,
           "token " + std::to_string(i) + " (byte offset " +
               std::to_string(data_offset + i * sizeof(Token)) + ") has id " +
               std::to_string(file.tokens_[i]) + ", not below the vocabulary size " +
               std::to_string(vocab_size) + " (was it made with another tokenizer?)");
    }
  }
  return file;
}

TokenFile::TokenFile(TokenFile&& other) noexcept { *this = std::move(other); }

TokenFile& TokenFile::operator=(TokenFile&& other) noexcept {
  if (this != &other) {
    Unmap();
    path_ = std::move(other.path_);
    layout_ = other.layout_;
    map_ = std::exchange(other.map_, nullptr);
    map_bytes_ = std::exchange(other.map_bytes_, 0);
    tokens_ = std::exchange(other.tokens_, {});
  }
  return *this;
}

TokenFile::~TokenFile() { Unmap(); }

void TokenFile::Unmap() {
  if (map_ != nullptr) ::munmap(map_, map_bytes_);
  map_ = nullptr;
  map_bytes_ = 0;
  tokens_ = {};
}

void WriteTokenFile(const std::filesystem::path& path, std::span<const Token> tokens,
                    TokenFileLayout layout) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  if (!out) Fail(CAI_PERMISSION_DENIED, path, "cannot open for writing");
  if (layout == TokenFileLayout::kLlmc) {
    if (tokens.size() > static_cast<size_t>(INT32_MAX)) {
      Fail(CAI_INVALID_ARGUMENT, path, "llm.c files hold at most 2^31-1 tokens");
    }
    int32_t header[256] = {kLlmcMagic, kLlmcVersion, static_cast<int32_t>(tokens.size())};
    out.write(reinterpret_cast<const char*>(header), sizeof(header));
  }
  out.write(reinterpret_cast<const char*>(tokens.data()),
            static_cast<std::streamsize>(tokens.size_bytes()));
  out.close();
  if (!out) Fail(CAI_DATA_LOSS, path, "write failed (disk full?)");
}

}  // namespace cai::data
