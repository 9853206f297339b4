// cai-conformance: runs the ABI conformance suite on a plugin, for plugin authors.
#include <iostream>
#include <string>

#include "cai/conformance.hpp"

namespace {

void Usage(std::ostream& out) {
  out << "usage: cai-conformance [--cai PATH] [--structure-only] [--keep-runs] "
         "PLUGIN.toml|libPLUGIN.so\n"
         "Checks a cai strategy plugin against ABI "
      << CAI_ABI_MAJOR << "." << CAI_ABI_MINOR
      << " and exits non-zero on any failure: its manifest and library, then its behaviour\n"
         "(it trains a tiny GPT-2 with `cai train` on 1 and 2 ranks like the reference strategy\n"
         "and resumes from its own checkpoint).\n"
         "  --cai PATH         the cai program to train with (default: the one beside\n"
         "                     cai-conformance, else the first on PATH)\n"
         "  --structure-only   skip the behaviour checks\n"
         "  --keep-runs        keep the runs' temporary directory (or CAI_CONFORMANCE_KEEP=1)\n";
}

}  // namespace

int main(int argc, char** argv) {
  cai::conformance::Options options;
  std::string plugin;
  bool cai_given = false;
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    if (arg == "--help" || arg == "-h") {
      Usage(std::cout);
      return 0;
    } else if (arg == "--cai" && i + 1 < argc) {
      options.cai = argv[++i];
      cai_given = true;
    } else if (arg == "--structure-only") {
      options.behaviour = false;
    } else if (arg == "--keep-runs") {
      options.keep_runs = true;
    } else if (plugin.empty() && arg.rfind("--", 0) != 0) {
      plugin = arg;
    } else {
      std::cerr << "cai-conformance: unexpected argument '" << arg << "'\n";
      Usage(std::cerr);
      return 2;
    }
  }
  if (plugin.empty()) {
    Usage(std::cerr);
    return 2;
  }
  if (!cai_given) options.cai = cai::conformance::FindCai();
  auto results = cai::conformance::Run(plugin, options);
  return cai::conformance::Report(results, std::cout) ? 0 : 1;
}
