#include "launch/rank_env.h"

#include <gtest/gtest.h>

#include <map>

#include "core/status.h"

namespace cai::launch {
namespace {

using Vars = std::map<std::string, std::string, std::less<>>;

EnvLookup From(const Vars& vars) {
  return [vars](std::string_view name) -> std::optional<std::string> {
    const auto it = vars.find(name);
    if (it == vars.end()) return std::nullopt;
    return it->second;
  };
}

// Asserts detection fails with INVALID_ARGUMENT and a message containing `part`.
void ExpectRejected(const Vars& vars, const std::string& part) {
  try {
    DetectRankEnv(From(vars));
    ADD_FAILURE() << "accepted an inconsistent environment";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), CAI_INVALID_ARGUMENT);
    EXPECT_NE(std::string(e.what()).find(part), std::string::npos)
        << "'" << part << "' missing from: " << e.what();
  }
}

TEST(DetectRankEnv, NoLauncherVariables_IsASingleProcessRun) {
  EXPECT_FALSE(DetectRankEnv(From({{"HOME", "/root"}})).has_value());
}

TEST(DetectRankEnv, TorchrunVariables_AreReadAsGiven) {
  const auto env = DetectRankEnv(From({{"RANK", "5"},
                                       {"WORLD_SIZE", "8"},
                                       {"LOCAL_RANK", "1"},
                                       {"MASTER_ADDR", "node0"},
                                       {"MASTER_PORT", "1234"},
                                       {"TORCHELASTIC_RUN_ID", "job7"}}));
  ASSERT_TRUE(env.has_value());
  EXPECT_EQ(env->launcher, "torchrun");
  EXPECT_EQ(env->rank, 5);
  EXPECT_EQ(env->world_size, 8);
  EXPECT_EQ(env->local_rank, 1);
  EXPECT_EQ(env->master_addr, "node0");
  EXPECT_EQ(env->master_port, 1234);
  EXPECT_EQ(env->run_id, "job7");
}

TEST(DetectRankEnv, SlurmVariables_TakeMasterFromLaunchNodeAndDefaultPort) {
  const auto env = DetectRankEnv(From({{"SLURM_PROCID", "3"},
                                       {"SLURM_NTASKS", "4"},
                                       {"SLURM_LOCALID", "1"},
                                       {"SLURM_LAUNCH_NODE_IPADDR", "10.0.0.7"},
                                       {"SLURM_JOB_ID", "991"},
                                       {"SLURM_STEP_ID", "2"}}));
  ASSERT_TRUE(env.has_value());
  EXPECT_EQ(env->launcher, "slurm");
  EXPECT_EQ(env->rank, 3);
  EXPECT_EQ(env->world_size, 4);
  EXPECT_EQ(env->local_rank, 1);
  EXPECT_EQ(env->master_addr, "10.0.0.7");
  EXPECT_EQ(env->master_port, kDefaultMasterPort);
  EXPECT_EQ(env->run_id, "991.2");
}

TEST(DetectRankEnv, SlurmWithMasterAddr_PrefersMasterAddr) {
  const auto env = DetectRankEnv(From({{"SLURM_PROCID", "0"},
                                       {"SLURM_NTASKS", "2"},
                                       {"SLURM_LOCALID", "0"},
                                       {"SLURM_LAUNCH_NODE_IPADDR", "10.0.0.7"},
                                       {"MASTER_ADDR", "head"},
                                       {"MASTER_PORT", "4000"}}));
  ASSERT_TRUE(env.has_value());
  EXPECT_EQ(env->master_addr, "head");
  EXPECT_EQ(env->master_port, 4000);
}

TEST(DetectRankEnv, OpenMpiVariables_AreRead) {
  const auto env = DetectRankEnv(From({{"OMPI_COMM_WORLD_RANK", "2"},
                                       {"OMPI_COMM_WORLD_SIZE", "3"},
                                       {"OMPI_COMM_WORLD_LOCAL_RANK", "0"},
                                       {"MASTER_ADDR", "host-a"}}));
  ASSERT_TRUE(env.has_value());
  EXPECT_EQ(env->launcher, "openmpi");
  EXPECT_EQ(env->rank, 2);
  EXPECT_EQ(env->world_size, 3);
  EXPECT_EQ(env->local_rank, 0);
  EXPECT_EQ(env->master_addr, "host-a");
  EXPECT_EQ(env->run_id, "host-a:29500");
}

TEST(DetectRankEnv, MpichAndIntelMpiVariables_AreRead) {
  const auto env = DetectRankEnv(From({{"PMI_RANK", "1"},
                                       {"PMI_SIZE", "4"},
                                       {"MPI_LOCALRANKID", "1"},
                                       {"PMI_KVSNAME", "kvs_123_0"},
                                       {"MASTER_ADDR", "host-b"}}));
  ASSERT_TRUE(env.has_value());
  EXPECT_EQ(env->launcher, "mpich");
  EXPECT_EQ(env->rank, 1);
  EXPECT_EQ(env->world_size, 4);
  EXPECT_EQ(env->local_rank, 1);
  EXPECT_EQ(env->run_id, "kvs_123_0");
}

TEST(DetectRankEnv, TorchrunAndSlurmBothSet_TorchrunWins) {
  const auto env = DetectRankEnv(From({{"RANK", "1"},
                                       {"WORLD_SIZE", "2"},
                                       {"LOCAL_RANK", "1"},
                                       {"MASTER_ADDR", "127.0.0.1"},
                                       {"SLURM_PROCID", "0"},
                                       {"SLURM_NTASKS", "1"},
                                       {"SLURM_LOCALID", "0"},
                                       {"OMPI_COMM_WORLD_RANK", "0"}}));
  ASSERT_TRUE(env.has_value());
  EXPECT_EQ(env->launcher, "torchrun");
  EXPECT_EQ(env->rank, 1);
}

TEST(DetectRankEnv, SingleRankWithoutMaster_UsesLoopback) {
  const auto env = DetectRankEnv(From({{"RANK", "0"}, {"WORLD_SIZE", "1"}, {"LOCAL_RANK", "0"}}));
  ASSERT_TRUE(env.has_value());
  EXPECT_EQ(env->master_addr, "127.0.0.1");
}

TEST(DetectRankEnv, RankNotBelowWorldSize_IsRejected) {
  ExpectRejected({{"RANK", "4"}, {"WORLD_SIZE", "4"}, {"LOCAL_RANK", "0"}, {"MASTER_ADDR", "h"}},
                 "RANK=4 is not below WORLD_SIZE=4");
  ExpectRejected(
      {{"SLURM_PROCID", "2"}, {"SLURM_NTASKS", "2"}, {"SLURM_LOCALID", "0"}, {"MASTER_ADDR", "h"}},
      "SLURM_PROCID=2 is not below SLURM_NTASKS=2");
  ExpectRejected({{"RANK", "0"}, {"WORLD_SIZE", "2"}, {"LOCAL_RANK", "2"}, {"MASTER_ADDR", "h"}},
                 "LOCAL_RANK=2 is not below WORLD_SIZE=2");
}

TEST(DetectRankEnv, NonNumericOrNegativeValues_AreRejectedNamingVariable) {
  ExpectRejected({{"RANK", "one"}, {"WORLD_SIZE", "2"}, {"LOCAL_RANK", "0"}}, "RANK='one'");
  ExpectRejected({{"RANK", "0"}, {"WORLD_SIZE", "2x"}, {"LOCAL_RANK", "0"}}, "WORLD_SIZE='2x'");
  ExpectRejected({{"OMPI_COMM_WORLD_RANK", "-1"},
                  {"OMPI_COMM_WORLD_SIZE", "2"},
                  {"OMPI_COMM_WORLD_LOCAL_RANK", "0"}},
                 "OMPI_COMM_WORLD_RANK='-1'");
  ExpectRejected({{"RANK", "0"}, {"WORLD_SIZE", "0"}, {"LOCAL_RANK", "0"}}, "WORLD_SIZE='0'");
  ExpectRejected(
      {{"RANK", "0"}, {"WORLD_SIZE", "1"}, {"LOCAL_RANK", "0"}, {"MASTER_PORT", "70000"}},
      "MASTER_PORT='70000'");
}

TEST(DetectRankEnv, PartialOrMasterlessEnvironment_SaysWhatToSet) {
  ExpectRejected({{"WORLD_SIZE", "2"}, {"LOCAL_RANK", "0"}}, "RANK is not");
  ExpectRejected({{"SLURM_PROCID", "0"}, {"SLURM_NTASKS", "2"}}, "SLURM_LOCALID is not");
  ExpectRejected({{"OMPI_COMM_WORLD_RANK", "0"},
                  {"OMPI_COMM_WORLD_SIZE", "2"},
                  {"OMPI_COMM_WORLD_LOCAL_RANK", "0"}},
                 "-x MASTER_ADDR");
  ExpectRejected({{"RANK", "0"}, {"WORLD_SIZE", "2"}, {"LOCAL_RANK", "0"}}, "set MASTER_ADDR");
}

}  // namespace
}  // namespace cai::launch
