// `cai bench comm`.
#pragma once

#include <span>
#include <string>

#include "cli/plugins_command.h"

namespace cai {

// Runs `cai bench ARGS...`; returns the exit status.
int RunBenchCommand(const GlobalOptions& options, std::span<const std::string> args);

}  // namespace cai
