// Plugin discovery and loading.
//
// Search order (docs/manifest.md), first occurrence of a name wins, later ones are reported as
// shadowed:
//   1. CAI_PLUGIN_FILES — manifest files or directories, ':'-separated; replaces 2–5.
//   2. --plugin-path directories, then CAI_PLUGIN_PATH (':'-separated).
//   3. The user's directory: $XDG_DATA_HOME/cai/plugins (default ~/.local/share/cai/plugins).
//   4. /usr/local/lib/cai/plugins.
//   5. <prefix>/<libdir>/cai/plugins, where <prefix> is the directory above the running
//      executable's bin/: the packaged plugins of an installed cai, or those of a build tree.
// Environment variables and the user's directory are ignored in setuid processes.
// A directory holds plugins as <name>.toml manifests beside their .so files, read in sorted
// order. Manifests are parsed without loading anything; a library is loaded only by
// LoadPluginLibrary() (and LoadPlugin(), which uses it).
#pragma once

#include <filesystem>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "cai/plugin.h"
#include "loader/config.h"
#include "loader/manifest.h"

namespace cai {

struct PluginRecord {
  std::filesystem::path manifest_path;
  std::string found_in;  // which search location ("CAI_PLUGIN_PATH", "user", ...)
  Manifest manifest;     // valid when error is empty or the plugin is shadowed
  std::string error;     // why the plugin cannot be used; empty when usable
  // The manifest of the plugin of the same name found earlier in the search order, which is
  // used instead of this one; empty when not shadowed. `error` then says so too, so that a
  // caller skipping records with errors never chooses a shadowed plugin.
  std::filesystem::path shadowed_by;

  // Unusable for a reason of its own, not merely shadowed.
  bool broken() const { return !error.empty() && shadowed_by.empty(); }
};

struct LoadedPlugin {
  Manifest manifest;
  const cai_plugin_api* api = nullptr;
  uint32_t plugin_abi_minor = 0;       // the minor the plugin was built with
  uint32_t plugin_min_host_minor = 0;  // the oldest host minor it needs
  std::vector<ConfigKey> schema;
  // True when the plugin's table has `field` (it may be older than this host).
  template <class F>
  bool Has(F cai_plugin_api::*field) const {
    const auto offset = reinterpret_cast<size_t>(&(static_cast<cai_plugin_api*>(nullptr)->*field));
    return api->struct_size >= offset + sizeof(F) && api->*field != nullptr;
  }
};

struct SearchLocation {
  std::filesystem::path path;
  std::string label;
  bool is_file = false;  // CAI_PLUGIN_FILES may name manifests directly
};

// The locations searched, in order, for the given --plugin-path entries.
std::vector<SearchLocation> PluginSearchPath(const std::vector<std::filesystem::path>& extra);

// Parses and checks a manifest and its library without loading it: manifest, trust of the
// directory, manifest and library, library existence, sha256. Sets record.error on failure.
PluginRecord InspectManifest(const std::filesystem::path& manifest_path, std::string found_in);

// Finds every plugin along the search path. Broken and shadowed plugins are included with
// their reason; a plugin that is itself broken is reported broken even when shadowed.
std::vector<PluginRecord> DiscoverPlugins(const std::vector<SearchLocation>& locations);

// The plugin's library, loaded from the very file that is checked: opened once, checked
// through that descriptor (trust, sha256) and loaded from it (RTLD_NOW | RTLD_LOCAL, never
// unloaded), so replacing the file after InspectManifest() cannot slip other code in. The same
// handle for the same library. Throws cai::Error naming the library and the reason.
void* LoadPluginLibrary(const Manifest& manifest);

// Loads a plugin (LoadPluginLibrary), calls its entry once with `host`, and checks the
// negotiation (the host minor the library needs must be this host's or older, and equal to
// the manifest's [abi] min_host_minor) and the returned table. Throws cai::Error whose message
// names the library and the reason. Loading the same library twice returns the first result.
const LoadedPlugin& LoadPlugin(const Manifest& manifest, const cai_host_api* host);

}  // namespace cai
