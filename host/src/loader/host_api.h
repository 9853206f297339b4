// The cai_host_api table a plugin receives.
#pragma once

#include "cai/plugin.h"

namespace cai {

// Service tables this host provides; a host built without one (the conformance runner has no
// model or communicator) leaves it NULL and plugins must not call it.
struct HostServices {
  const cai_model_api* model = nullptr;
  const cai_optim_api* optimizer = nullptr;
  const cai_comm_api* comm = nullptr;
  const cai_mem_api* mempool = nullptr;
  const cai_checkpoint_api* checkpoint = nullptr;
};

// Builds the host table. The returned pointer lives for the process; call once.
const cai_host_api* MakeHostApi(const HostServices& services);

}  // namespace cai
