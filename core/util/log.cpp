#include "core/util/log.h"

#include <unistd.h>

#include <atomic>
#include <cstdio>
#include <mutex>

#include "core/util/error.h"

namespace hh::log {
namespace {
std::atomic<Level> g_level{Level::Info};
std::mutex g_mutex;
Sink g_sink;  // guarded by g_mutex
}  // namespace

Sink set_sink(Sink sink) {
  std::lock_guard<std::mutex> lock(g_mutex);
  std::swap(g_sink, sink);
  return sink;
}

void set_level(Level level) { g_level.store(level); }
Level level() { return g_level.load(); }

Level parse_level(const std::string& name) {
  if (name == "debug") return Level::Debug;
  if (name == "info") return Level::Info;
  if (name == "warn" || name == "warning") return Level::Warn;
  if (name == "error") return Level::Error;
  if (name == "off") return Level::Off;
  throw Error("log level '" + name + "' is not one of debug, info, warn, error, off");
}

void write(Level level, const std::string& message) {
  if (level < g_level.load() || level == Level::Off) return;
  static const bool colour = isatty(fileno(stderr)) != 0;
  static const char* const names[] = {"debug", "info", "warning", "error"};
  static const char* const colours[] = {"\033[2m", "\033[32m", "\033[33m", "\033[31m"};
  const int i = static_cast<int>(level);
  std::lock_guard<std::mutex> lock(g_mutex);
  if (colour) std::fprintf(stderr, "%s%s\033[0m: %s\n", colours[i], names[i], message.c_str());
  else std::fprintf(stderr, "%s: %s\n", names[i], message.c_str());
  if (g_sink) g_sink(level, message);
}

}  // namespace hh::log
