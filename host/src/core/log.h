// The host's logger: spdlog with the rank in every line.
#pragma once

#include <string>
#include <string_view>

#include "cai/core.h"

namespace cai {

// Sets up the default logger: stderr, "[time] [rank R] [level] message". With
// `console_rank` false the console lines leave the rank out (a launcher that prefixes every
// line with it is reading them); log files always carry it.
void InitLogging(int rank, cai_log_level level = CAI_LOG_INFO, bool console_rank = true);

// Also writes every log line to `path` (created or appended).
void AddLogFile(const std::string& path);

// Stops (or resumes) the console output of InitLogging's logger; log files keep every line.
void SetConsoleLogging(bool on);

// The host table's log sink: adds the plugin's name as source.
void Log(cai_log_level level, std::string_view source, std::string_view message);

}  // namespace cai
