// The plugin manifest parser, on any bytes.
#include <cstdint>

#include "core/status.h"
#include "fuzz_input.h"
#include "loader/manifest.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const auto path = cai::fuzz::Scratch() / "plugin.toml";
  cai::fuzz::WriteFile(path, {reinterpret_cast<const char*>(data), size});
  try {
    (void)cai::ParseManifest(path);
  } catch (const cai::Error&) {
  }
  return 0;
}
