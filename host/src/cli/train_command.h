// `cai train` and `cai plan` argument parsing.
#pragma once

#include <span>
#include <string>

#include "cli/plugins_command.h"

namespace cai {

// Runs `cai train ARGS...`; returns the exit status.
int RunTrainCommand(const GlobalOptions& options, std::span<const std::string> args);

// Runs `cai plan ARGS...`; returns the exit status.
int RunPlanCommand(const GlobalOptions& options, std::span<const std::string> args);

}  // namespace cai
