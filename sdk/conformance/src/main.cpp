// cai-conformance: runs the ABI conformance suite on a plugin, for plugin authors.
#include <iostream>

#include "cai/conformance.hpp"

int main(int argc, char** argv) {
  if (argc != 2 || std::string(argv[1]) == "--help") {
    std::cerr << "usage: cai-conformance PLUGIN.toml|libPLUGIN.so\n"
                 "Checks a cai strategy plugin against ABI "
              << CAI_ABI_MAJOR << "." << CAI_ABI_MINOR << " and exits non-zero on any failure.\n";
    return argc == 2 ? 0 : 2;
  }
  auto results = cai::conformance::Run(argv[1], nullptr);
  return cai::conformance::Report(results, std::cout) ? 0 : 1;
}
