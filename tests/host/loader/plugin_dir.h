// Throwaway plugin directories for the loader's tests: fixture libraries copied in beside
// manifests written by the test.
#pragma once

#include <stdlib.h>
#include <sys/stat.h>

#include <filesystem>
#include <fstream>
#include <string>

#include "util/subprocess.h"

namespace cai::testing {

// A manifest naming `library` beside it; the other arguments replace or add TOML lines.
inline std::string ManifestText(const std::string& name, const std::string& library,
                                const std::string& extra_plugin = "",
                                const std::string& abi = "major = 1\nmin_host_minor = 0",
                                const std::string& extra_library = "") {
  return "manifest_version = 1\n[plugin]\nname = \"" + name +
         "\"\nkind = \"strategy\"\nversion = \"1.0.0\"\nlicense = \"Apache-2.0\"\n"
         "description = \"test\"\n" +
         extra_plugin + "[library]\npath = \"" + library + "\"\nentry = \"cai_plugin_init_v1\"\n" +
         extra_library + "[abi]\n" + abi + "\n[capabilities]\nprecisions = [\"fp32\"]\n";
}

// The file name of a fixture library.
inline std::string Lib(const char* so) { return std::filesystem::path(so).filename().string(); }

// A fresh directory of mode 0700 (trusted), removed with everything in it.
class PluginDir {
 public:
  PluginDir() {
    char pattern[] = "/tmp/cai-plugins-XXXXXX";
    path_ = mkdtemp(pattern);
  }
  ~PluginDir() {
    std::error_code ec;
    std::filesystem::permissions(path_, std::filesystem::perms::owner_all, ec);
    std::filesystem::remove_all(path_, ec);
  }
  PluginDir(const PluginDir&) = delete;
  PluginDir& operator=(const PluginDir&) = delete;
  const std::filesystem::path& path() const { return path_; }
  std::string str() const { return path_.string(); }

  // Copies `so` in (mode 0755) and writes `name`.toml (mode 0644) with the given text.
  std::filesystem::path Add(const std::string& so, const std::string& name,
                            const std::string& manifest) {
    if (!so.empty()) {
      const std::filesystem::path copy = path_ / std::filesystem::path(so).filename();
      std::filesystem::copy_file(so, copy, std::filesystem::copy_options::overwrite_existing);
      chmod(copy.c_str(), 0755);
    }
    std::filesystem::path toml = path_ / (name + ".toml");
    std::ofstream(toml) << manifest;
    chmod(toml.c_str(), 0644);
    return toml;
  }
  void AddHello() { Add(HELLO_SO, "hello_strategy", ReadFile(HELLO_TOML)); }

  // Puts a copy of `so` at `name` by renaming over it: the old file keeps its inode (and
  // whoever has it open keeps the old contents), the name now means another file.
  void ReplaceWith(const std::string& so, const std::string& name) {
    const std::filesystem::path staged = path_ / (name + ".new");
    std::filesystem::copy_file(so, staged, std::filesystem::copy_options::overwrite_existing);
    chmod(staged.c_str(), 0755);
    std::filesystem::rename(staged, path_ / name);
  }

 private:
  std::filesystem::path path_;
};

}  // namespace cai::testing
