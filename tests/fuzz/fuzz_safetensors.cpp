// The safetensors reader (`model.init_from`, `cai import`), on any bytes: open, then read every
// tensor it accepted (up to 1 MiB each).
#include <cstdint>
#include <vector>

#include "checkpoint/safetensors.h"
#include "core/status.h"
#include "fuzz_input.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const auto path = cai::fuzz::Scratch() / "model.safetensors";
  cai::fuzz::WriteFile(path, {reinterpret_cast<const char*>(data), size});
  try {
    const cai::ckpt::SafetensorsReader reader(path);
    std::vector<char> buffer;
    for (const cai::ckpt::SafetensorsTensor& t : reader.tensors()) {
      if (t.bytes() > (1u << 20)) continue;
      buffer.resize(t.bytes());
      reader.Read(t, 0, buffer.data(), buffer.size());
    }
  } catch (const cai::Error&) {
  }
  return 0;
}
