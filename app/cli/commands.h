#pragma once
// Sub-commands of `hydrahead`. Each add_* registers its options on `app` and returns the function
// that runs it; main() calls the one the user chose. Runners return the process exit status.
#include <functional>
#include <string>
#include <vector>

namespace CLI { class App; }

namespace hh::cli {

using Runner = std::function<int()>;

Runner add_inspect(CLI::App& app);
Runner add_run(CLI::App& app);
Runner add_tokenize(CLI::App& app);
Runner add_tasks(CLI::App& app);
Runner add_bench(CLI::App& app);

// Exit status conventions shared by every sub-command.
inline constexpr int kExitOk = 0;
inline constexpr int kExitError = 1;        // bad input or failure; the message names what and where
inline constexpr int kExitUnavailable = 2;  // usage error, or a sub-command that is not available yet

// Parses "1,2,3" (spaces allowed) into ids; throws hh::Error naming the bad item.
std::vector<long long> parse_id_list(const std::string& s, const std::string& what);
// Splits "a,b,c" into trimmed non-empty items.
std::vector<std::string> split_list(const std::string& s);

}  // namespace hh::cli
