// Checks on plugin files made before (and instead of) running any of their code: content
// hash, ownership and permissions, and what the ELF file links and exports; and loading code
// from the very file that was checked.
#pragma once

#include <filesystem>
#include <string>
#include <string_view>
#include <vector>

namespace cai {

// SHA-256 of a file's contents, lower-case hex (FIPS 180-4). Throws cai::Error naming the file
// if it cannot be read.
std::string Sha256File(const std::filesystem::path& path);

// Refuses (throws cai::Error, PERMISSION_DENIED, naming the path and the fix) a file or
// directory that is writable by group or others, or owned by neither root nor the effective
// user: anyone who can write it could make the host run their code. `at_stake` names that code
// in the message. NOT_FOUND when the path does not exist.
void CheckTrusted(const std::filesystem::path& path, std::string_view at_stake = "the plugin code");

// A file opened once (O_RDONLY | O_CLOEXEC) and checked through that descriptor, so that what
// is hashed and loaded is what was checked even if its path is replaced in between: Load()
// maps the very inode that was checked, not whatever the path names by then. Move-only;
// closes the descriptor unless Load() kept it.
class CheckedFile {
 public:
  // Opens `path` and refuses it as CheckTrusted does: the file by fstat on the descriptor, and
  // the directory that holds it (symbolic links resolved). Throws cai::Error whose message
  // starts with the path: NOT_FOUND (cannot be opened), INVALID_ARGUMENT (not a regular
  // file), PERMISSION_DENIED (untrusted, with the chmod or chown to run).
  static CheckedFile Open(const std::filesystem::path& path,
                          std::string_view at_stake = "the plugin code");
  CheckedFile(CheckedFile&& other) noexcept;
  CheckedFile& operator=(CheckedFile&&) = delete;
  ~CheckedFile();

  const std::filesystem::path& path() const { return path_; }  // as given to Open()
  int fd() const { return fd_; }

  // SHA-256 of the contents, read through the descriptor, lower-case hex.
  std::string Sha256() const;

  // dlopen(RTLD_NOW | RTLD_LOCAL) of /proc/self/fd/<fd>. The descriptor then stays open for
  // the life of the process: loaded code is never unloaded, and the dynamic loader knows the
  // library by that name, which must therefore never come to mean another file. A library
  // whose inode is already loaded yields the existing handle. $ORIGIN in the library's
  // RUNPATH means /proc/self/fd, so its dependencies come from the loader's path. Throws
  // cai::Error (FAILED_PRECONDITION) naming the path and the dynamic loader's reason.
  void* Load();

 private:
  CheckedFile(std::filesystem::path path, int fd) : path_(std::move(path)), fd_(fd) {}
  std::filesystem::path path_;
  int fd_ = -1;
};

struct ElfInfo {
  std::vector<std::string> needed;            // DT_NEEDED entries
  std::vector<std::string> exported_symbols;  // defined, global/weak, default-visible dynsyms
};

// Reads the dynamic section and dynamic symbol table of a 64-bit little-endian ELF shared
// object. Throws cai::Error naming the file when it is not one.
ElfInfo ReadElfInfo(const std::filesystem::path& path);

// Libraries a plugin must not link: they are host services (docs/abi-contract.md).
bool IsForbiddenPluginDependency(const std::string& needed);

}  // namespace cai
