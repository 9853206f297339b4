// `cai plan`: parameters, per-rank model-state memory of each strategy, and the strategy
// `plugin.name = "auto"` picks.
#pragma once

#include <cstdint>
#include <filesystem>
#include <ostream>
#include <string>
#include <vector>

#include "cai/plugin.h"
#include "model/model.h"
#include "train/job.h"

namespace cai {

// Trainable elements (Ψ), the largest unit and the layout of a zoo model, from its config
// alone (no weights are allocated, so a 70B plan costs nothing): every parameter's elements
// and unit in the zoo's registration order, and every unit's kind (CAI_UNIT_*), as
// cai_memory_estimate_args passes them to a strategy.
struct ModelSize {
  int64_t params = 0;
  int64_t largest_unit = 0;
  std::vector<int64_t> param_numel;
  std::vector<int32_t> param_unit;
  std::vector<int32_t> unit_kind;
};
ModelSize ZooModelSize(const ModelConfig& config);

// "812.5 MiB", "3.25 GiB".
std::string FormatBytes(uint64_t bytes);

// One rank's model-state memory as a strategy estimates it (estimate_memory, ABI 1.1).
struct MemoryEstimate {
  uint64_t device_bytes = 0;  // per rank, model states (+ FSDP's gathered units)
  uint64_t host_bytes = 0;    // per rank, offloaded states
  std::string formula;        // the plugin's, e.g. "(2+2+12)Ψ/N"
};

// Asks `api` (which must have estimate_memory) for its estimate under its validated table
// `config`, for `job`'s precision and optimizer on `world_size` ranks.
MemoryEstimate EstimateMemory(const cai_plugin_api& api, const cai_config& config,
                              const JobConfig& job, const ModelSize& size, int world_size);

// One configuration of one strategy: a plugin and the options it runs with.
struct StrategyEstimate {
  std::string name;    // "low_level_zero (stage = 2, cpu_offload = true)"
  std::string plugin;  // the plugin it needs
  // The [plugin.<plugin>] keys this configuration sets beyond the user's table, as TOML
  // literals; what auto applies when it picks it.
  std::vector<std::pair<std::string, std::string>> options;
  bool installed = false;
  bool estimated = false;     // the plugin estimated itself (estimate_memory, ABI 1.1)
  uint64_t device_bytes = 0;  // per rank, model states (+ FSDP's gathered units)
  uint64_t host_bytes = 0;    // per rank, offloaded states
  std::string formula;        // the plugin's, or why there is no estimate
};

struct Plan {
  ModelSize size;
  int world_size = 1;
  cai_precision precision = CAI_PRECISION_FP32;
  uint64_t device_budget = 0;    // what one rank's device tier may hold
  uint64_t enforced_budget = 0;  // memory.device_budget (0 = none): enforced at run time
  std::vector<StrategyEstimate> estimates;
  std::string choice;  // plugin name auto picks
  // The chosen plugin's [plugin.<choice>] table as auto runs it: the user's, plus the options
  // of the configuration it sized (TOML text).
  std::string choice_table;
  std::string reason;
};

// Builds the plan for `job` on `world_size` ranks. Each candidate configuration (a plugin and
// options: low_level_zero at stage 1, at stage 2, at stage 2 with cpu_offload, ...) is sized by
// the installed plugin's own estimate_memory (ABI 1.1) with the user's [plugin.<name>] table
// and the candidate's options; a plugin without one is listed and never picked. The choice
// follows ColossalAI's sizing guide (its docs, booster_plugins.md): DDP below 2B parameters,
// low-level ZeRO / FSDP up to 10B, Gemini above, hybrid parallel beyond 60B; the first
// installed configuration in that order whose per-rank memory fits the device budget
// (memory.device_budget where it is lower, else launch.device_memory_gib, else this machine's
// memory over the ranks) wins.
Plan MakePlan(const JobConfig& job, int world_size, const std::vector<std::filesystem::path>& paths,
              const cai_host_api* host);

void PrintPlan(const Plan& plan, std::ostream& out);

}  // namespace cai
