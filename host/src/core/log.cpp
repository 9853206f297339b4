#include "core/log.h"

#include <spdlog/sinks/basic_file_sink.h>
#include <spdlog/sinks/stdout_color_sinks.h>
#include <spdlog/spdlog.h>

#include <string>

namespace cai {
namespace {

spdlog::level::level_enum ToSpdlog(cai_log_level level) {
  switch (level) {
    case CAI_LOG_TRACE:
      return spdlog::level::trace;
    case CAI_LOG_DEBUG:
      return spdlog::level::debug;
    case CAI_LOG_INFO:
      return spdlog::level::info;
    case CAI_LOG_WARN:
      return spdlog::level::warn;
    default:
      return spdlog::level::err;
  }
}

}  // namespace

namespace {
int log_rank = 0;
std::shared_ptr<spdlog::sinks::sink> console_sink;
}  // namespace

void InitLogging(int rank, cai_log_level level, bool console_rank) {
  log_rank = rank;
  auto console = std::make_shared<spdlog::sinks::stderr_color_sink_mt>();
  console->set_pattern(console_rank ? "[%Y-%m-%d %H:%M:%S.%e] [rank " + std::to_string(rank) +
                                          "] [%^%l%$] %v"
                                    : "[%Y-%m-%d %H:%M:%S.%e] [%^%l%$] %v");
  console_sink = console;
  auto logger = std::make_shared<spdlog::logger>("cai", console);
  logger->set_level(ToSpdlog(level));
  logger->flush_on(spdlog::level::info);
  spdlog::set_default_logger(logger);
}

void AddLogFile(const std::string& path) {
  auto file = std::make_shared<spdlog::sinks::basic_file_sink_mt>(path);
  file->set_pattern("[%Y-%m-%d %H:%M:%S.%e] [rank " + std::to_string(log_rank) + "] [%l] %v");
  spdlog::default_logger()->sinks().push_back(file);
}

void SetConsoleLogging(bool on) {
  if (console_sink) console_sink->set_level(on ? spdlog::level::trace : spdlog::level::off);
}

void Log(cai_log_level level, std::string_view source, std::string_view message) {
  if (source.empty()) {
    spdlog::log(ToSpdlog(level), "{}", message);
  } else {
    spdlog::log(ToSpdlog(level), "[{}] {}", source, message);
  }
}

}  // namespace cai
