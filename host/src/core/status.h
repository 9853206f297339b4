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
