// What the fuzz targets share: the input written to a file under a per-process scratch
// directory, since the parsers under test read paths, as cai does.
#pragma once

#include <unistd.h>

#include <cstdint>
#include <filesystem>
#include <fstream>
#include <string>
#include <string_view>

namespace cai::fuzz {

inline const std::filesystem::path& Scratch() {
  static const std::filesystem::path dir = [] {
    auto d = std::filesystem::temp_directory_path() / ("cai-fuzz-" + std::to_string(::getpid()));
    std::filesystem::create_directories(d);
    return d;
  }();
  return dir;
}

inline void WriteFile(const std::filesystem::path& path, std::string_view bytes) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
}

// Splits off the text up to the first NUL (all of it when there is none).
inline std::string_view TakeUntilNul(std::string_view& rest) {
  const size_t nul = rest.find('\0');
  const std::string_view head = rest.substr(0, nul);
  rest = nul == std::string_view::npos ? std::string_view() : rest.substr(nul + 1);
  return head;
}

}  // namespace cai::fuzz
