// The cai ABI conformance suite: what a plugin must satisfy to load and behave in every 1.x
// host. Plugin authors run it on their own .so (`cai-conformance path/to/name.toml`); the host
// runs the same checks for `cai plugins check`.
#pragma once

#include <filesystem>
#include <ostream>
#include <string>
#include <vector>

#include "cai/plugin.h"

namespace cai::conformance {

struct CheckResult {
  std::string name;  // "manifest", "exports only the entry symbol", ...
  bool passed = false;
  std::string detail;  // why it failed, or what was found
};

struct Options {
  // The host table handed to the plugin by the structural checks; NULL makes a minimal one
  // (status, log and config only).
  const cai_host_api* host = nullptr;
  // Train the plugin for real after the structural checks: `cai train` runs on 1 and 2 ranks
  // compared with the reference strategy, and a resume from its own checkpoint (about 20 s for
  // a small plugin on 2 cores).
  bool behaviour = true;
  // The `cai` program those runs use; empty when none was found (the behaviour checks then
  // fail, saying how to get one).
  std::filesystem::path cai;
  // Keep the runs' temporary directory (also when CAI_CONFORMANCE_KEEP is set and not "0").
  bool keep_runs = false;
};

// Runs every check on the plugin described by `path`: a manifest (.toml), or a .so with its
// manifest beside it (same stem without the lib prefix, or the only .toml in the directory).
// Checks stop at the first one later checks depend on (an unparsable manifest, a library that
// does not load); the behaviour checks run only when every structural check passed.
std::vector<CheckResult> Run(const std::filesystem::path& path, const Options& options);

// The `cai` program beside the running executable (the same bin directory), else the first
// on PATH; empty when there is neither.
std::filesystem::path FindCai();

// Prints one line per check and a summary line "N passed, M failed"; returns true when all
// passed.
bool Report(const std::vector<CheckResult>& results, std::ostream& out);

}  // namespace cai::conformance
