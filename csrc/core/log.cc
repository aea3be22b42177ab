#include "core/log.h"

#include <atomic>
#include <cstdio>
#include <mutex>

#include "core/config.h"

namespace gpucoll {
namespace {

std::atomic<int> g_level{-1};
std::atomic<int> g_rank{-1};

int parse_level(const std::string& text) {
  std::string t;
  for (char c : text) t += static_cast<char>(c >= 'a' && c <= 'z' ? c - 32 : c);
  if (t == "ERROR") return 0;
  if (t == "WARN" || t == "WARNING") return 1;
  if (t == "INFO") return 2;
  if (t == "DEBUG") return 3;
  if (t == "TRACE") return 4;
  return 1;
}

const char* level_name(LogLevel level) {
  switch (level) {
    case LogLevel::kError:
      return "ERROR";
    case LogLevel::kWarn:
      return "WARN ";
    case LogLevel::kInfo:
      return "INFO ";
    case LogLevel::kDebug:
      return "DEBUG";
    case LogLevel::kTrace:
      return "TRACE";
  }
  return "?";
}

}  // namespace

LogLevel log_level() {
  int level = g_level.load(std::memory_order_relaxed);
  if (level < 0) {
    level = parse_level(config_raw("GPUCOLL_LOG_LEVEL"));
    g_level.store(level, std::memory_order_relaxed);
  }
  return static_cast<LogLevel>(level);
}

void set_log_level(LogLevel level) { g_level.store(static_cast<int>(level), std::memory_order_relaxed); }

void set_log_rank(int rank) { g_rank.store(rank, std::memory_order_relaxed); }

void log_write(LogLevel level, const std::string& message) {
  static std::mutex mu;
  const int rank = g_rank.load(std::memory_order_relaxed);
  std::lock_guard<std::mutex> lock(mu);
  if (rank >= 0) {
    std::fprintf(stderr, "[gpucoll %d] %s %s\n", rank, level_name(level), message.c_str());
  } else {
    std::fprintf(stderr, "[gpucoll -] %s %s\n", level_name(level), message.c_str());
  }
  std::fflush(stderr);
}

}  // namespace gpucoll
