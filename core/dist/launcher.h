#pragma once
// The local launcher behind `--nproc-per-node N`: starts N copies of a command as ranks 0..N-1 of one
// job on this host (MASTER_ADDR=127.0.0.1, MASTER_PORT a free port, RANK, WORLD_SIZE, LOCAL_RANK,
// LOCAL_WORLD_SIZE; NCCL_NVLS_ENABLE=0 unless already set) and waits for them.
//  - A rank that exits non-zero or is killed ends the job: the others (each rank's process group) get SIGTERM, then SIGKILL after
//    the grace period; the report names the rank and its exit status or signal.
//  - SIGINT / SIGTERM to the launcher are passed on to every rank once each (a first one asks them to
//    checkpoint and stop, a second one ends them). The ranks run in their own process group, so a
//    terminal's Ctrl-C reaches them only through the launcher, and they get SIGTERM if it dies.
// No LibTorch here.
#include <functional>
#include <string>
#include <vector>

namespace hh::dist {

struct LaunchOptions {
  std::vector<std::string> argv;  // the command of every rank; argv[0] is the executable's path
  int nproc = 1;
  double grace_s = 10;            // after the first failure, SIGTERM then SIGKILL this much later
};

struct LaunchResult {
  int exit_status = 0;            // 0, the failed rank's status, or 128 + its signal
  int failed_rank = -1;           // the first rank that failed; -1 when none did
  std::string message;            // what happened to it ("" when every rank succeeded)
};

// `report` receives one line per event (a rank failing, the others being stopped).
LaunchResult launch_local(const LaunchOptions& options, const std::function<void(const std::string&)>& report);

// A TCP port that was free on 127.0.0.1 a moment ago (bound to port 0 and released).
int free_local_port();

}  // namespace hh::dist
