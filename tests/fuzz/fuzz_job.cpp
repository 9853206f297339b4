// The job parser: a job file, then (after a NUL) --set values, one per line. Errors are
// cai::Error, which a user sees as a message; anything else (a crash, a sanitizer report, an
// escaping std::exception other than cai::Error) is a finding.
#include <cstdint>
#include <string>
#include <vector>

#include "core/status.h"
#include "fuzz_input.h"
#include "train/job.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  std::string_view rest(reinterpret_cast<const char*>(data), size);
  const std::string_view job = cai::fuzz::TakeUntilNul(rest);
  std::vector<std::string> sets;
  while (!rest.empty()) {
    const size_t end = rest.find('\n');
    sets.emplace_back(rest.substr(0, end));
    rest = end == std::string_view::npos ? std::string_view() : rest.substr(end + 1);
  }
  const auto path = cai::fuzz::Scratch() / "job.toml";
  cai::fuzz::WriteFile(path, job);
  try {
    cai::JobConfig config = cai::LoadJob(path, sets);
    (void)cai::ResolvePluginConfig;  // needs a loaded plugin: covered by the host tests
  } catch (const cai::Error&) {
  }
  return 0;
}
