#include "cli/plugins_command.h"

#include <filesystem>
#include <iomanip>
#include <iostream>
#include <sstream>

#include "cai/conformance.hpp"
#include "core/json.h"
#include "core/status.h"
#include "loader/registry.h"
#include "services/host_table.h"

namespace cai {
namespace {

// "ok", "shadowed" (another plugin of its name is found first and used) or "broken".
const char* Status(const PluginRecord& r) {
  return r.error.empty() ? "ok" : r.broken() ? "broken" : "shadowed";
}

int List(const GlobalOptions& options, bool json, std::ostream& out) {
  std::vector<PluginRecord> records = DiscoverPlugins(PluginSearchPath(options.plugin_paths));
  int broken = 0;
  if (json) {
    out << "[";
    for (size_t i = 0; i < records.size(); ++i) {
      const PluginRecord& r = records[i];
      const bool parsed = !r.broken();
      JsonObject o;
      o.Add("name", parsed ? r.manifest.name : "")
          .Add("version", parsed ? r.manifest.version : "")
          .Add("abi", parsed ? std::to_string(r.manifest.abi_major) + "." +
                                   std::to_string(r.manifest.min_host_minor) + "+"
                             : "")
          .Add("path", r.manifest_path.string())
          .Add("found_in", r.found_in)
          .Add("status", Status(r))
          .Add("error", r.broken() ? r.error : "")
          .AddRaw("shadowed_by",
                  r.shadowed_by.empty() ? "null" : JsonQuote(r.shadowed_by.string()));
      out << (i ? ",\n " : "\n ") << o.str();
      broken += r.broken();
    }
    out << (records.empty() ? "]\n" : "\n]\n");
  } else {
    out << std::left << std::setw(20) << "NAME" << std::setw(10) << "VERSION" << std::setw(8)
        << "ABI" << std::setw(10) << "STATUS"
        << "PATH\n";
    for (const PluginRecord& r : records) {
      const bool parsed = !r.broken();
      out << std::left << std::setw(20) << (parsed ? r.manifest.name : "?") << std::setw(10)
          << (parsed ? r.manifest.version : "?") << std::setw(8)
          << (parsed ? std::to_string(r.manifest.abi_major) + "." +
                           std::to_string(r.manifest.min_host_minor) + "+"
                     : "?")
          << std::setw(10) << Status(r) << r.manifest_path.string() << "\n";
      if (r.broken()) {
        out << "    error: " << r.error << "\n";
        ++broken;
      } else if (!r.shadowed_by.empty()) {
        out << "    shadowed by " << r.shadowed_by.string()
            << " (found first, so it is the one used)\n";
      }
    }
    if (records.empty()) out << "(no plugins found; see `cai --help` for where cai looks)\n";
  }
  if (broken) {
    std::cerr << "cai: " << broken << " plugin(s) could not be used; see the errors above\n";
  }
  return broken ? 1 : 0;
}

int Info(const GlobalOptions& options, const std::string& name, std::ostream& out) {
  std::vector<PluginRecord> records = DiscoverPlugins(PluginSearchPath(options.plugin_paths));
  const PluginRecord* found = nullptr;
  std::vector<std::string_view> names;
  for (const PluginRecord& r : records) {
    if (!r.error.empty()) continue;
    names.push_back(r.manifest.name);
    if (r.manifest.name == name && !found) found = &r;
  }
  if (!found) {
    for (const PluginRecord& r : records) {
      if (!r.error.empty() && r.manifest.name == name)
        throw Error(CAI_FAILED_PRECONDITION, r.error);
    }
    std::string available;
    for (auto n : names) available += (available.empty() ? "" : ", ") + std::string(n);
    throw Error(CAI_NOT_FOUND,
                "no plugin named '" + name + "'" +
                    (available.empty() ? "; no plugins found" : "; available: " + available) +
                    ". Run `cai plugins list` to see where cai looked");
  }
  const LoadedPlugin& plugin = LoadPlugin(found->manifest, HostServicesTable());
  const Manifest& m = plugin.manifest;
  out << "name:        " << m.name << "\n"
      << "version:     " << m.version << "\n"
      << "kind:        " << m.kind << "\n"
      << "license:     " << m.license << "\n"
      << "description: " << m.description << "\n"
      << "manifest:    " << m.path.string() << "\n"
      << "library:     " << m.library.string() << "\n"
      << "abi:         built for 1." << plugin.plugin_abi_minor << ", needs host 1."
      << plugin.plugin_min_host_minor << "+ (this host: " << CAI_ABI_MAJOR << "." << CAI_ABI_MINOR
      << ")\n";
  out << "capabilities:\n  precisions: ";
  for (size_t i = 0; i < m.capabilities.precisions.size(); ++i) {
    out << (i ? ", " : "") << m.capabilities.precisions[i];
  }
  auto yes = [](bool b) { return b ? "yes" : "no"; };
  out << "\n  no_sync: " << yes(m.capabilities.no_sync)
      << "\n  cpu_offload: " << yes(m.capabilities.cpu_offload)
      << "\n  pipeline: " << yes(m.capabilities.pipeline)
      << "\n  sharded_checkpoint: " << yes(m.capabilities.sharded_checkpoint)
      << "\n  tensor_parallel: " << yes(m.capabilities.tensor_parallel)
      << "\n  estimate_memory: " << yes(plugin.Has(&cai_plugin_api::estimate_memory))
      << "\n  parallel_layout: " << yes(plugin.Has(&cai_plugin_api::parallel_layout)) << "\n";
  out << "config keys ([plugin." << m.name << "] in a job file):\n";
  if (plugin.schema.empty()) out << "  (none)\n";
  for (const ConfigKey& key : plugin.schema) {
    out << "  " << key.name << " (" << ConfigTypeName(key.type) << ", default "
        << key.default_literal;
    if (!key.choices.empty()) {
      out << ", one of";
      for (const auto& c : key.choices) out << " " << c;
    }
    if (key.has_min) out << ", min " << key.min_value;
    if (key.has_max) out << ", max " << key.max_value;
    out << ")\n      " << key.doc << "\n";
  }
  return 0;
}

}  // namespace

int RunPluginsCommand(const GlobalOptions& options, std::span<const std::string> args,
                      std::ostream& out) {
  const std::string usage =
      "usage: cai plugins list [--json] | info NAME | check PATH [--structure-only] "
      "[--keep-runs]";
  if (args.empty()) throw Error(CAI_INVALID_ARGUMENT, "missing subcommand; " + usage);
  if (args[0] == "list") {
    if (args.size() > 2 || (args.size() == 2 && args[1] != "--json")) {
      throw Error(CAI_INVALID_ARGUMENT, "unexpected argument to 'plugins list'; " + usage);
    }
    return List(options, args.size() == 2, out);
  }
  if (args[0] == "info") {
    if (args.size() != 2)
      throw Error(CAI_INVALID_ARGUMENT, "'plugins info' takes a NAME; " + usage);
    return Info(options, args[1], out);
  }
  if (args[0] == "check") {
    conformance::Options check;
    check.host = HostServicesTable();
    std::string path;
    for (size_t i = 1; i < args.size(); ++i) {
      if (args[i] == "--structure-only") {
        check.behaviour = false;
      } else if (args[i] == "--keep-runs") {
        check.keep_runs = true;
      } else if (path.empty() && args[i].rfind("--", 0) != 0) {
        path = args[i];
      } else {
        throw Error(CAI_INVALID_ARGUMENT, "unexpected argument '" + args[i] + "'; " + usage);
      }
    }
    if (path.empty()) throw Error(CAI_INVALID_ARGUMENT, "'plugins check' takes a PATH; " + usage);
    // The behaviour checks train with this very program.
    check.cai = std::filesystem::read_symlink("/proc/self/exe");
    auto results = conformance::Run(path, check);
    return conformance::Report(results, out) ? 0 : 1;
  }
  throw Error(CAI_INVALID_ARGUMENT, "unknown subcommand '" + args[0] + "'; " + usage);
}

}  // namespace cai
