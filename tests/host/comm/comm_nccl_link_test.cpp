// Built only when CUDA and NCCL are found. There may be no GPU, so this proves the NCCL backend
// compiles and links, and that the NCCL library it links answers.
#include <gtest/gtest.h>

#include "comm/nccl_backend.h"

TEST(CommNccl, Comm_NcclBackend_LinksAndReportsLibraryVersion) {
  // NCCL 2.x encodes its version as major*10000 + minor*100 + patch.
  EXPECT_GE(cai::comm::NcclVersion(), 20000);
  EXPECT_NE(&cai::comm::NcclCommunicator::AllReduce, nullptr);
}
