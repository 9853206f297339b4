// Running the `cai` binary (or any command) from a test and reading what it printed.
#pragma once

#include <gtest/gtest.h>
#include <sys/wait.h>

#include <cstdio>
#include <fstream>
#include <iterator>
#include <string>

namespace cai::testing {

struct Result {
  int code = -1;       // exit status, or -1 when killed by a signal
  std::string output;  // stdout and stderr together
};

// Runs `command` through /bin/sh with stderr folded into stdout.
inline Result RunCommand(const std::string& command) {
  Result r;
  FILE* pipe = popen((command + " 2>&1").c_str(), "r");
  if (!pipe) return r;
  char buffer[4096];
  size_t n;
  while ((n = fread(buffer, 1, sizeof buffer, pipe)) > 0) r.output.append(buffer, n);
  int status = pclose(pipe);
  r.code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  return r;
}

inline std::string ReadFile(const std::string& path) {
  std::ifstream in(path);
  return std::string(std::istreambuf_iterator<char>(in), {});
}

#define CAI_EXPECT_CONTAINS(haystack, needle)                      \
  EXPECT_NE(std::string(haystack).find(needle), std::string::npos) \
      << "missing: " << (needle) << "\nin:\n"                      \
      << (haystack)

}  // namespace cai::testing
