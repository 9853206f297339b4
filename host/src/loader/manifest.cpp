#include "loader/manifest.h"

#include <toml++/toml.h>

#include <algorithm>
#include <functional>
#include <regex>

#include "cai/core.h"
#include "core/status.h"
#include "core/strings.h"

namespace cai {
namespace {

namespace fs = std::filesystem;

enum class Kind { kString, kInt, kBool, kStringArray, kTable };

struct Field {
  std::string_view name;
  Kind kind;
  bool required;
};

const char* KindName(Kind kind) {
  switch (kind) {
    case Kind::kString:
      return "a string";
    case Kind::kInt:
      return "an integer";
    case Kind::kBool:
      return "a boolean";
    case Kind::kStringArray:
      return "an array of strings";
    case Kind::kTable:
      return "a table";
  }
  return "";
}

bool HasKind(const toml::node& node, Kind kind) {
  switch (kind) {
    case Kind::kString:
      return node.is_string();
    case Kind::kInt:
      return node.is_integer();
    case Kind::kBool:
      return node.is_boolean();
    case Kind::kTable:
      return node.is_table();
    case Kind::kStringArray:
      return node.is_array() && node.as_array()->is_homogeneous(toml::node_type::string);
  }
  return false;
}

// Checks one table against its fields: unknown keys, missing required keys, wrong types.
void CheckTable(const toml::table& table, std::string_view table_name,
                std::initializer_list<Field> fields, const std::function<void(std::string)>& fail) {
  std::vector<std::string_view> names;
  for (const Field& f : fields) names.push_back(f.name);
  for (const auto& [key, node] : table) {
    if (std::find(names.begin(), names.end(), key.str()) == names.end()) {
      fail("unknown key '" + std::string(table_name) + std::string(key.str()) + "' (line " +
           std::to_string(node.source().begin.line) + ")." + DidYouMean(key.str(), names) +
           " Valid keys: " + Join(names) + ".");
    }
  }
  for (const Field& f : fields) {
    const toml::node* node = table.get(f.name);
    if (!node) {
      if (f.required) {
        fail("missing required key '" + std::string(table_name) + std::string(f.name) + "'");
      }
      continue;
    }
    if (!HasKind(*node, f.kind)) {
      fail("key '" + std::string(table_name) + std::string(f.name) + "' (line " +
           std::to_string(node->source().begin.line) + ") must be " + KindName(f.kind));
    }
  }
}

}  // namespace

Manifest ParseManifest(const fs::path& input) {
  Manifest m;
  std::error_code ec;
  m.path = fs::absolute(input, ec).lexically_normal();
  auto fail = [&](const std::string& why) -> void {
    throw Error(CAI_INVALID_ARGUMENT, m.path.string() + ": " + why);
  };
  if (!fs::is_regular_file(m.path, ec)) {
    throw Error(CAI_NOT_FOUND, m.path.string() + ": manifest not found (or not a regular file)");
  }
  toml::table root;
  try {
    root = toml::parse_file(m.path.string());
  } catch (const toml::parse_error& err) {
    fail("malformed TOML at line " + std::to_string(err.source().begin.line) + ", column " +
         std::to_string(err.source().begin.column) + ": " + std::string(err.description()));
  }
  CheckTable(root, "",
             {{"manifest_version", Kind::kInt, true},
              {"plugin", Kind::kTable, true},
              {"library", Kind::kTable, true},
              {"abi", Kind::kTable, true},
              {"capabilities", Kind::kTable, false}},
             fail);
  m.manifest_version = *root["manifest_version"].value<int64_t>();
  if (m.manifest_version != kManifestVersion) {
    fail("manifest_version " + std::to_string(m.manifest_version) +
         " is not supported (this host "
         "reads version " +
         std::to_string(kManifestVersion) + "); install a matching cai");
  }

  const toml::table& plugin = *root["plugin"].as_table();
  CheckTable(plugin, "plugin.",
             {{"name", Kind::kString, true},
              {"kind", Kind::kString, true},
              {"version", Kind::kString, true},
              {"license", Kind::kString, true},
              {"description", Kind::kString, true}},
             fail);
  m.name = *plugin["name"].value<std::string>();
  m.kind = *plugin["kind"].value<std::string>();
  m.version = *plugin["version"].value<std::string>();
  m.license = *plugin["license"].value<std::string>();
  m.description = *plugin["description"].value<std::string>();
  if (!std::regex_match(m.name, std::regex("[a-z0-9][a-z0-9_-]*"))) {
    fail("plugin.name '" + m.name + "' must match [a-z0-9][a-z0-9_-]*");
  }
  if (m.kind != "strategy") fail("plugin.kind '" + m.kind + "' is not supported; use \"strategy\"");
  if (m.license.empty()) fail("plugin.license must name the plugin's licence (SPDX identifier)");

  const toml::table& library = *root["library"].as_table();
  CheckTable(library, "library.",
             {{"path", Kind::kString, true},
              {"entry", Kind::kString, true},
              {"sha256", Kind::kString, false}},
             fail);
  std::string lib = *library["path"].value<std::string>();
  // The library must sit beside its manifest: no absolute path, no directory part, so a
  // manifest can never point the loader at a file outside its (trust-checked) directory.
  if (lib.empty() || lib.find('/') != std::string::npos || lib == "." || lib == "..") {
    fail("library.path '" + lib +
         "' must be a file name in the manifest's directory (no '/', "
         "no '..'); put the .so beside " +
         m.path.filename().string());
  }
  m.library = m.path.parent_path() / lib;
  m.entry = *library["entry"].value<std::string>();
  if (auto sha = library["sha256"].value<std::string>()) {
    std::string hex = *sha;
    std::transform(hex.begin(), hex.end(), hex.begin(), ::tolower);
    if (!std::regex_match(hex, std::regex("[0-9a-f]{64}"))) {
      fail("library.sha256 must be 64 hexadecimal digits");
    }
    m.sha256 = hex;
  }

  const toml::table& abi = *root["abi"].as_table();
  CheckTable(abi, "abi.", {{"major", Kind::kInt, true}, {"min_host_minor", Kind::kInt, true}},
             fail);
  m.abi_major = *abi["major"].value<int64_t>();
  m.min_host_minor = *abi["min_host_minor"].value<int64_t>();
  if (m.abi_major != CAI_ABI_MAJOR) {
    fail("plugin is built for cai ABI " + std::to_string(m.abi_major) +
         ".x; this host speaks ABI " + std::to_string(CAI_ABI_MAJOR) + "." +
         std::to_string(CAI_ABI_MINOR) + ". Install a build of '" + m.name + "' for cai " +
         std::to_string(CAI_ABI_MAJOR) + ".x");
  }
  if (m.min_host_minor < 0 || m.min_host_minor > CAI_ABI_MINOR) {
    fail("plugin needs host ABI " + std::to_string(m.abi_major) + "." +
         std::to_string(m.min_host_minor) + " or newer; this host is " +
         std::to_string(CAI_ABI_MAJOR) + "." + std::to_string(CAI_ABI_MINOR) + ". Upgrade cai");
  }
  std::string expected_entry = "cai_plugin_init_v" + std::to_string(CAI_ABI_MAJOR);
  if (m.entry != expected_entry) {
    fail("library.entry '" + m.entry + "' must be '" + expected_entry + "' for ABI " +
         std::to_string(CAI_ABI_MAJOR));
  }

  if (const toml::table* caps = root["capabilities"].as_table()) {
    CheckTable(*caps, "capabilities.",
               {{"precisions", Kind::kStringArray, false},
                {"no_sync", Kind::kBool, false},
                {"cpu_offload", Kind::kBool, false},
                {"pipeline", Kind::kBool, false},
                {"sharded_checkpoint", Kind::kBool, false},
                {"tensor_parallel", Kind::kBool, false}},
               fail);
    if (const toml::array* precisions = (*caps)["precisions"].as_array()) {
      for (const auto& p : *precisions) {
        std::string value = *p.value<std::string>();
        if (value != "fp32" && value != "bf16" && value != "fp16") {
          fail("capabilities.precisions: '" + value + "' is not one of fp32, bf16, fp16");
        }
        m.capabilities.precisions.push_back(value);
      }
    }
    m.capabilities.no_sync = (*caps)["no_sync"].value_or(false);
    m.capabilities.cpu_offload = (*caps)["cpu_offload"].value_or(false);
    m.capabilities.pipeline = (*caps)["pipeline"].value_or(false);
    m.capabilities.sharded_checkpoint = (*caps)["sharded_checkpoint"].value_or(false);
    m.capabilities.tensor_parallel = (*caps)["tensor_parallel"].value_or(false);
  }
  return m;
}

}  // namespace cai
