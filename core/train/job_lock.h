#pragma once
// Who is training in a run directory. A job holds an exclusive advisory lock (flock) on <output>/.lock
// for its lifetime, so that a second job in the same directory is refused, and so that a reader (the
// workbench following a run, `hydrahead train --status`) can tell a run that is being written from one
// whose job has stopped: the lock goes with the job's process, however it ends.
#include <filesystem>

namespace hh::train {

class JobLock {
 public:
  // Takes <dir>/.lock (created if absent). A reader's probe holds the lock for microseconds, so a
  // busy lock is tried again for about a second before the directory counts as taken; then throws
  // "<dir>: another training job is running in this directory".
  explicit JobLock(const std::filesystem::path& dir);
  ~JobLock();
  JobLock(const JobLock&) = delete;
  JobLock& operator=(const JobLock&) = delete;

 private:
  int fd_ = -1;
};

// Whether a job holds <dir>/.lock now (false when there is no such file). Works across processes on
// one host, and across hosts where the file system carries flock (NFSv4, Lustre with flock).
bool job_running(const std::filesystem::path& dir);

}  // namespace hh::train
