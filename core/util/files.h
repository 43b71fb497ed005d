#pragma once
// Removing directories the program itself made (a checkpoint, a temporary output directory).
#include <filesystem>

namespace hh::util {

// Deletes `dir` and everything below it, at most kMaxDepth levels deep, without following symbolic
// links (a link is removed, never what it points to). Errors are ignored: this cleans up after a
// failure or replaces an older copy, and must not hide the error that led here.
inline constexpr int kMaxRemoveDepth = 8;
void remove_tree(const std::filesystem::path& dir);

}  // namespace hh::util
