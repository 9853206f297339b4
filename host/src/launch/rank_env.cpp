#include "launch/rank_env.h"

#include <charconv>
#include <cstdlib>
#include <limits>

#include "core/status.h"

namespace cai::launch {
namespace {

struct Names {
  const char* launcher;
  const char* rank;
  const char* world_size;
  const char* local_rank;
  const char* master_addr_fallback;  // consulted after MASTER_ADDR; nullptr if none
  const char* no_master_hint;
};

constexpr Names kTorchrun{"torchrun",   "RANK",  "WORLD_SIZE",
                          "LOCAL_RANK", nullptr, "set MASTER_ADDR to the host of rank 0"};
constexpr Names kSlurm{"slurm",
                       "SLURM_PROCID",
                       "SLURM_NTASKS",
                       "SLURM_LOCALID",
                       "SLURM_LAUNCH_NODE_IPADDR",
                       "export MASTER_ADDR (e.g. the first host of "
                       "`scontrol show hostnames $SLURM_JOB_NODELIST`)"};
constexpr Names kOpenMpi{"openmpi",
                         "OMPI_COMM_WORLD_RANK",
                         "OMPI_COMM_WORLD_SIZE",
                         "OMPI_COMM_WORLD_LOCAL_RANK",
                         nullptr,
                         "pass `-x MASTER_ADDR=<host of rank 0>` to mpirun"};
// MPICH's and Intel MPI's Hydra (mpiexec) set PMI_RANK, PMI_SIZE and MPI_LOCALRANKID.
constexpr Names kPmi{"mpich",    "PMI_RANK",
                     "PMI_SIZE", "MPI_LOCALRANKID",
                     nullptr,    "pass `-genv MASTER_ADDR <host of rank 0>` to mpiexec"};

[[noreturn]] void Bad(const std::string& what) {
  throw Error(CAI_INVALID_ARGUMENT, "rank environment: " + what);
}

int ParseInt(std::string_view name, const std::string& value, int min, int max) {
  int parsed = 0;
  const char* end = value.data() + value.size();
  const auto [ptr, ec] = std::from_chars(value.data(), end, parsed);
  if (value.empty() || ec != std::errc() || ptr != end || parsed < min || parsed > max) {
    Bad(std::string(name) + "='" + value + "' is not an integer in [" + std::to_string(min) + ", " +
        std::to_string(max) + "]");
  }
  return parsed;
}

std::string Require(const EnvLookup& env, const Names& names, const char* name) {
  auto value = env(name);
  if (!value) {
    Bad(std::string(names.launcher) + " variables are set but " + name +
        " is not (a launcher sets them together)");
  }
  return *value;
}

RankEnv Read(const EnvLookup& env, const Names& names) {
  constexpr int kMax = std::numeric_limits<int>::max();
  RankEnv out;
  out.launcher = names.launcher;
  out.world_size = ParseInt(names.world_size, Require(env, names, names.world_size), 1, kMax);
  out.rank = ParseInt(names.rank, Require(env, names, names.rank), 0, kMax);
  out.local_rank = ParseInt(names.local_rank, Require(env, names, names.local_rank), 0, kMax);
  if (out.rank >= out.world_size) {
    Bad(std::string(names.rank) + "=" + std::to_string(out.rank) + " is not below " +
        names.world_size + "=" + std::to_string(out.world_size));
  }
  if (out.local_rank >= out.world_size) {
    Bad(std::string(names.local_rank) + "=" + std::to_string(out.local_rank) + " is not below " +
        names.world_size + "=" + std::to_string(out.world_size));
  }

  std::optional<std::string> addr = env("MASTER_ADDR");
  if (!addr && names.master_addr_fallback) addr = env(names.master_addr_fallback);
  if (addr && !addr->empty()) {
    out.master_addr = *addr;
  } else if (out.world_size == 1) {
    out.master_addr = "127.0.0.1";
  } else {
    Bad(std::string("no master address for a world of ") + std::to_string(out.world_size) +
        " ranks under " + names.launcher + ": " + names.no_master_hint);
  }
  if (auto port = env("MASTER_PORT")) out.master_port = ParseInt("MASTER_PORT", *port, 1, 65535);

  if (auto id = env("CAI_RUN_ID")) {
    out.run_id = *id;
  } else if (auto id = env("TORCHELASTIC_RUN_ID")) {
    out.run_id = *id;
  } else if (auto job = env("SLURM_JOB_ID")) {
    out.run_id = *job + "." + env("SLURM_STEP_ID").value_or("0");
  } else if (auto job = env("OMPI_MCA_ess_base_jobid")) {
    out.run_id = *job;
  } else if (auto job = env("PMI_KVSNAME")) {  // Hydra's job name
    out.run_id = *job;
  } else {
    out.run_id = out.master_addr + ":" + std::to_string(out.master_port);
  }
  return out;
}

}  // namespace

std::optional<std::string> ProcessEnv(std::string_view name) {
  const char* value = std::getenv(std::string(name).c_str());
  if (value == nullptr) return std::nullopt;
  return std::string(value);
}

std::optional<RankEnv> DetectRankEnv(const EnvLookup& env) {
  for (const Names* names : {&kTorchrun, &kSlurm, &kOpenMpi, &kPmi}) {
    if (env(names->rank) || env(names->world_size)) return Read(env, *names);
  }
  return std::nullopt;
}

}  // namespace cai::launch
