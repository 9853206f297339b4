#include "cai/conformance.hpp"

#include <dlfcn.h>
#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <functional>

#include "behaviour_checks.h"
#include "core/status.h"
#include "loader/config.h"
#include "loader/file_checks.h"
#include "loader/host_api.h"
#include "loader/manifest.h"
#include "loader/registry.h"

namespace cai::conformance {
namespace {

namespace fs = std::filesystem;

fs::path FindManifest(const fs::path& path) {
  if (path.extension() == ".toml") return path;
  const fs::path dir = path.parent_path().empty() ? fs::path(".") : path.parent_path();
  std::string stem = path.stem().string();
  if (stem.rfind("lib", 0) == 0) stem = stem.substr(3);
  for (const std::string& candidate : {stem, stem.substr(stem.find('_') + 1)}) {
    if (fs::exists(dir / (candidate + ".toml"))) return dir / (candidate + ".toml");
  }
  std::vector<fs::path> tomls;
  std::error_code ec;
  for (const auto& e : fs::directory_iterator(dir, ec)) {
    if (e.path().extension() == ".toml") tomls.push_back(e.path());
  }
  if (tomls.size() == 1) return tomls.front();
  throw Error(CAI_NOT_FOUND, path.string() +
                                 ": no manifest found beside the library; pass the "
                                 "plugin's .toml instead");
}

bool IsLinkerSymbol(const std::string& s) {
  return s == "_init" || s == "_fini" || s == "_edata" || s == "_end" || s == "__bss_start";
}

}  // namespace

std::vector<CheckResult> Run(const fs::path& path, const Options& options) {
  std::vector<CheckResult> results;
  // Runs one check; returns false (and records why) if it threw.
  auto check = [&](const std::string& name, const std::function<std::string()>& fn) {
    CheckResult r{name, false, ""};
    try {
      r.detail = fn();
      r.passed = true;
    } catch (const std::exception& e) {
      r.detail = e.what();
    }
    results.push_back(r);
    return r.passed;
  };
  const cai_host_api* host = options.host ? options.host : MakeHostApi({});

  Manifest manifest;
  if (!check("manifest parses and is valid", [&] {
        manifest = ParseManifest(FindManifest(path));
        return manifest.path.string();
      })) {
    return results;
  }
  if (!check("files are trusted, present and match sha256", [&] {
        PluginRecord record = InspectManifest(manifest.path, "check");
        if (!record.error.empty()) throw Error(CAI_FAILED_PRECONDITION, record.error);
        return manifest.sha256 ? std::string("sha256 verified") : std::string("no sha256 given");
      })) {
    return results;
  }
  ElfInfo elf;
  if (!check("library is a 64-bit ELF shared object", [&] {
        elf = ReadElfInfo(manifest.library);
        return std::to_string(elf.needed.size()) + " needed libraries";
      })) {
    return results;
  }
  check("links no framework, device runtime or communication library", [&] {
    std::vector<std::string> bad;
    for (const auto& n : elf.needed) {
      if (IsForbiddenPluginDependency(n)) bad.push_back(n);
    }
    if (!bad.empty()) {
      std::string list;
      for (const auto& b : bad) list += " " + b;
      throw Error(CAI_FAILED_PRECONDITION,
                  "links" + list + "; plugins must reach these only through host services");
    }
    return std::string("ok");
  });
  check("exports only the entry symbol", [&] {
    std::vector<std::string> extra;
    bool has_entry = false;
    for (const auto& s : elf.exported_symbols) {
      if (s == manifest.entry) {
        has_entry = true;
      } else if (!IsLinkerSymbol(s)) {
        extra.push_back(s);
      }
    }
    if (!has_entry) throw Error(CAI_FAILED_PRECONDITION, "does not export " + manifest.entry);
    if (!extra.empty()) {
      std::string list;
      for (size_t i = 0; i < extra.size() && i < 5; ++i) list += " " + extra[i];
      throw Error(CAI_FAILED_PRECONDITION,
                  std::to_string(extra.size()) + " other symbols exported (" + list +
                      " ...); build with cai_add_plugin() (hidden visibility + version script)");
    }
    return manifest.entry;
  });
  check("refuses a host of another ABI major without filling its outputs", [&] {
    // The same handle LoadPlugin gets later, loaded from the file that was checked.
    void* handle = LoadPluginLibrary(manifest);
    auto init = reinterpret_cast<cai_plugin_init_fn>(dlsym(handle, manifest.entry.c_str()));
    if (!init) throw Error(CAI_FAILED_PRECONDITION, "entry symbol not found");
    cai_plugin_init_args args{};
    args.struct_size = CAI_PLUGIN_INIT_ARGS_STRUCT_SIZE;
    args.host_abi_major = CAI_ABI_MAJOR + 1;
    args.host_abi_minor = 0;
    args.host = host;
    args.plugin_dir = "/nonexistent";
    cai_status* status = nullptr;
    try {
      status = init(&args);
    } catch (...) {
      throw Error(CAI_FAILED_PRECONDITION, "the entry threw a C++ exception across the ABI");
    }
    if (!status) {
      throw Error(CAI_FAILED_PRECONDITION,
                  "initialised against a host of ABI major " + std::to_string(CAI_ABI_MAJOR + 1));
    }
    std::string message = StatusMessage(status);
    DestroyStatus(status);
    if (args.plugin) throw Error(CAI_FAILED_PRECONDITION, "filled its table despite refusing");
    return message;
  });
  const LoadedPlugin* plugin = nullptr;
  if (!check("loads, negotiates the ABI and returns a valid table", [&] {
        plugin = &LoadPlugin(manifest, host);
        return "built for ABI 1." + std::to_string(plugin->plugin_abi_minor) + ", needs host 1." +
               std::to_string(plugin->plugin_min_host_minor) + "+, table " +
               std::to_string(plugin->api->struct_size) + " bytes";
      })) {
    return results;
  }
  // Discovery reads the manifest without loading the library, so the manifest must state what
  // the library will ask for; a host too old for it would otherwise list a plugin it refuses.
  check("manifest's [abi] min_host_minor is what the library needs", [&] {
    const std::string manifest_says = "1." + std::to_string(manifest.min_host_minor);
    const std::string library_needs = "1." + std::to_string(plugin->plugin_min_host_minor);
    if (manifest.min_host_minor != static_cast<int64_t>(plugin->plugin_min_host_minor)) {
      throw Error(CAI_FAILED_PRECONDITION,
                  "manifest says " + manifest_says + " but the library needs " + library_needs +
                      " (CAI_TARGET_ABI_MINOR when it was built); set min_host_minor = " +
                      std::to_string(plugin->plugin_min_host_minor));
    }
    return "both 1." + std::to_string(manifest.min_host_minor);
  });
  check("config schema is complete", [&] {
    for (const ConfigKey& key : plugin->schema) {
      ValidateConfig({key}, nullptr, manifest.name);
    }
    return std::to_string(plugin->schema.size()) + " keys";
  });
  check("create with the default config and destroy", [&] {
    auto config = ValidateConfig(plugin->schema, nullptr, "[plugin." + manifest.name + "]");
    cai_create_args args{};
    args.struct_size = CAI_CREATE_ARGS_STRUCT_SIZE;
    args.config = config.get();
    args.rank = 0;
    args.world_size = 1;
    cai_strategy* strategy = nullptr;
    ThrowIfError(plugin->api->create(&args, &strategy));
    if (!strategy) throw Error(CAI_INTERNAL, "create succeeded but returned no instance");
    plugin->api->destroy(strategy);
    plugin->api->destroy(nullptr);  // release functions accept NULL
    return std::string("ok");
  });
  check("refuses a NULL argument struct with a status, not a crash", [&] {
    cai_strategy* strategy = nullptr;
    cai_status* status = plugin->api->create(nullptr, &strategy);
    if (!status) throw Error(CAI_FAILED_PRECONDITION, "create(NULL, ...) returned success");
    std::string message = StatusMessage(status);
    DestroyStatus(status);
    return message;
  });
  if (plugin->Has(&cai_plugin_api::estimate_memory)) {
    check("estimate_memory shrinks or stays as ranks grow", [&] {
      auto config = ValidateConfig(plugin->schema, nullptr, "[plugin." + manifest.name + "]");
      uint64_t previous = UINT64_MAX;
      for (int32_t world : {1, 2, 4, 8}) {
        cai_memory_estimate_args args{};
        args.struct_size = CAI_MEMORY_ESTIMATE_ARGS_STRUCT_SIZE;
        args.config = config.get();
        args.num_params = 124'000'000;
        args.largest_unit_numel = 7'000'000;
        args.world_size = world;
        args.precision = CAI_PRECISION_FP32;
        args.optimizer_state_slots = 2;
        cai_memory_estimate out{};
        out.struct_size = CAI_MEMORY_ESTIMATE_STRUCT_SIZE;
        ThrowIfError(plugin->api->estimate_memory(&args, &out));
        const uint64_t total =
            out.param_bytes + out.grad_bytes + out.optimizer_state_bytes + out.master_bytes;
        if (total == 0 || total > previous) {
          throw Error(CAI_FAILED_PRECONDITION, "estimate for " + std::to_string(world) +
                                                   " ranks is " + std::to_string(total) +
                                                   " bytes (previous " + std::to_string(previous) +
                                                   ")");
        }
        previous = total;
      }
      return std::string("ok");
    });
  }
  if (options.behaviour) {
    if (std::all_of(results.begin(), results.end(),
                    [](const CheckResult& r) { return r.passed; })) {
      const char* keep = std::getenv("CAI_CONFORMANCE_KEEP");
      try {
        RunBehaviourChecks(manifest, options.cai,
                           options.keep_runs || (keep && *keep && std::string(keep) != "0"),
                           results);
      } catch (const std::exception& e) {  // no temporary directory, cai cannot be started, ...
        results.push_back({"trains like the reference (behaviour checks)", false, e.what()});
      }
    } else {
      results.push_back({"trains like the reference (behaviour checks)", false,
                         "not run: fix the structural failures above first"});
    }
  }
  return results;
}

fs::path FindCai() {
  std::error_code ec;
  auto runnable = [&ec](const fs::path& p) {
    return fs::is_regular_file(p, ec) && access(p.c_str(), X_OK) == 0;
  };
  const fs::path beside = fs::read_symlink("/proc/self/exe", ec).parent_path() / "cai";
  if (!ec && runnable(beside)) return beside;
  const char* path = std::getenv("PATH");
  std::string dirs = path ? path : "";
  for (size_t start = 0; start <= dirs.size();) {
    size_t end = dirs.find(':', start);
    if (end == std::string::npos) end = dirs.size();
    const fs::path candidate = fs::path(dirs.substr(start, end - start)) / "cai";
    if (end > start && runnable(candidate)) return candidate;
    start = end + 1;
  }
  return {};
}

bool Report(const std::vector<CheckResult>& results, std::ostream& out) {
  size_t passed = 0;
  for (const CheckResult& r : results) {
    out << (r.passed ? "[ PASS ] " : "[ FAIL ] ") << r.name;
    if (!r.detail.empty()) out << ": " << r.detail;
    out << "\n";
    passed += r.passed;
  }
  out << passed << " passed, " << results.size() - passed << " failed\n";
  return passed == results.size();
}

}  // namespace cai::conformance
