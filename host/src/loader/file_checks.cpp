#include "loader/file_checks.h"

#include <dlfcn.h>
#include <elf.h>
#include <fcntl.h>
#include <pwd.h>
#include <sys/stat.h>
#include <unistd.h>

#include <array>
#include <cerrno>
#include <cstdint>
#include <cstring>
#include <fstream>
#include <iterator>
#include <utility>

#include "core/status.h"

namespace cai {
namespace {

namespace fs = std::filesystem;

std::vector<char> ReadAll(const fs::path& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw Error(CAI_NOT_FOUND, path.string() + ": cannot be read");
  return std::vector<char>(std::istreambuf_iterator<char>(in), {});
}

// Everything from offset 0 of an open file, whatever its file offset.
std::vector<char> ReadAll(int fd, const fs::path& path) {
  std::vector<char> data;
  char buffer[1 << 16];
  for (;;) {
    const ssize_t n = ::pread(fd, buffer, sizeof buffer, static_cast<off_t>(data.size()));
    if (n == 0) return data;
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) {
      throw Error(CAI_NOT_FOUND, path.string() + ": cannot be read: " + std::strerror(errno));
    }
    data.insert(data.end(), buffer, buffer + n);
  }
}

constexpr std::array<uint32_t, 64> kRound = {
    0x428a2f98, 0x71374491, 0xb5c0fbcf, 0xe9b5dba5, 0x3956c25b, 0x59f111f1, 0x923f82a4, 0xab1c5ed5,
    0xd807aa98, 0x12835b01, 0x243185be, 0x550c7dc3, 0x72be5d74, 0x80deb1fe, 0x9bdc06a7, 0xc19bf174,
    0xe49b69c1, 0xefbe4786, 0x0fc19dc6, 0x240ca1cc, 0x2de92c6f, 0x4a7484aa, 0x5cb0a9dc, 0x76f988da,
    0x983e5152, 0xa831c66d, 0xb00327c8, 0xbf597fc7, 0xc6e00bf3, 0xd5a79147, 0x06ca6351, 0x14292967,
    0x27b70a85, 0x2e1b2138, 0x4d2c6dfc, 0x53380d13, 0x650a7354, 0x766a0abb, 0x81c2c92e, 0x92722c85,
    0xa2bfe8a1, 0xa81a664b, 0xc24b8b70, 0xc76c51a3, 0xd192e819, 0xd6990624, 0xf40e3585, 0x106aa070,
    0x19a4c116, 0x1e376c08, 0x2748774c, 0x34b0bcb5, 0x391c0cb3, 0x4ed8aa4a, 0x5b9cca4f, 0x682e6ff3,
    0x748f82ee, 0x78a5636f, 0x84c87814, 0x8cc70208, 0x90befffa, 0xa4506ceb, 0xbef9a3f7, 0xc67178f2};

uint32_t Rotr(uint32_t x, int n) { return (x >> n) | (x << (32 - n)); }

void Compress(std::array<uint32_t, 8>& h, const unsigned char* block) {
  uint32_t w[64];
  for (int i = 0; i < 16; ++i) {
    w[i] = uint32_t(block[4 * i]) << 24 | uint32_t(block[4 * i + 1]) << 16 |
           uint32_t(block[4 * i + 2]) << 8 | uint32_t(block[4 * i + 3]);
  }
  for (int i = 16; i < 64; ++i) {
    uint32_t s0 = Rotr(w[i - 15], 7) ^ Rotr(w[i - 15], 18) ^ (w[i - 15] >> 3);
    uint32_t s1 = Rotr(w[i - 2], 17) ^ Rotr(w[i - 2], 19) ^ (w[i - 2] >> 10);
    w[i] = w[i - 16] + s0 + w[i - 7] + s1;
  }
  uint32_t a = h[0], b = h[1], c = h[2], d = h[3], e = h[4], f = h[5], g = h[6], hh = h[7];
  for (int i = 0; i < 64; ++i) {
    uint32_t t1 =
        hh + (Rotr(e, 6) ^ Rotr(e, 11) ^ Rotr(e, 25)) + ((e & f) ^ (~e & g)) + kRound[i] + w[i];
    uint32_t t2 = (Rotr(a, 2) ^ Rotr(a, 13) ^ Rotr(a, 22)) + ((a & b) ^ (a & c) ^ (b & c));
    hh = g;
    g = f;
    f = e;
    e = d + t1;
    d = c;
    c = b;
    b = a;
    a = t1 + t2;
  }
  h[0] += a;
  h[1] += b;
  h[2] += c;
  h[3] += d;
  h[4] += e;
  h[5] += f;
  h[6] += g;
  h[7] += hh;
}

std::string Sha256Hex(std::vector<char> data) {
  std::array<uint32_t, 8> h = {0x6a09e667, 0xbb67ae85, 0x3c6ef372, 0xa54ff53a,
                               0x510e527f, 0x9b05688c, 0x1f83d9ab, 0x5be0cd19};
  const uint64_t bit_length = uint64_t(data.size()) * 8;
  data.push_back(char(0x80));
  while (data.size() % 64 != 56) data.push_back(0);
  for (int i = 7; i >= 0; --i) data.push_back(char(bit_length >> (8 * i)));
  for (size_t off = 0; off < data.size(); off += 64) {
    Compress(h, reinterpret_cast<const unsigned char*>(data.data() + off));
  }
  static const char* kHex = "0123456789abcdef";
  std::string hex;
  for (uint32_t word : h) {
    for (int shift = 28; shift >= 0; shift -= 4) hex += kHex[(word >> shift) & 0xf];
  }
  return hex;
}

std::string UserName(uid_t uid) {
  if (const passwd* pw = ::getpwuid(uid)) return pw->pw_name;
  return std::to_string(uid);
}

// The trust rule of CheckTrusted, on a file's status.
void CheckStat(const struct stat& st, const fs::path& path, std::string_view at_stake) {
  const bool is_dir = S_ISDIR(st.st_mode);
  if (st.st_mode & (S_IWGRP | S_IWOTH)) {
    char mode[8];
    std::snprintf(mode, sizeof mode, "%04o", unsigned(st.st_mode & 07777));
    throw Error(CAI_PERMISSION_DENIED, path.string() +
                                           ": refused: " + (is_dir ? "directory" : "file") +
                                           " is writable by group or others (mode " + mode +
                                           "), so anyone could replace " + std::string(at_stake) +
                                           "; run 'chmod go-w " + path.string() + "'");
  }
  if (st.st_uid != 0 && st.st_uid != ::geteuid()) {
    throw Error(CAI_PERMISSION_DENIED,
                path.string() + ": refused: owned by uid " + std::to_string(st.st_uid) +
                    ", which is neither root nor the current user (uid " +
                    std::to_string(::geteuid()) + "), so that user could replace " +
                    std::string(at_stake) + "; run 'sudo chown " + UserName(::geteuid()) + " " +
                    path.string() + "' or install it elsewhere");
  }
}

}  // namespace

std::string Sha256File(const fs::path& path) { return Sha256Hex(ReadAll(path)); }

void CheckTrusted(const fs::path& path, std::string_view at_stake) {
  struct stat st {};
  if (::stat(path.c_str(), &st) != 0) {
    throw Error(CAI_NOT_FOUND, path.string() + ": does not exist");
  }
  CheckStat(st, path, at_stake);
}

CheckedFile CheckedFile::Open(const fs::path& path, std::string_view at_stake) {
  // O_NONBLOCK: a FIFO put where a library should be fails the check below instead of
  // blocking the open; it changes nothing for a regular file.
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK);
  if (fd < 0) {
    throw Error(CAI_NOT_FOUND, path.string() + ": cannot be opened: " + std::strerror(errno));
  }
  CheckedFile file(path, fd);
  struct stat st {};
  if (::fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
    throw Error(CAI_INVALID_ARGUMENT, path.string() + ": not a regular file");
  }
  CheckStat(st, path, at_stake);
  // The directory the opened file is in, links resolved: whoever can write it could have
  // swapped the file before it was opened.
  std::error_code ec;
  const fs::path opened = fs::read_symlink("/proc/self/fd/" + std::to_string(fd), ec);
  CheckTrusted((ec ? fs::absolute(path, ec) : opened).parent_path(), at_stake);
  return file;
}

CheckedFile::CheckedFile(CheckedFile&& other) noexcept
    : path_(std::move(other.path_)), fd_(std::exchange(other.fd_, -1)) {}

CheckedFile::~CheckedFile() {
  if (fd_ >= 0) ::close(fd_);
}

std::string CheckedFile::Sha256() const { return Sha256Hex(ReadAll(fd_, path_)); }

void* CheckedFile::Load() {
  const std::string name = "/proc/self/fd/" + std::to_string(fd_);
  void* handle = ::dlopen(name.c_str(), RTLD_NOW | RTLD_LOCAL);
  if (handle == nullptr) {
    const char* error = ::dlerror();
    std::string why = error ? error : "unknown error";
    // dlerror() names the library by its descriptor; the message already starts with its path.
    if (why.rfind(name + ": ", 0) == 0) why.erase(0, name.size() + 2);
    throw Error(CAI_FAILED_PRECONDITION, path_.string() + ": cannot be loaded: " + why);
  }
  fd_ = -1;  // kept open for good: see the header
  return handle;
}

ElfInfo ReadElfInfo(const fs::path& path) {
  std::vector<char> bytes = ReadAll(path);
  auto bad = [&](const std::string& why) {
    throw Error(CAI_INVALID_ARGUMENT, path.string() + ": not a usable ELF shared object: " + why);
  };
  if (bytes.size() < sizeof(Elf64_Ehdr) || std::memcmp(bytes.data(), ELFMAG, SELFMAG) != 0) {
    bad("bad magic");
  }
  Elf64_Ehdr eh;
  std::memcpy(&eh, bytes.data(), sizeof eh);
  if (eh.e_ident[EI_CLASS] != ELFCLASS64 || eh.e_ident[EI_DATA] != ELFDATA2LSB) {
    bad("only 64-bit little-endian objects are supported");
  }
  if (eh.e_type != ET_DYN) bad("not a shared object (ET_DYN)");
  auto section = [&](size_t index) {
    Elf64_Shdr sh;
    size_t off = eh.e_shoff + index * eh.e_shentsize;
    if (off + sizeof sh > bytes.size()) bad("section header out of range");
    std::memcpy(&sh, bytes.data() + off, sizeof sh);
    if (sh.sh_type != SHT_NOBITS && sh.sh_offset + sh.sh_size > bytes.size()) {
      bad("section out of range");
    }
    return sh;
  };
  auto string_at = [&](const Elf64_Shdr& strtab, size_t offset) {
    if (offset >= strtab.sh_size) bad("string out of range");
    const char* begin = bytes.data() + strtab.sh_offset + offset;
    return std::string(begin, strnlen(begin, strtab.sh_size - offset));
  };
  ElfInfo info;
  for (size_t i = 0; i < eh.e_shnum; ++i) {
    Elf64_Shdr sh = section(i);
    if (sh.sh_type == SHT_DYNAMIC) {
      Elf64_Shdr strtab = section(sh.sh_link);
      for (size_t off = 0; off + sizeof(Elf64_Dyn) <= sh.sh_size; off += sizeof(Elf64_Dyn)) {
        Elf64_Dyn dyn;
        std::memcpy(&dyn, bytes.data() + sh.sh_offset + off, sizeof dyn);
        if (dyn.d_tag == DT_NULL) break;
        if (dyn.d_tag == DT_NEEDED) info.needed.push_back(string_at(strtab, dyn.d_un.d_val));
      }
    } else if (sh.sh_type == SHT_DYNSYM) {
      Elf64_Shdr strtab = section(sh.sh_link);
      for (size_t off = sizeof(Elf64_Sym); off + sizeof(Elf64_Sym) <= sh.sh_size;
           off += sizeof(Elf64_Sym)) {
        Elf64_Sym sym;
        std::memcpy(&sym, bytes.data() + sh.sh_offset + off, sizeof sym);
        const int bind = ELF64_ST_BIND(sym.st_info);
        const int type = ELF64_ST_TYPE(sym.st_info);
        if (sym.st_shndx == SHN_UNDEF || (bind != STB_GLOBAL && bind != STB_WEAK)) continue;
        if (ELF64_ST_VISIBILITY(sym.st_other) != STV_DEFAULT || type == STT_SECTION) continue;
        info.exported_symbols.push_back(string_at(strtab, sym.st_name));
      }
    }
  }
  return info;
}

bool IsForbiddenPluginDependency(const std::string& needed) {
  for (const char* prefix : {"libtorch", "libc10", "libcudart", "libcuda.", "libnccl", "libgloo",
                             "libmpi", "libcai_host"}) {
    if (needed.rfind(prefix, 0) == 0) return true;
  }
  return false;
}

}  // namespace cai
