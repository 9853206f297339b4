#include "loader/registry.h"

#include <dlfcn.h>

#include <algorithm>
#include <map>
#include <mutex>
#include <set>
#include <sstream>

#include "core/env.h"
#include "core/status.h"
#include "loader/file_checks.h"

namespace cai {
namespace {

namespace fs = std::filesystem;

std::vector<fs::path> SplitPath(const char* value) {
  std::vector<fs::path> out;
  if (!value) return out;
  std::stringstream in(value);
  std::string item;
  while (std::getline(in, item, ':')) {
    if (!item.empty()) out.emplace_back(item);
  }
  return out;
}

fs::path ExecutablePrefix() {
  std::error_code ec;
  fs::path exe = fs::read_symlink("/proc/self/exe", ec);
  return ec ? fs::path() : exe.parent_path().parent_path();
}

std::vector<fs::path> ManifestsIn(const fs::path& dir) {
  std::vector<fs::path> out;
  std::error_code ec;
  for (const auto& entry : fs::directory_iterator(dir, ec)) {
    if (entry.path().extension() == ".toml" && entry.is_regular_file(ec)) {
      out.push_back(entry.path());
    }
  }
  std::sort(out.begin(), out.end());
  return out;
}

std::string Join(const std::vector<std::string>& items) {
  std::string out;
  for (const auto& s : items) out += (out.empty() ? "" : ", ") + s;
  return out;
}

// The plugin's library, opened once and checked through that descriptor: present, trusted, and
// the manifest's sha256 when it gives one.
CheckedFile OpenLibrary(const Manifest& m) {
  std::error_code ec;
  if (!fs::is_regular_file(m.library, ec)) {
    throw Error(CAI_NOT_FOUND, m.library.string() + ": plugin library not found (named by " +
                                   m.path.string() + " library.path)");
  }
  CheckedFile file = CheckedFile::Open(m.library);
  if (m.sha256) {
    std::string actual = file.Sha256();
    if (actual != *m.sha256) {
      throw Error(CAI_DATA_LOSS, m.library.string() + ": sha256 mismatch: manifest " +
                                     m.path.string() + " says " + *m.sha256 + ", file has " +
                                     actual + "; reinstall the plugin or fix library.sha256");
    }
  }
  return file;
}

// Required entries of an ABI 1.0 table; absent optional ones are allowed.
void CheckTable(const Manifest& m, const cai_plugin_api* api) {
  auto fail = [&](const std::string& why) {
    throw Error(CAI_FAILED_PRECONDITION, m.library.string() + ": " + why);
  };
  if (!api) fail("cai_plugin_init_v1 returned success but no plugin table");
  if (api->struct_size < CAI_PLUGIN_API_V1_0_STRUCT_SIZE) {
    fail("plugin table struct_size " + std::to_string(api->struct_size) +
         " is smaller than ABI 1.0's " + std::to_string(CAI_PLUGIN_API_V1_0_STRUCT_SIZE));
  }
  std::vector<std::string> missing;
  if (!api->create) missing.push_back("create");
  if (!api->destroy) missing.push_back("destroy");
  if (!api->boost) missing.push_back("boost");
  if (!api->forward_backward) missing.push_back("forward_backward");
  if (!api->step) missing.push_back("step");
  if (!api->zero_grad) missing.push_back("zero_grad");
  if (!api->save) missing.push_back("save");
  if (!api->load) missing.push_back("load");
  if (!api->stats) missing.push_back("stats");
  if (!missing.empty()) fail("plugin table lacks required functions: " + Join(missing));
  if (!api->name || m.name != api->name) {
    fail(std::string("plugin table names itself '") + (api->name ? api->name : "(null)") +
         "' but its manifest says '" + m.name + "'");
  }
  if ((api->capabilities & CAI_CAP_NO_SYNC) && !api->no_sync) {
    fail("capability no_sync is set but no_sync is NULL");
  }
  if ((api->capabilities & CAI_CAP_PIPELINE) && !api->execute_pipeline) {
    fail("capability pipeline is set but execute_pipeline is NULL");
  }
  const auto& caps = m.capabilities;
  auto agree = [&](bool manifest, uint64_t bit, const char* key) {
    if (manifest != ((api->capabilities & bit) != 0)) {
      fail(std::string("manifest capabilities.") + key + " = " + (manifest ? "true" : "false") +
           " disagrees with the plugin table");
    }
  };
  agree(caps.no_sync, CAI_CAP_NO_SYNC, "no_sync");
  agree(caps.cpu_offload, CAI_CAP_CPU_OFFLOAD, "cpu_offload");
  agree(caps.pipeline, CAI_CAP_PIPELINE, "pipeline");
  agree(caps.sharded_checkpoint, CAI_CAP_SHARDED_CHECKPOINT, "sharded_checkpoint");
  agree(caps.tensor_parallel, CAI_CAP_TENSOR_PARALLEL, "tensor_parallel");
  const std::pair<const char*, uint64_t> precision_bits[] = {{"fp32", CAI_CAP_PRECISION_FP32},
                                                             {"bf16", CAI_CAP_PRECISION_BF16},
                                                             {"fp16", CAI_CAP_PRECISION_FP16}};
  for (const auto& [precision, bit] : precision_bits) {
    const bool listed = std::find(caps.precisions.begin(), caps.precisions.end(), precision) !=
                        caps.precisions.end();
    agree(listed, bit, (std::string("precisions[") + precision + "]").c_str());
  }
}

}  // namespace

std::vector<SearchLocation> PluginSearchPath(const std::vector<fs::path>& extra) {
  std::vector<SearchLocation> out;
  if (const char* files = SecureGetenv("CAI_PLUGIN_FILES")) {
    for (const fs::path& p : SplitPath(files)) {
      std::error_code ec;
      out.push_back({p, "CAI_PLUGIN_FILES", !fs::is_directory(p, ec)});
    }
    return out;
  }
  for (const fs::path& p : extra) out.push_back({p, "--plugin-path"});
  for (const fs::path& p : SplitPath(SecureGetenv("CAI_PLUGIN_PATH")))
    out.push_back({p, "CAI_PLUGIN_PATH"});
  // Both unset in a setuid process: no user directory then.
  if (const char* xdg = SecureGetenv("XDG_DATA_HOME")) {
    out.push_back({fs::path(xdg) / "cai/plugins", "user"});
  } else if (const char* home = SecureGetenv("HOME")) {
    out.push_back({fs::path(home) / ".local/share/cai/plugins", "user"});
  }
  out.push_back({"/usr/local/lib/cai/plugins", "local"});
  if (fs::path prefix = ExecutablePrefix(); !prefix.empty()) {
    out.push_back({prefix / CAI_INSTALL_LIBDIR / "cai/plugins", "installed"});
  }
  return out;
}

PluginRecord InspectManifest(const fs::path& manifest_path, std::string found_in) {
  PluginRecord record;
  std::error_code ec;
  record.manifest_path = fs::absolute(manifest_path, ec).lexically_normal();
  record.found_in = std::move(found_in);
  try {
    // Parsing runs none of the plugin's code, so it comes first: a missing manifest is
    // reported as missing rather than as an untrusted directory.
    record.manifest = ParseManifest(record.manifest_path);
    CheckTrusted(record.manifest_path.parent_path());
    CheckTrusted(record.manifest_path);
    OpenLibrary(record.manifest);  // checked now for the listing, and again when loaded
  } catch (const Error& e) {
    record.error = e.what();
  }
  return record;
}

std::vector<PluginRecord> DiscoverPlugins(const std::vector<SearchLocation>& locations) {
  std::vector<PluginRecord> records;
  std::map<std::string, fs::path> first_by_name;
  std::set<fs::path> seen;
  for (const SearchLocation& location : locations) {
    std::error_code ec;
    std::vector<fs::path> manifests;
    if (location.is_file) {
      manifests.push_back(location.path);
    } else {
      if (!fs::is_directory(location.path, ec)) continue;
      try {
        CheckTrusted(location.path);
      } catch (const Error& e) {
        // A directory anyone can write is refused whole: report each plugin it holds.
        for (const fs::path& p : ManifestsIn(location.path)) {
          records.push_back({p, location.label, {}, e.what(), {}});
        }
        continue;
      }
      manifests = ManifestsIn(location.path);
    }
    for (const fs::path& p : manifests) {
      fs::path canonical = fs::weakly_canonical(p, ec);
      if (!seen.insert(canonical).second) continue;  // same file reached twice
      PluginRecord record = InspectManifest(p, location.label);
      if (record.error.empty()) {
        auto [it, inserted] = first_by_name.emplace(record.manifest.name, record.manifest_path);
        if (!inserted) {
          record.shadowed_by = it->second;
          record.error = record.manifest_path.string() + ": plugin name '" + record.manifest.name +
                         "' is already provided by " + it->second.string() +
                         " (found first, so it wins)";
        }
      }
      records.push_back(std::move(record));
    }
  }
  return records;
}

void* LoadPluginLibrary(const Manifest& manifest) {
  static std::mutex mutex;
  static auto* handles = new std::map<fs::path, void*>();  // never freed, like the libraries
  std::lock_guard lock(mutex);
  if (auto it = handles->find(manifest.library); it != handles->end()) return it->second;
  void* handle = OpenLibrary(manifest).Load();
  handles->emplace(manifest.library, handle);
  return handle;
}

const LoadedPlugin& LoadPlugin(const Manifest& manifest, const cai_host_api* host) {
  static std::mutex mutex;
  // Never freed: plugins are never unloaded (their code may still run from threads or
  // callbacks they registered), and neither is what describes them.
  static auto* loaded = new std::map<fs::path, LoadedPlugin*>();
  std::lock_guard lock(mutex);
  if (auto it = loaded->find(manifest.library); it != loaded->end()) return *it->second;

  const std::string lib = manifest.library.string();
  void* library = LoadPluginLibrary(manifest);
  auto* init = reinterpret_cast<cai_plugin_init_fn>(::dlsym(library, manifest.entry.c_str()));
  if (init == nullptr) {
    throw Error(CAI_FAILED_PRECONDITION, lib + ": does not export the entry symbol '" +
                                             manifest.entry +
                                             "'; build it with the cai SDK's CAI_PLUGIN() macro");
  }

  cai_plugin_init_args args{};
  args.struct_size = CAI_PLUGIN_INIT_ARGS_STRUCT_SIZE;
  args.host_abi_major = CAI_ABI_MAJOR;
  args.host_abi_minor = CAI_ABI_MINOR;
  args.host = host;
  std::string dir = manifest.path.parent_path().string();
  args.plugin_dir = dir.c_str();
  cai_status* status = nullptr;
  try {
    status = init(&args);
  } catch (const std::exception& e) {
    throw Error(CAI_INTERNAL, lib + ": " + manifest.entry + " threw a C++ exception (" + e.what() +
                                  "); exceptions must not cross the ABI");
  } catch (...) {
    throw Error(CAI_INTERNAL, lib + ": " + manifest.entry +
                                  " threw an exception; exceptions must not cross the ABI");
  }
  if (status) {
    std::string message = StatusMessage(status);
    cai_status_code code = StatusCode(status);
    DestroyStatus(status);
    throw Error(code, lib + ": " + manifest.entry + " refused to initialise: " + message);
  }
  if (args.plugin_min_host_minor > CAI_ABI_MINOR) {
    throw Error(CAI_FAILED_PRECONDITION,
                lib + ": needs host ABI 1." + std::to_string(args.plugin_min_host_minor) +
                    " or newer; this host is 1." + std::to_string(CAI_ABI_MINOR) +
                    ". Upgrade cai, or rebuild the plugin with CAI_TARGET_ABI_MINOR=" +
                    std::to_string(CAI_ABI_MINOR));
  }
  // The manifest is what hosts and packages judge the plugin by before loading anything, so
  // it must say what the library itself reports needing.
  if (args.plugin_min_host_minor != manifest.min_host_minor) {
    const std::string needed = std::to_string(args.plugin_min_host_minor);
    throw Error(CAI_FAILED_PRECONDITION,
                manifest.path.string() +
                    ": [abi] min_host_minor = " + std::to_string(manifest.min_host_minor) +
                    " but " + lib + " was built to need host ABI " + std::to_string(CAI_ABI_MAJOR) +
                    "." + needed + " (CAI_TARGET_ABI_MINOR); set min_host_minor = " + needed);
  }
  CheckTable(manifest, args.plugin);
  auto* plugin = new LoadedPlugin();
  plugin->manifest = manifest;
  plugin->api = args.plugin;
  plugin->plugin_abi_minor = args.plugin_abi_minor;
  plugin->plugin_min_host_minor = args.plugin_min_host_minor;
  plugin->schema = ReadSchema(args.plugin->config_keys, args.plugin->num_config_keys, lib);
  loaded->emplace(manifest.library, plugin);
  return *plugin;
}

}  // namespace cai
