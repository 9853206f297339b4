// Configuration tables validated against a schema of cai_config_key (the plugin's own, or the
// host's job sections): unknown keys name the nearest valid key, wrong types and out-of-range
// values name the key and where it was written; absent keys take their documented default.
#pragma once

#include <map>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "cai/core.h"

namespace toml {
inline namespace v3 {
class node;
class table;
}  // namespace v3
}  // namespace toml

// The validated configuration behind the ABI's opaque cai_config.
struct cai_config {
  struct Value {
    cai_config_type type = CAI_CONFIG_BOOL;
    bool b = false;
    int64_t i = 0;
    double f = 0;
    std::string s;
    bool is_default = true;
  };
  std::map<std::string, Value, std::less<>> values;
};

namespace cai {

// A schema read from a plugin: copies of its keys (its memory may use another struct_size,
// so the array is walked with the plugin's stride and only fields it has are read).
struct ConfigKey {
  std::string name;
  cai_config_type type = CAI_CONFIG_BOOL;
  std::string default_literal;
  std::string doc;
  std::vector<std::string> choices;
  bool has_min = false, has_max = false;
  double min_value = 0, max_value = 0;
};

const char* ConfigTypeName(cai_config_type type);

// Values given on the command line (`cai train --set k=v`) are parsed with the source path
// "--set k=v", so that messages name the option instead of a line of the job file.
inline constexpr std::string_view kSetSourcePrefix = "--set ";

// Where `node` was written, for messages: " (line 12)", " (from --set train.steps=x)", or ""
// when unknown.
std::string WhereWritten(const toml::node& node);

// Reads `count` keys laid out `keys[0].struct_size` bytes apart. Throws cai::Error
// (INVALID_ARGUMENT) on a malformed schema: missing name/doc, duplicate or non-[a-z0-9_]
// name, unknown type, default that does not parse as the key's type or is out of range.
std::vector<ConfigKey> ReadSchema(const cai_config_key* keys, size_t count, std::string_view owner);

// Validates `table` (NULL = empty) against `schema`. `where` names the table in messages
// ("[plugin.ddp] in job.toml"). Throws cai::Error (INVALID_ARGUMENT) on the first problem.
std::unique_ptr<cai_config> ValidateConfig(const std::vector<ConfigKey>& schema,
                                           const toml::table* table, std::string_view where);

// Typed reads for the host table (cai_host_api.config_get_*).
cai_status* ConfigGetBool(const cai_config* config, const char* key, bool* out);
cai_status* ConfigGetInt(const cai_config* config, const char* key, int64_t* out);
cai_status* ConfigGetFloat(const cai_config* config, const char* key, double* out);
cai_status* ConfigGetString(const cai_config* config, const char* key, const char** out);

}  // namespace cai
