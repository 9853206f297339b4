// The memory service's ABI table (cai_mem_api), over MemoryPool::Global() and the kernels.
#pragma once

#include "cai/mempool.h"

namespace cai {

// A static, fully filled table; valid for the life of the process. Entry points never throw:
// errors come back as statuses made with cai::MakeStatus.
const cai_mem_api* MemApi();

}  // namespace cai
