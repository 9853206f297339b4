#include "loader/host_api.h"

#include "core/log.h"
#include "core/status.h"
#include "loader/config.h"

#ifndef CAI_VERSION
#error "CAI_VERSION must be defined by the build"
#endif

namespace cai {
namespace {

cai_status* StatusCreate(cai_status_code code, const char* message, size_t length) {
  return MakeStatus(code, message ? std::string_view(message, length) : std::string_view());
}

void LogSink(cai_log_level level, const char* source, const char* message, size_t length) {
  Log(level, source ? source : "", message ? std::string_view(message, length) : "");
}

}  // namespace

const cai_host_api* MakeHostApi(const HostServices& services) {
  auto* api = new cai_host_api{};  // Lives for the process: plugins keep the pointer.
  api->struct_size = CAI_HOST_API_STRUCT_SIZE;
  api->abi_major = CAI_ABI_MAJOR;
  api->abi_minor = CAI_ABI_MINOR;
  api->host_version = CAI_VERSION;
  api->status_create = StatusCreate;
  api->status_destroy = DestroyStatus;
  api->status_code = StatusCode;
  api->status_message = StatusMessage;
  api->log = LogSink;
  api->config_get_bool = ConfigGetBool;
  api->config_get_int = ConfigGetInt;
  api->config_get_float = ConfigGetFloat;
  api->config_get_string = ConfigGetString;
  api->model = services.model;
  api->optimizer = services.optimizer;
  api->comm = services.comm;
  api->mempool = services.mempool;
  api->checkpoint = services.checkpoint;
  return api;
}

}  // namespace cai
