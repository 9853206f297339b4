/* A broken plugin that exports no cai entry point. */
#include "cai/core.h"

CAI_EXPORT int not_a_cai_plugin(void) { return 42; }
