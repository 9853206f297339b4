// Which rank this process is, from the variables a launcher sets. Checked in this order, the
// first launcher whose variables are present wins:
//   1. torchrun style (also what `cai train --nproc N` sets): RANK, WORLD_SIZE, LOCAL_RANK,
//      MASTER_ADDR, MASTER_PORT;
//   2. SLURM (srun): SLURM_PROCID, SLURM_NTASKS, SLURM_LOCALID; master address from
//      MASTER_ADDR, else SLURM_LAUNCH_NODE_IPADDR;
//   3. Open MPI (mpirun): OMPI_COMM_WORLD_RANK, OMPI_COMM_WORLD_SIZE,
//      OMPI_COMM_WORLD_LOCAL_RANK; master address from MASTER_ADDR;
//   4. MPICH and Intel MPI (Hydra's mpiexec): PMI_RANK, PMI_SIZE, MPI_LOCALRANKID; master
//      address from MASTER_ADDR.
// Under SLURM and the MPIs the port is MASTER_PORT, else kDefaultMasterPort. A job step that
// runs `cai train --nproc N` inside an sbatch script still sees SLURM_PROCID; the CLI decides
// that --nproc wins.
#pragma once

#include <functional>
#include <optional>
#include <string>
#include <string_view>

namespace cai::launch {

// torchrun's default rendezvous port.
inline constexpr int kDefaultMasterPort = 29500;

struct RankEnv {
  int rank = 0;
  int world_size = 1;
  int local_rank = 0;
  std::string master_addr;  // host name or address of rank 0
  int master_port = kDefaultMasterPort;
  std::string launcher;  // "torchrun", "slurm", "openmpi" or "mpich": where the values came from
  // The same string on every rank of one launch and different between launches (so ranks
  // agree on scratch names, e.g. a checkpoint's temporary directory): CAI_RUN_ID,
  // TORCHELASTIC_RUN_ID, SLURM_JOB_ID.SLURM_STEP_ID, OMPI_MCA_ess_base_jobid, PMI_KVSNAME, else
  // "<master_addr>:<master_port>".
  std::string run_id;
};

// Returns the value of an environment variable, or nullopt when unset.
using EnvLookup = std::function<std::optional<std::string>(std::string_view name)>;

// Reads the process environment.
std::optional<std::string> ProcessEnv(std::string_view name);

// The rank environment, or nullopt when no launcher's variables are present (a plain
// single-process run). Throws cai::Error (INVALID_ARGUMENT) naming the variable and its value
// when one is not a non-negative integer or a port, when the launcher's rank or world size is
// missing, when rank >= world size or local rank >= world size, and when a multi-rank world
// has no master address (saying which variable to set).
std::optional<RankEnv> DetectRankEnv(const EnvLookup& env = ProcessEnv);

}  // namespace cai::launch
