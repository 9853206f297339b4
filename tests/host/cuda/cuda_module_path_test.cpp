// Run with CAI_CUDA_MODULE pointing at a file that does not exist: whether or not this host
// was built with CUDA, the first CUDA tensor names the path it tried and what to do.
#include <gtest/gtest.h>

#include "core/status.h"
#include "cuda/cuda_module.h"
#include "util/subprocess.h"

TEST(CudaModule, MissingModule_NamesThePathAndWhatToDo) {
  for (int attempt = 0; attempt < 2; ++attempt) {  // the failure is remembered, not retried
    try {
      cai::cuda::Load();
      ADD_FAILURE() << "loaded a module that does not exist";
    } catch (const cai::Error& e) {
      EXPECT_EQ(e.code(), CAI_UNAVAILABLE);
      CAI_EXPECT_CONTAINS(std::string(e.what()),
                          "cannot load cai's CUDA module /nonexistent/libcai_cuda.so: ");
      CAI_EXPECT_CONTAINS(std::string(e.what()), "set CAI_CUDA_MODULE to libcai_cuda.so");
    }
  }
}
