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

// Runs every check on the plugin described by `path`: a manifest (.toml), or a .so with its
// manifest beside it (same stem without the lib prefix, or the only .toml in the directory).
// Checks stop at the first one later checks depend on (an unparsable manifest, a library that
// does not load). `host` is the host table handed to the plugin; NULL makes a minimal one
// (status, log and config only).
std::vector<CheckResult> Run(const std::filesystem::path& path, const cai_host_api* host);

// Prints one line per check and a summary line "N passed, M failed"; returns true when all
// passed.
bool Report(const std::vector<CheckResult>& results, std::ostream& out);

}  // namespace cai::conformance
