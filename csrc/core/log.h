// Logging to stderr, one line per message, prefixed with the rank: "[gpucoll 3] WARN  message".
// The level comes from GPUCOLL_LOG_LEVEL (read once, at first use, through the config registry).
#pragma once

#include <string>

#include "core/error.h"

namespace gpucoll {

enum class LogLevel : int { kError = 0, kWarn = 1, kInfo = 2, kDebug = 3, kTrace = 4 };

LogLevel log_level();
void set_log_level(LogLevel level);
// Rank shown in the prefix; -1 (before init) shows "-".
void set_log_rank(int rank);
void log_write(LogLevel level, const std::string& message);

#define GPUCOLL_LOG(level, ...)                                                    \
  do {                                                                             \
    if (static_cast<int>(level) <= static_cast<int>(::gpucoll::log_level())) {     \
      ::gpucoll::log_write((level), ::gpucoll::detail::concat(__VA_ARGS__));       \
    }                                                                              \
  } while (0)
#define GPUCOLL_WARN(...) GPUCOLL_LOG(::gpucoll::LogLevel::kWarn, __VA_ARGS__)
#define GPUCOLL_INFO(...) GPUCOLL_LOG(::gpucoll::LogLevel::kInfo, __VA_ARGS__)
#define GPUCOLL_DEBUG(...) GPUCOLL_LOG(::gpucoll::LogLevel::kDebug, __VA_ARGS__)

}  // namespace gpucoll
