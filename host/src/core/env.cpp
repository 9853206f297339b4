#include "core/env.h"

#include <cstdlib>

namespace cai {

const char* SecureGetenv(const char* name) {
  const char* value = ::secure_getenv(name);
  return value && *value ? value : nullptr;
}

}  // namespace cai
