// A broken plugin whose entry point lets a C++ exception escape: the host must catch it,
// report the library and the reason, and go on with the other plugins.
#include <stdexcept>

#include "cai/abi.h"

extern "C" CAI_EXPORT cai_status* cai_plugin_init_v1(cai_plugin_init_args*) {
  throw std::runtime_error("fixture: initialisation exploded");
}
