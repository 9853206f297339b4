// The `cai` command line (README.md, "Using cai").
#include <unistd.h>

#include <cstdio>
#include <iostream>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "cli/bench_command.h"
#include "cli/interop_command.h"
#include "cli/plugins_command.h"
#include "cli/report_command.h"
#include "cli/train_command.h"
#include "core/log.h"
#include "core/status.h"
#include "launch/local_launcher.h"

namespace {

constexpr std::string_view kUsage = R"(usage: cai [--plugin-path DIR]... COMMAND ...

commands:
  train [JOB.toml] [--nproc N] [--run-dir DIR] [--set key=value]...
                            train a job, or the defaults (`cai train --help` for details)
  plan JOB.toml [--nproc N] parameters, per-rank memory of each strategy, what "auto" picks
  export CHECKPOINT --format safetensors OUT_DIR
                            a checkpoint's weights in Hugging Face's names and layouts, with
                            config.json (`cai export --help`)
  import DIR                the [model] keys that train from Hugging Face safetensors in DIR
  report RUN_DIR... [-o OUT.svg|OUT.png]
                            loss, gradient norm, tokens/s and per-rank memory of runs,
                            overlaid in one image (needs gnuplot; `cai report --help`)
  bench comm [--nproc N]    time every collective, nccl-tests style
  plugins list [--json]     every plugin found, with version, ABI, path and status
  plugins info NAME         a plugin's manifest, capabilities and config keys
  plugins check PATH [--structure-only] [--keep-runs]
                            validate a plugin (.toml or .so) with the conformance suite:
                            manifest and library, then it trains like the reference on 1 and
                            2 ranks and resumes from its own checkpoint
  --version                 host and ABI version

Plugins are searched in CAI_PLUGIN_FILES (replaces the rest), --plugin-path, CAI_PLUGIN_PATH,
~/.local/share/cai/plugins, /usr/local/lib/cai/plugins and the installed plugin directory.
)";

int Usage(const std::string& error) {
  std::cerr << "cai: error: " << error << "\n\n" << kUsage;
  return 2;
}

// main, also called in each rank the local launcher forks (launch::SetProgramEntry).
int Main(int argc, char** argv) {
  std::vector<std::string> args(argv + 1, argv + argc);
  cai::GlobalOptions options;
  size_t i = 0;
  for (; i < args.size(); ++i) {
    if (args[i] == "--plugin-path") {
      if (i + 1 >= args.size()) return Usage("--plugin-path needs a directory");
      options.plugin_paths.emplace_back(args[++i]);
    } else if (args[i].rfind("--plugin-path=", 0) == 0) {
      options.plugin_paths.emplace_back(args[i].substr(14));
    } else {
      break;
    }
  }
  std::span<const std::string> rest(args.data() + i, args.size() - i);
  if (rest.empty()) return Usage("no command given");
  cai::InitLogging(0, CAI_LOG_WARN);
  try {
    if (rest[0] == "--version" || rest[0] == "version") {
      std::cout << "cai " << CAI_VERSION << " (ABI " << CAI_ABI_MAJOR << "." << CAI_ABI_MINOR
                << ")\n";
      return 0;
    }
    if (rest[0] == "--help" || rest[0] == "help") {
      std::cout << kUsage;
      return 0;
    }
    if (rest[0] == "plugins") return cai::RunPluginsCommand(options, rest.subspan(1), std::cout);
    if (rest[0] == "train") return cai::RunTrainCommand(options, rest.subspan(1));
    if (rest[0] == "plan") return cai::RunPlanCommand(options, rest.subspan(1));
    if (rest[0] == "bench") return cai::RunBenchCommand(options, rest.subspan(1));
    if (rest[0] == "export") return cai::RunExportCommand(rest.subspan(1), std::cout);
    if (rest[0] == "import") return cai::RunImportCommand(rest.subspan(1), std::cout);
    if (rest[0] == "report") return cai::RunReportCommand(rest.subspan(1), std::cout);
    return Usage("unknown command '" + rest[0] + "'");
  } catch (const cai::Error& e) {
    std::cerr << "cai: error: " << e.what() << "\n";
    return 1;
  } catch (const std::exception& e) {
    std::cerr << "cai: internal error: " << e.what() << "\n";
    return 1;
  }
}

}  // namespace

int main(int argc, char** argv) {
  cai::launch::SetProgramEntry(&Main);
  return Main(argc, argv);
}
