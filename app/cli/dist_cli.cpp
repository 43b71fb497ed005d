// --nproc-per-node / --dist-timeout for the commands that run on several processes (train, analyze,
// bench train): the local launcher, joining the process group, telling the peers about a failure.
#include <unistd.h>

#include <CLI/CLI.hpp>

#include <climits>
#include <cstdio>
#include <memory>
#include <string>
#include <vector>

#include "app/cli/commands.h"
#include "core/dist/env.h"
#include "core/dist/launcher.h"
#include "core/dist/process_group.h"
#include "core/util/error.h"

namespace hh::cli {
namespace {

std::vector<std::string> g_command_line;
std::weak_ptr<dist::ProcessGroup> g_group;

std::string self_executable() {
  char buf[PATH_MAX];
  const ssize_t n = ::readlink("/proc/self/exe", buf, sizeof buf - 1);
  if (n <= 0) throw Error("cannot find this program's path (/proc/self/exe) to start the ranks");
  return std::string(buf, static_cast<size_t>(n));
}

}  // namespace

void set_command_line(int argc, char** argv) { g_command_line.assign(argv, argv + argc); }

void add_dist_options(CLI::App& app, DistArgs& a) {
  app.add_option("--nproc-per-node", a.nproc,
                 "Run N processes of this command on this host (one per GPU when the device is cuda, else CPU workers "
                 "over Gloo) and wait for them; see docs/DISTRIBUTED.md. Under torchrun or srun leave it out: "
                 "RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT (or SLURM_*) are read instead");
  app.add_option("--dist-timeout", a.timeout_s,
                 "Seconds a rank waits for the others (rendezvous, each collective) before it fails with a "
                 "message naming the rank")
      ->capture_default_str();
}

int maybe_launch(const DistArgs& a) {
  if (a.nproc < 0) throw Error("--nproc-per-node must be at least 1");
  if (a.timeout_s <= 0) throw Error("--dist-timeout must be positive (seconds)");
  if (a.nproc <= 1) return -1;
  if (dist::env_from_process().distributed())
    throw Error("--nproc-per-node starts its own ranks, but this process already is one (RANK / WORLD_SIZE or SLURM_* "
                "with MASTER_ADDR are set); leave --nproc-per-node out under torchrun or srun");
  dist::LaunchOptions lo;
  lo.nproc = a.nproc;
  lo.argv.push_back(self_executable());
  for (size_t i = 1; i < g_command_line.size(); ++i) {
    const std::string& s = g_command_line[i];
    if (s == "--nproc-per-node") {
      ++i;  // and its value
      continue;
    }
    if (s.rfind("--nproc-per-node=", 0) == 0) continue;
    lo.argv.push_back(s);
  }
  std::fprintf(stderr, "starting %d ranks of: hydrahead", a.nproc);
  for (size_t i = 1; i < lo.argv.size(); ++i) std::fprintf(stderr, " %s", lo.argv[i].c_str());
  std::fprintf(stderr, "\n");
  const dist::LaunchResult r = dist::launch_local(lo, [](const std::string& line) { std::fprintf(stderr, "hydrahead: %s\n", line.c_str()); });
  if (r.failed_rank >= 0) {
    std::fprintf(stderr, "error: %s\n", r.message.c_str());
    return r.exit_status != 0 ? r.exit_status : kExitError;
  }
  return r.exit_status;
}

std::shared_ptr<dist::ProcessGroup> join_group(const DistArgs& a, const std::string& device) {
  const dist::DistEnv env = dist::env_from_process();
  if (!env.distributed()) return nullptr;
  auto g = dist::ProcessGroup::create(env, device, a.timeout_s);
  g_group = g;
  return g;
}

void report_failure_to_peers(const std::string& message) {
  if (auto g = g_group.lock()) g->report_failure(message);
}

}  // namespace hh::cli
