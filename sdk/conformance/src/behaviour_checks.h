// The conformance suite's behaviour checks: the plugin trains a tiny GPT-2 for real through
// `cai train` subprocesses, only it discoverable, and must end where the single-process
// reference (`plugin.name=none`) does, on 1 and 2 ranks, and resume from its own checkpoint.
#pragma once

#include <filesystem>
#include <vector>

#include "cai/conformance.hpp"
#include "loader/manifest.h"

namespace cai::conformance {

// Appends one result per behaviour check. `cai` is the program to train with (empty: none was
// found, and one failed result says how to get it). The runs go to a temporary directory,
// removed afterwards unless `keep_runs`.
void RunBehaviourChecks(const Manifest& manifest, const std::filesystem::path& cai, bool keep_runs,
                        std::vector<CheckResult>& results);

}  // namespace cai::conformance
