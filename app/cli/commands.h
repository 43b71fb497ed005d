#pragma once
// Sub-commands of `hydrahead`. Each add_* registers its options on `app` and returns the function
// that runs it; main() calls the one the user chose. Runners return the process exit status.
#include <atomic>
#include <functional>
#include <string>
#include <vector>

#include "core/util/strings.h"

namespace CLI { class App; }

namespace hh::cli {

using Runner = std::function<int()>;

Runner add_inspect(CLI::App& app);
Runner add_run(CLI::App& app);
Runner add_tokenize(CLI::App& app);
Runner add_tasks(CLI::App& app);
Runner add_bench(CLI::App& app);
// A sub-command of `bench` that lives in its own file: the parsed command and its runner.
struct BenchSub {
  CLI::App* command;
  Runner run;
};
BenchSub add_bench_gdn(CLI::App& bench);  // cmd_bench_gdn.cpp
// Records a Chrome trace (CPU ops and CUDA kernels) of fn() into `path` where LibTorch has Kineto;
// throws hh::Error otherwise.
void profile_to(const std::string& path, const std::function<void()>& fn);
Runner add_analyze(CLI::App& app);
Runner add_select(CLI::App& app);
Runner add_convert(CLI::App& app);
Runner add_eval(CLI::App& app);
Runner add_train(CLI::App& app);
Runner add_demo(CLI::App& app);

// Exit status conventions shared by every sub-command.
inline constexpr int kExitOk = 0;
inline constexpr int kExitError = 1;        // bad input or failure; the message names what and where
inline constexpr int kExitUnavailable = 2;  // usage error
inline constexpr int kExitInterrupted = 130;  // stopped by Ctrl-C / SIGTERM; nothing was written

// A one-line bar on stderr, redrawn in place on a terminal (at most a few times a second) with the
// elapsed time and an ETA; on a pipe or file it prints nothing.
class ProgressBar {
 public:
  explicit ProgressBar(std::string label);
  ~ProgressBar();
  ProgressBar(const ProgressBar&) = delete;
  ProgressBar& operator=(const ProgressBar&) = delete;
  // fraction in [0, 1]; detail is shown after the percentage (e.g. the current step).
  void update(double fraction, const std::string& detail = {});
  void finish();  // ends the line (once)

 private:
  std::string label_;
  bool tty_;
  bool drawn_ = false;
  double start_s_, last_draw_s_ = -1;
};

using util::format_seconds;  // core/util/strings.h

// Ctrl-C / SIGTERM set the returned flag instead of killing the process, so a long command can stop
// between steps and leave no half-written file; a second signal kills as usual.
const std::atomic<bool>* install_interrupt_flag();

// Parses "1,2,3" (spaces allowed) into ids; throws hh::Error naming the bad item.
std::vector<long long> parse_id_list(const std::string& s, const std::string& what);
// Splits "a,b,c" into trimmed non-empty items.
std::vector<std::string> split_list(const std::string& s);

}  // namespace hh::cli
