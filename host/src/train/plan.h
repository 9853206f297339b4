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

// Trainable elements (Ψ) and the largest unit of a zoo model, from its config alone (no
// weights are allocated, so a 70B plan costs nothing).
struct ModelSize {
  int64_t params = 0;
  int64_t largest_unit = 0;
};
ModelSize ZooModelSize(const ModelConfig& config);

struct StrategyEstimate {
  std::string name;    // "ddp", "low_level_zero (stage 2)", ...
  std::string plugin;  // the plugin it needs
  bool installed = false;
  uint64_t device_bytes = 0;  // per rank, model states (+ FSDP's gathered units)
  uint64_t host_bytes = 0;    // per rank, offloaded states
  std::string formula;
};

struct Plan {
  ModelSize size;
  int world_size = 1;
  cai_precision precision = CAI_PRECISION_FP32;
  uint64_t device_budget = 0;  // what one rank's device tier may hold
  std::vector<StrategyEstimate> estimates;
  std::string choice;  // plugin name auto picks
  std::string reason;
};

// Builds the plan for `job` on `world_size` ranks. Installed plugins (found on the search
// path) decide what auto may pick; a plugin's own estimate_memory (ABI 1.1) is used when it has
// one. The choice follows ColossalAI's sizing guide (its docs, booster_plugins.md): DDP below 2B
// parameters, low-level ZeRO / FSDP up to 10B, Gemini above, hybrid parallel beyond 60B; the
// first installed strategy in that order whose per-rank memory fits the device budget wins.
Plan MakePlan(const JobConfig& job, int world_size, const std::vector<std::filesystem::path>& paths,
              const cai_host_api* host);

void PrintPlan(const Plan& plan, std::ostream& out);

}  // namespace cai
