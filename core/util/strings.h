#pragma once
// Small text helpers shared by the parsers of command-line lists.
#include <string>
#include <vector>

namespace hh::util {

// Splits "a, b,,c" at commas into trimmed, non-empty items: {"a", "b", "c"}.
std::vector<std::string> split_list(const std::string& s);

}  // namespace hh::util
