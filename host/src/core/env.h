// Paths from the process environment.
#pragma once

namespace cai {

// The value of the environment variable `name`, or nullptr when it is unset or empty, or when
// the process runs in secure-execution mode (setuid, setgid or file capabilities: AT_SECURE),
// where the environment belongs to whoever started the process and must choose no file cai
// reads, writes or loads (secure_getenv(3)). Every path cai takes from the environment goes
// through here; paths from which code is loaded are then trust-checked as well (file_checks.h).
const char* SecureGetenv(const char* name);

}  // namespace cai
