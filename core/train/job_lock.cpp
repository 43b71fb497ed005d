#include "core/train/job_lock.h"

#include <fcntl.h>
#include <sys/file.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <csignal>
#include <cstring>
#include <fstream>
#include <thread>

#include "core/util/error.h"
#include "core/util/log.h"

namespace hh::train {

namespace {

constexpr int kLockTries = 20;
constexpr auto kLockRetry = std::chrono::milliseconds(50);

}  // namespace

JobLock::JobLock(const std::filesystem::path& dir) {
  const std::filesystem::path p = dir / ".lock";
  fd_ = ::open(p.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0644);
  if (fd_ < 0) throw Error(p.string() + ": cannot open: " + std::strerror(errno));
  for (int attempt = 1;; ++attempt) {
    if (::flock(fd_, LOCK_EX | LOCK_NB) == 0) {
      const std::string owner = std::to_string(::getpid()) + " " + this_host() + "\n";
      if (::ftruncate(fd_, 0) != 0 || ::pwrite(fd_, owner.data(), owner.size(), 0) != static_cast<ssize_t>(owner.size()))
        log::warn(p.string() + ": cannot write the job's process id (" + std::strerror(errno) +
                  "); readers can see the job but not ask it to stop");
      return;
    }
    const int err = errno;
    if (err == EINTR) continue;
    if (err != EWOULDBLOCK || attempt == kLockTries) {
      ::close(fd_);
      if (err != EWOULDBLOCK) throw Error(p.string() + ": cannot lock: " + std::strerror(err));
      throw Error(dir.string() + ": another training job is running in this directory");
    }
    std::this_thread::sleep_for(kLockRetry);
  }
}

JobLock::~JobLock() {
  ::flock(fd_, LOCK_UN);
  ::close(fd_);
}

std::string this_host() {
  char name[256] = {};
  if (::gethostname(name, sizeof name - 1) != 0) return "localhost";
  return name;
}

std::optional<JobOwner> job_owner(const std::filesystem::path& dir) {
  if (!job_running(dir)) return std::nullopt;
  JobOwner o;
  std::ifstream in(dir / ".lock");
  long long pid = 0;
  std::string host;
  if (in >> pid >> host && pid > 0) {
    o.pid = pid;
    o.host = host;
  }
  return o;
}

bool interrupt_job(const std::filesystem::path& dir, std::string* why) {
  auto fail = [why](const std::string& message) {
    if (why) *why = message;
    return false;
  };
  const std::optional<JobOwner> owner = job_owner(dir);
  if (!owner) return fail(dir.string() + ": no job is running there");
  if (owner->pid <= 0) return fail(dir.string() + ": its job does not say its process id");
  if (owner->host != this_host()) return fail(dir.string() + ": its job runs on " + owner->host + ", not on this host");
  // A descriptor of the process first, then the lock checked again: the signal cannot reach a later
  // process that took the same id.
  const int pidfd = static_cast<int>(::syscall(SYS_pidfd_open, static_cast<pid_t>(owner->pid), 0));
  if (pidfd < 0) return fail(dir.string() + ": its job (process " + std::to_string(owner->pid) + ") has ended");
  const std::optional<JobOwner> again = job_owner(dir);
  bool sent = false;
  if (again && again->pid == owner->pid && again->host == owner->host)
    sent = ::syscall(SYS_pidfd_send_signal, pidfd, SIGINT, nullptr, 0) == 0;
  ::close(pidfd);
  if (!sent) return fail(dir.string() + ": its job (process " + std::to_string(owner->pid) + ") has ended");
  return true;
}

bool job_running(const std::filesystem::path& dir) {
  const int fd = ::open((dir / ".lock").c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return false;
  int rc;
  while ((rc = ::flock(fd, LOCK_SH | LOCK_NB)) != 0 && errno == EINTR) {
  }
  const bool held = rc != 0 && errno == EWOULDBLOCK;
  if (rc == 0) ::flock(fd, LOCK_UN);
  ::close(fd);
  return held;
}

}  // namespace hh::train
