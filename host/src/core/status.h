// The host's side of cai_status: creation, inspection, and the guard that turns C++
// exceptions into statuses at every ABI entry point the host implements.
#pragma once

#include <stdexcept>
#include <string>
#include <string_view>

#include "cai/core.h"

namespace cai {

// An error with a cai status code, thrown inside the host and turned into a cai_status at the
// boundary by Guard().
class Error : public std::runtime_error {
 public:
  Error(cai_status_code code, const std::string& message)
      : std::runtime_error(message), code_(code) {}
  cai_status_code code() const { return code_; }

 private:
  cai_status_code code_;
};

cai_status* MakeStatus(cai_status_code code, std::string_view message);
void DestroyStatus(cai_status* status);
cai_status_code StatusCode(const cai_status* status);
const char* StatusMessage(const cai_status* status);

// Throws cai::Error carrying the status's code and message, and destroys the status.
// Does nothing for NULL (success).
void ThrowIfError(cai_status* status);

// Every ABI argument or out struct the host receives: throws INVALID_ARGUMENT unless `s` is
// non-NULL and its struct_size covers `needed`, the bytes of the struct's first version:
// CAI_STRUCT_SIZE(type, the last field ABI 1.0 had), never today's CAI_*_STRUCT_SIZE, which
// grows when a minor appends and would refuse every older caller. Fields beyond the caller's
// struct_size read as absent (CAI_HAS_FIELD), and out fields beyond it are not written.
// `what` names the argument, e.g. "param_info: out".
template <class S>
void RequireStructSize(const S* s, size_t needed, std::string_view what) {
  if (s == nullptr) throw Error(CAI_INVALID_ARGUMENT, std::string(what) + " is NULL");
  if (s->struct_size < needed) {
    throw Error(CAI_INVALID_ARGUMENT,
                std::string(what) + ".struct_size is " + std::to_string(s->struct_size) +
                    ", smaller than the " + std::to_string(needed) +
                    " bytes of ABI v1.0: set it to the struct's CAI_*_STRUCT_SIZE macro");
  }
}

// Runs `fn` and returns NULL, or the status of whatever it threw. Never throws.
template <class F>
cai_status* Guard(F&& fn) noexcept {
  try {
    fn();
    return nullptr;
  } catch (const Error& e) {
    return MakeStatus(e.code(), e.what());
  } catch (const std::bad_alloc&) {
    return MakeStatus(CAI_RESOURCE_EXHAUSTED, "out of host memory");
  } catch (const std::exception& e) {
    return MakeStatus(CAI_INTERNAL, e.what());
  } catch (...) {
    return MakeStatus(CAI_INTERNAL, "unknown C++ exception");
  }
}

}  // namespace cai
