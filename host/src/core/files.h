// Whole small files read for parsing (JSON, metrics lines, configs).
#pragma once

#include <filesystem>
#include <string>

namespace cai {

// The file's bytes; NOT_FOUND "<path>: cannot be read" when it cannot be opened.
std::string ReadTextFile(const std::filesystem::path& path);

}  // namespace cai
