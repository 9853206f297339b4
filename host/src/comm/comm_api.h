// cai_comm_api, the communicator's ABI table, over the process's cai::Communicator.
#pragma once

#include "cai/comm.h"

namespace cai {

// A static, fully filled table; valid for the life of the process. Its functions act on
// Communicator::Get(): before Communicator::Init, world() is NULL, rank() -1, size() 0, and
// everything that returns a status fails with FAILED_PRECONDITION. work_wait's timeout 0 waits
// for the end of the operation, which the operation's own timeout (the group default unless
// cai_comm_args.timeout_ms says otherwise) bounds.
const cai_comm_api* CommApi();

}  // namespace cai
