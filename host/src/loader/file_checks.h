// Checks on plugin files made before (and instead of) running any of their code: content
// hash, ownership and permissions, and what the ELF file links and exports.
#pragma once

#include <filesystem>
#include <string>
#include <vector>

namespace cai {

// SHA-256 of a file's contents, lower-case hex (FIPS 180-4). Throws cai::Error naming the file
// if it cannot be read.
std::string Sha256File(const std::filesystem::path& path);

// Refuses (throws cai::Error, PERMISSION_DENIED, naming the path and the fix) a file or
// directory that is writable by group or others, or owned by neither root nor the effective
// user: anyone who can write it could make the host run their code.
void CheckTrusted(const std::filesystem::path& path);

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
