#include "core/status.h"

#include <new>

struct cai_status {
  cai_status_code code;
  std::string message;
};

namespace cai {

cai_status* MakeStatus(cai_status_code code, std::string_view message) {
  return new (std::nothrow) cai_status{code == CAI_OK ? CAI_UNKNOWN : code, std::string(message)};
}

void DestroyStatus(cai_status* status) { delete status; }

cai_status_code StatusCode(const cai_status* status) { return status ? status->code : CAI_OK; }

const char* StatusMessage(const cai_status* status) {
  return status ? status->message.c_str() : "";
}

void ThrowIfError(cai_status* status) {
  if (!status) return;
  Error error(status->code, status->message);
  delete status;
  throw error;
}

}  // namespace cai
