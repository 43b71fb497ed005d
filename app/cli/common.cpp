#include <cctype>
#include <string>
#include <vector>

#include "app/cli/commands.h"
#include "core/util/error.h"

namespace hh::cli {

std::vector<std::string> split_list(const std::string& s) {
  std::vector<std::string> out;
  std::string cur;
  auto flush = [&] {
    size_t a = cur.find_first_not_of(" \t");
    size_t b = cur.find_last_not_of(" \t");
    if (a != std::string::npos) out.push_back(cur.substr(a, b - a + 1));
    cur.clear();
  };
  for (char c : s) {
    if (c == ',') flush();
    else cur += c;
  }
  flush();
  return out;
}

std::vector<long long> parse_id_list(const std::string& s, const std::string& what) {
  std::vector<long long> ids;
  const auto items = split_list(s);
  for (size_t i = 0; i < items.size(); ++i) {
    const auto& item = items[i];
    size_t used = 0;
    long long v = 0;
    bool ok = !item.empty() && (std::isdigit(static_cast<unsigned char>(item[0])) || item[0] == '-');
    if (ok) {
      try {
        v = std::stoll(item, &used);
      } catch (const std::exception&) {
        ok = false;
      }
    }
    if (!ok || used != item.size())
      throw Error(what + ": item " + std::to_string(i) + " '" + item + "' is not an integer");
    ids.push_back(v);
  }
  if (ids.empty()) throw Error(what + ": no ids given");
  return ids;
}

}  // namespace hh::cli
