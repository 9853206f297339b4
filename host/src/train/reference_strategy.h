// Strategy `none`: one process, no communication — the reference every strategy is checked
// against step by step (tests/plugins/common). It is an ordinary strategy table built with the
// SDK, so the training loop drives it exactly like a plugin.
#pragma once

#include "cai/plugin.h"

namespace cai {

// The table; `host` must be the table the host hands plugins. Valid for the process.
const cai_plugin_api* ReferenceStrategy(const cai_host_api* host);

}  // namespace cai
