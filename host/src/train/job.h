// The training job: a TOML file (README.md, "Using cai") whose every key has a
// documented default, overridden by `--set key=value`, validated section by section against
// the same schema machinery plugins use, and printed/saved resolved.
#pragma once

#include <filesystem>
#include <map>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "cai/optimizer.h"
#include "cai/plugin.h"
#include "loader/config.h"
#include "model/model.h"

namespace cai {

struct JobConfig {
  std::filesystem::path file;  // the job file as given ("" for none)
  std::string resolved_toml;   // every section with defaults filled, for config.resolved.toml

  // Validated sections; read them with the Get* helpers below.
  std::unique_ptr<cai_config> model, optimizer, data, train, checkpoint, launch, memory;

  std::string plugin;  // plugin.name: "none", "auto" or an installed plugin
  // The raw [plugin.<name>] table of the chosen plugin as TOML text ("" if absent); validated
  // against the plugin's own schema once the plugin is loaded.
  std::string plugin_table_toml;
  // Every [plugin.<name>] table the job has, by plugin name, as TOML text: what
  // plugin.name = "auto" keeps of the user's options for the strategy it picks.
  std::map<std::string, std::string> plugin_tables;
  // Where each of those tables was written, for messages: " (line 12)", " (from --set ...)".
  std::map<std::string, std::string> plugin_table_where;
  // The job as parsed, --set applied, with each value's source (line or --set option).
  std::shared_ptr<const toml::table> root;
};

// The strategies cai ships, whether or not they are installed here.
const std::vector<std::string_view>& ShippedPlugins();

// Checks each [plugin.<name>] table against the plugins that exist: "none", `installed` (the
// loader's names) and ShippedPlugins(). Throws cai::Error (INVALID_ARGUMENT) for a table that
// names no plugin (a misspelling: [plugin.fdsp]), naming the table, where it was written and
// the nearest plugin name. Returns a warning for each table of another real plugin than
// plugin.name, which the run does not use; none under plugin.name = "auto", which may choose
// any of them.
std::vector<std::string> CheckPluginTables(const JobConfig& job,
                                           const std::vector<std::string>& installed);

// The job schema: the documented keys of each section, for `cai train --help-keys` and docs.
const std::vector<std::pair<std::string, std::vector<ConfigKey>>>& JobSchema();

// Reads `file` (may be empty: all defaults) and applies `sets` ("section.key=value"; the value
// is a TOML literal, or taken as a string when it is not one). Throws cai::Error naming the
// file, the key and what to do: malformed TOML, unknown section or key (nearest valid named),
// wrong type or range.
JobConfig LoadJob(const std::filesystem::path& file, const std::vector<std::string>& sets);

// Validates the chosen plugin's table against its schema (the nearest valid key is named for
// an unknown one) and appends it to resolved_toml.
std::unique_ptr<cai_config> ResolvePluginConfig(JobConfig& job,
                                                const std::vector<ConfigKey>& schema);

// The zoo model [model] describes (model.kind gpt2 or llama).
ModelConfig ZooModelConfig(const cai_config& model);
// train.precision as the ABI's enumeration.
cai_precision ParsePrecision(const std::string& precision);

// The [memory] budget keys, each a tier's budget: MemoryBudget(job, key) in bytes, 0 = none.
inline constexpr const char* kBudgetKeys[] = {"device_budget", "pinned_host_budget", "host_budget"};
// [memory] `key` as bytes; throws INVALID_ARGUMENT naming the key, the file and the forms a
// size takes when it is not one.
uint64_t MemoryBudget(const JobConfig& job, const char* key);

bool GetBool(const cai_config& c, const char* key);
int64_t GetInt(const cai_config& c, const char* key);
double GetFloat(const cai_config& c, const char* key);
const std::string& GetString(const cai_config& c, const char* key);

}  // namespace cai
