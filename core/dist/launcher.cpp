#include "core/dist/launcher.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <thread>

#include "core/util/error.h"

namespace hh::dist {
namespace {

constexpr auto kPoll = std::chrono::milliseconds(20);  // how often the launcher looks at its ranks

volatile sig_atomic_t g_pending_signal = 0;

extern "C" void on_launcher_signal(int sig) { g_pending_signal = sig; }

std::string describe_status(int status) {
  if (WIFSIGNALED(status)) {
    const int sig = WTERMSIG(status);
    const char* name = strsignal(sig);
    return "was killed by signal " + std::to_string(sig) + " (" + (name ? name : "?") + ")";
  }
  return "exited with status " + std::to_string(WEXITSTATUS(status));
}

int exit_code(int status) { return WIFSIGNALED(status) ? 128 + WTERMSIG(status) : WEXITSTATUS(status); }

}  // namespace

int free_local_port() {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  if (fd < 0) throw Error(std::string("cannot open a socket to find a free port: ") + std::strerror(errno));
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  a.sin_port = 0;
  socklen_t len = sizeof a;
  if (::bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof a) != 0 || ::getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len) != 0) {
    const std::string why = std::strerror(errno);
    ::close(fd);
    throw Error("cannot find a free TCP port on 127.0.0.1: " + why);
  }
  ::close(fd);
  return ntohs(a.sin_port);
}

LaunchResult launch_local(const LaunchOptions& o, const std::function<void(const std::string&)>& report) {
  if (o.nproc < 1) throw Error("--nproc-per-node must be at least 1");
  if (o.argv.empty()) throw Error("internal: nothing to launch");
  const int port = free_local_port();
  std::vector<char*> args;
  for (const auto& a : o.argv) args.push_back(const_cast<char*>(a.c_str()));
  args.push_back(nullptr);

  struct sigaction sa {};
  sa.sa_handler = on_launcher_signal;
  sigemptyset(&sa.sa_mask);
  struct sigaction old_int {}, old_term {};
  g_pending_signal = 0;
  ::sigaction(SIGINT, &sa, &old_int);
  ::sigaction(SIGTERM, &sa, &old_term);

  const pid_t parent = ::getpid();
  std::vector<pid_t> pids(static_cast<size_t>(o.nproc), -1);
  for (int r = 0; r < o.nproc; ++r) {
    const pid_t pid = ::fork();
    if (pid < 0) {
      for (pid_t p : pids)
        if (p > 0) ::kill(-p, SIGKILL);
      throw Error(std::string("cannot start rank ") + std::to_string(r) + ": " + std::strerror(errno));
    }
    if (pid == 0) {
      ::setpgid(0, 0);
      ::prctl(PR_SET_PDEATHSIG, SIGTERM);
      if (::getppid() != parent) _exit(1);  // the launcher died before prctl
      ::signal(SIGINT, SIG_DFL);
      ::signal(SIGTERM, SIG_DFL);
      ::setenv("MASTER_ADDR", "127.0.0.1", 1);
      ::setenv("MASTER_PORT", std::to_string(port).c_str(), 1);
      ::setenv("RANK", std::to_string(r).c_str(), 1);
      ::setenv("WORLD_SIZE", std::to_string(o.nproc).c_str(), 1);
      ::setenv("LOCAL_RANK", std::to_string(r).c_str(), 1);
      ::setenv("LOCAL_WORLD_SIZE", std::to_string(o.nproc).c_str(), 1);
      ::setenv("NCCL_NVLS_ENABLE", "0", 0);  // NVLink multicast stays off unless asked for
      ::execv(args[0], args.data());
      std::fprintf(stderr, "rank %d: cannot run %s: %s\n", r, args[0], std::strerror(errno));
      _exit(127);
    }
    ::setpgid(pid, pid);  // as the child does: no window in which a signal to the group misses it
    pids[static_cast<size_t>(r)] = pid;
  }

  LaunchResult result;
  int alive = o.nproc;
  bool stopping = false;  // a rank failed: the others are being stopped
  bool interrupted = false;
  auto deadline = std::chrono::steady_clock::time_point::max();
  while (alive > 0) {
    if (g_pending_signal != 0) {
      const int sig = g_pending_signal;
      g_pending_signal = 0;
      interrupted = true;
      for (pid_t p : pids)
        if (p > 0) ::kill(-p, sig);
    }
    int status = 0;
    const pid_t pid = ::waitpid(-1, &status, WNOHANG);
    if (pid > 0) {
      int rank = -1;
      for (int r = 0; r < o.nproc; ++r)
        if (pids[static_cast<size_t>(r)] == pid) rank = r;
      if (rank < 0) continue;
      pids[static_cast<size_t>(rank)] = -1;
      --alive;
      const bool ok = WIFEXITED(status) && WEXITSTATUS(status) == 0;
      // After an interrupt, status 130 (checkpoint written, stopped) is what was asked for.
      const bool asked = interrupted && WIFEXITED(status) && WEXITSTATUS(status) == 130;
      if (asked && result.failed_rank < 0) result.exit_status = 130;
      if (!ok && !asked && result.failed_rank < 0) {
        result.failed_rank = rank;
        result.exit_status = exit_code(status);
        result.message = "rank " + std::to_string(rank) + " (pid " + std::to_string(pid) + ") " + describe_status(status);
        if (alive > 0) {
          report(result.message + "; stopping the other " + std::to_string(alive) + " rank(s)");
          for (pid_t p : pids)
            if (p > 0) {
              ::kill(-p, SIGTERM);
              ::kill(-p, SIGCONT);  // a stopped rank gets to act on the SIGTERM
            }
          stopping = true;
          deadline = std::chrono::steady_clock::now() +
                     std::chrono::milliseconds(static_cast<int64_t>(o.grace_s * 1000.0));
        } else {
          report(result.message);
        }
      }
      continue;
    }
    if (pid < 0 && errno != EINTR && errno != ECHILD) break;
    if (stopping && std::chrono::steady_clock::now() >= deadline) {
      for (int r = 0; r < o.nproc; ++r)
        if (pids[static_cast<size_t>(r)] > 0) {
          report("rank " + std::to_string(r) + " did not stop within " + std::to_string(static_cast<int>(o.grace_s)) +
                 " s of SIGTERM; sending SIGKILL");
          ::kill(-pids[static_cast<size_t>(r)], SIGKILL);
        }
      deadline = std::chrono::steady_clock::time_point::max();
    }
    std::this_thread::sleep_for(kPoll);
  }
  ::sigaction(SIGINT, &old_int, nullptr);
  ::sigaction(SIGTERM, &old_term, nullptr);
  return result;
}

}  // namespace hh::dist
