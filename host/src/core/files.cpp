#include "core/files.h"

#include <fstream>
#include <sstream>

#include "core/status.h"

namespace cai {

std::string ReadTextFile(const std::filesystem::path& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw Error(CAI_NOT_FOUND, path.string() + ": cannot be read");
  std::ostringstream s;
  s << in.rdbuf();
  return s.str();
}

}  // namespace cai
