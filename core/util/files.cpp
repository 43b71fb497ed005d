#include "core/util/files.h"

namespace hh::util {

namespace fs = std::filesystem;

static void remove_below(const fs::path& dir, int depth) {
  std::error_code ec;
  if (depth < kMaxRemoveDepth)
    for (const auto& e : fs::directory_iterator(dir, ec)) {
      if (e.is_directory(ec) && !e.is_symlink(ec)) remove_below(e.path(), depth + 1);
      else fs::remove(e.path(), ec);
    }
  fs::remove(dir, ec);
}

void remove_tree(const fs::path& dir) { remove_below(dir, 0); }

}  // namespace hh::util
