// `cai plugins list|info|check`.
#pragma once

#include <filesystem>
#include <ostream>
#include <span>
#include <string>
#include <vector>

namespace cai {

struct GlobalOptions {
  std::vector<std::filesystem::path> plugin_paths;  // --plugin-path, in order
};

// Runs `cai plugins ARGS...`; returns the exit status. Errors about plugins go to stderr.
int RunPluginsCommand(const GlobalOptions& options, std::span<const std::string> args,
                      std::ostream& out);

}  // namespace cai
