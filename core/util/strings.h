#pragma once
// Small text helpers shared by the front ends: command-line lists, durations and byte counts.
#include <string>
#include <vector>

namespace hh::util {

// Splits "a, b,,c" at commas into trimmed, non-empty items: {"a", "b", "c"}.
std::vector<std::string> split_list(const std::string& s);

// "12.3s", "4m05s", "2h07m".
std::string format_seconds(double s);
// Binary units with one decimal: "1.5 KiB", "12.0 MiB".
std::string human_bytes(double bytes);

}  // namespace hh::util
