// The host table this build hands to plugins, with every service it provides: model,
// optimizer, communicator, memory pool and checkpoint writer.
#pragma once

#include "cai/plugin.h"

namespace cai {

const cai_host_api* HostServicesTable();

}  // namespace cai
