#pragma once
// Sub-commands of `hydrahead`. Each add_* registers its options on `app` and returns the function
// that runs it; main() calls the one the user chose. Runners return the process exit status.
#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "core/util/strings.h"

namespace CLI { class App; }
namespace c10 { struct Device; }
namespace hh::dist { class ProcessGroup; }

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
// Waits for the device's queued work (a no-op on the CPU).
void sync_device(const c10::Device& d);
// Milliseconds of each of `iters` runs of fn after `warmup` untimed ones, each ended by sync_device,
// sorted ascending; median_ms is their median.
std::vector<double> sample_ms(const c10::Device& dev, int64_t warmup, int64_t iters, const std::function<void()>& fn);
double median_ms(const c10::Device& dev, int64_t warmup, int64_t iters, const std::function<void()>& fn);
// Milliseconds a run of fn takes when `iters` runs are queued back to back after `warmup` untimed ones,
// with one sync_device at the end: the device's time per run once the host keeps ahead of it (each
// run's launches and host work overlap the previous run's kernels), as kernel benchmarks such as
// Triton's do_bench report it. On the CPU, the mean of the runs.
double back_to_back_ms(const c10::Device& dev, int64_t warmup, int64_t iters, const std::function<void()>& fn);
// back_to_back_ms's figure (ms) and the host's part of it (host_ms): the time to queue a run, from the
// first timed run's start to the last one's return, before the sync, per run. Where host_ms comes close to
// ms the host, not the device, sets the pace of the back-to-back runs. On the CPU the two are one time.
struct BackToBack {
  double ms = 0;
  double host_ms = 0;
};
BackToBack back_to_back(const c10::Device& dev, int64_t warmup, int64_t iters, const std::function<void()>& fn);
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

// --dtype of the commands that load a checkpoint (model::resolve_dtype).
constexpr const char* kDtypeHelp =
    "f32, bf16, f16 or f64; auto: the checkpoint's, but f32 on the CPU for a 16-bit checkpoint (CPUs without "
    "16-bit matrix units emulate those products, many times slower)";

// Ctrl-C / SIGTERM set the returned flag instead of killing the process, so a long command can stop
// between steps and leave no half-written file; a second signal kills as usual.
const std::atomic<bool>* install_interrupt_flag();

// ---- several processes (dist_cli.cpp, core/dist) ----
struct DistArgs {
  int nproc = 0;             // --nproc-per-node (0 or 1: this process alone)
  double timeout_s = 300;    // --dist-timeout
};
void set_command_line(int argc, char** argv);   // main() keeps it for the launcher
void add_dist_options(CLI::App& app, DistArgs& a);
// With --nproc-per-node N > 1: starts N ranks of this same command line (without the option), waits
// for them and returns the exit status to use; -1 when this process should do the work itself.
int maybe_launch(const DistArgs& a);
// The process group when this process is a rank (set up by the launcher, torchrun or srun); null when
// it runs alone. `device` is the command's --device (cuda -> NCCL on cuda:LOCAL_RANK, cpu -> Gloo).
std::shared_ptr<dist::ProcessGroup> join_group(const DistArgs& a, const std::string& device);
// Tells the other ranks (if any) that this one is failing and why; they name it in their errors.
void report_failure_to_peers(const std::string& message);

// Parses "1,2,3" (spaces allowed) into ids; throws hh::Error naming the bad item.
std::vector<long long> parse_id_list(const std::string& s, const std::string& what);
// Splits "a,b,c" into trimmed non-empty items.
std::vector<std::string> split_list(const std::string& s);

}  // namespace hh::cli
