// Plugin manifests (<name>.toml beside the .so): parsed and checked without loading anything.
#pragma once

#include <cstdint>
#include <filesystem>
#include <optional>
#include <string>
#include <vector>

namespace cai {

struct Manifest {
  std::filesystem::path path;  // the manifest file, absolute
  int64_t manifest_version = 0;
  std::string name;  // [a-z0-9_-]+, unique among loaded plugins
  std::string kind;  // "strategy"
  std::string version;
  std::string license;  // SPDX identifier
  std::string description;
  std::filesystem::path library;      // absolute: manifest dir / library.path
  std::string entry;                  // "cai_plugin_init_v1"
  std::optional<std::string> sha256;  // lower-case hex, checked before dlopen
  int64_t abi_major = 0;
  int64_t min_host_minor = 0;
  struct Capabilities {
    std::vector<std::string> precisions;  // of "fp32", "bf16", "fp16"
    bool no_sync = false;
    bool cpu_offload = false;
    bool pipeline = false;
    bool sharded_checkpoint = false;
    bool tensor_parallel = false;
  } capabilities;
};

// The manifest format this host reads.
inline constexpr int64_t kManifestVersion = 1;

// Parses and checks a manifest: syntax, required keys and types, unknown keys (naming the
// nearest valid one), a library path that stays in the manifest's directory, the ABI major
// and minimum host minor against this host. Throws cai::Error whose message starts with the
// manifest's path.
Manifest ParseManifest(const std::filesystem::path& path);

}  // namespace cai
