#include "core/train/job_lock.h"

#include <fcntl.h>
#include <sys/file.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstring>
#include <thread>

#include "core/util/error.h"

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
    if (::flock(fd_, LOCK_EX | LOCK_NB) == 0) return;
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
