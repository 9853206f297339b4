// `cai train`: the training loop every strategy is driven by, and its launcher.
#pragma once

#include <filesystem>
#include <string>
#include <vector>

namespace cai {

struct TrainOptions {
  std::filesystem::path job_file;                   // empty: every key takes its default
  int nproc = 0;                                    // 0: launch.nproc of the job
  std::filesystem::path run_dir;                    // empty: runs/<job name or defaults>-<time>
  std::vector<std::string> sets;                    // --set key=value, in order
  std::vector<std::filesystem::path> plugin_paths;  // --plugin-path
};

// Runs the job: as the launcher of N local ranks, as one rank when the environment names one
// (torchrun, SLURM, Open MPI variables), or in this process. Returns the exit status; errors
// are printed with what, where and what to do.
int RunTrain(const TrainOptions& options);

}  // namespace cai
