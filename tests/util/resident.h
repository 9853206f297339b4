// The process's resident memory, for tests of what an allocator gives back to the kernel.
#pragma once

#include <cstdint>
#include <fstream>
#include <string>

namespace cai::testing {

// VmRSS of /proc/self/status, in bytes.
inline uint64_t ResidentBytes() {
  std::ifstream status("/proc/self/status");
  for (std::string line; std::getline(status, line);) {
    if (line.rfind("VmRSS:", 0) == 0) return std::stoull(line.substr(6)) * 1024;
  }
  return 0;
}

}  // namespace cai::testing
