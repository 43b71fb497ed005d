#pragma once
// Minimal levelled logging to stderr, shared by the core and the front ends.
// (spdlog is not used: its fmt dependency clashes with the fmt headers LibTorch 2.x ships.)
#include <functional>
#include <string>

namespace hh::log {

enum class Level { Debug = 0, Info = 1, Warn = 2, Error = 3, Off = 4 };

void set_level(Level level);
Level level();
// Parses "debug", "info", "warn", "error", "off"; throws hh::Error naming the value otherwise.
Level parse_level(const std::string& name);
// One line "level: message" on stderr, whole lines even when several threads log.
void write(Level level, const std::string& message);

// Also hands every line that passes the level to `sink` (from any thread; empty: none), e.g. a
// front end's log panel. Returns the previous sink.
using Sink = std::function<void(Level level, const std::string& message)>;
Sink set_sink(Sink sink);

inline void debug(const std::string& m) { write(Level::Debug, m); }
inline void info(const std::string& m) { write(Level::Info, m); }
inline void warn(const std::string& m) { write(Level::Warn, m); }
inline void error(const std::string& m) { write(Level::Error, m); }

}  // namespace hh::log
