/* Root types of the ABI for abidw/abidiff: every struct is reachable from these. */
#include "cai/abi.h"

CAI_EXPORT void cai_abi_probe(const cai_host_api* host, const cai_plugin_api* plugin,
                              cai_plugin_init_args* init, cai_tensor* tensor) {
  (void)host;
  (void)plugin;
  (void)init;
  (void)tensor;
}
