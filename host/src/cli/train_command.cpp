#include "cli/train_command.h"

#include <iostream>

#include "core/status.h"
#include "launch/local_launcher.h"
#include "services/host_table.h"
#include "train/job.h"
#include "train/plan.h"
#include "train/trainer.h"

namespace cai {
namespace {

constexpr const char* kTrainUsage =
    "usage: cai train [JOB.toml] [--nproc N] [--run-dir DIR] [--set key=value]...\n"
    "\n"
    "  JOB.toml         the job; without one every key takes its default (--help-keys)\n"
    "  --nproc N        start N ranks on this machine (default: launch.nproc)\n"
    "  --run-dir DIR    where config.resolved.toml, metrics.jsonl, summary.json, logs/ and\n"
    "                   checkpoints/ go (default: runs/<job>-<time>, or runs/defaults-<time>)\n"
    "  --set key=value  override any job key, e.g. --set plugin.name=ddp --set train.steps=20\n"
    "  --help-keys      list every job key with its type, default and meaning\n"
    "\n"
    "Under torchrun (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT), SLURM (SLURM_PROCID, ...) or\n"
    "Open MPI (OMPI_COMM_WORLD_*) variables, each process joins as the rank it is given.\n";

void PrintKeys() {
  for (const auto& [section, keys] : JobSchema()) {
    std::cout << "[" << section << "]\n";
    for (const ConfigKey& key : keys) {
      std::cout << "  " << section << "." << key.name << " (" << ConfigTypeName(key.type)
                << ", default " << key.default_literal << ")\n      " << key.doc << "\n";
    }
  }
  std::cout << "[plugin]\n  plugin.name (string, default \"none\")\n      The strategy: none "
               "(single-process reference) or an installed plugin; its options go in "
               "[plugin.<name>] (`cai plugins info NAME`).\n";
}

}  // namespace

int RunTrainCommand(const GlobalOptions& options, std::span<const std::string> args) {
  TrainOptions train;
  train.plugin_paths = options.plugin_paths;
  auto value = [&](size_t& i, const char* flag) -> const std::string& {
    if (i + 1 >= args.size()) {
      throw Error(CAI_INVALID_ARGUMENT, std::string(flag) + " needs a value\n" + kTrainUsage);
    }
    return args[++i];
  };
  for (size_t i = 0; i < args.size(); ++i) {
    const std::string& a = args[i];
    if (a == "--help" || a == "-h") {
      std::cout << kTrainUsage;
      return 0;
    } else if (a == "--help-keys") {
      PrintKeys();
      return 0;
    } else if (a == "--nproc") {
      train.nproc = launch::ParseNproc(value(i, "--nproc"));
    } else if (a.rfind("--nproc=", 0) == 0) {
      train.nproc = launch::ParseNproc(a.substr(8));
    } else if (a == "--run-dir") {
      train.run_dir = value(i, "--run-dir");
    } else if (a == "--set") {
      train.sets.push_back(value(i, "--set"));
    } else if (a.rfind("--set=", 0) == 0) {
      train.sets.push_back(a.substr(6));
    } else if (!a.empty() && a[0] == '-') {
      throw Error(CAI_INVALID_ARGUMENT, "unknown option '" + a + "'\n" + kTrainUsage);
    } else if (train.job_file.empty()) {
      train.job_file = a;
    } else {
      throw Error(CAI_INVALID_ARGUMENT, "more than one job file ('" + train.job_file.string() +
                                            "' and '" + a + "')\n" + kTrainUsage);
    }
  }
  // No job file: the built-in defaults of every key, with the --set overrides.
  return RunTrain(train);
}

}  // namespace cai

namespace cai {

int RunPlanCommand(const GlobalOptions& options, std::span<const std::string> args) {
  const std::string usage = "usage: cai plan JOB.toml [--nproc N] [--set key=value]...";
  std::filesystem::path job_file;
  int nproc = 0;
  std::vector<std::string> sets;
  for (size_t i = 0; i < args.size(); ++i) {
    const std::string& a = args[i];
    if (a == "--help" || a == "-h") {
      std::cout << usage
                << "\n\nParameters, per-rank model-state memory of each strategy (ZeRO "
                   "formulas) and the strategy plugin.name = \"auto\" would pick.\n";
      return 0;
    } else if (a == "--nproc" && i + 1 < args.size()) {
      nproc = launch::ParseNproc(args[++i]);
    } else if (a == "--set" && i + 1 < args.size()) {
      sets.push_back(args[++i]);
    } else if (!a.empty() && a[0] != '-' && job_file.empty()) {
      job_file = a;
    } else {
      throw Error(CAI_INVALID_ARGUMENT, "unexpected argument '" + a + "'; " + usage);
    }
  }
  if (job_file.empty()) throw Error(CAI_INVALID_ARGUMENT, "no job file given; " + usage);
  JobConfig job = LoadJob(job_file, sets);
  if (nproc == 0) nproc = static_cast<int>(GetInt(*job.launch, "nproc"));
  PrintPlan(MakePlan(job, nproc, options.plugin_paths, HostServicesTable()), std::cout);
  return 0;
}

}  // namespace cai
