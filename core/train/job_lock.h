#pragma once
// Who is training in a run directory. A job holds an exclusive advisory lock (flock) on <output>/.lock
// for its lifetime, so that a second job in the same directory is refused, and so that a reader (the
// workbench following a run, `hydrahead train --status`) can tell a run that is being written from one
// whose job has stopped: the lock goes with the job's process, however it ends. The file's text names
// the holder ("PID HOST"), so that a reader on the same host can ask it to stop.
#include <cstdint>
#include <filesystem>
#include <optional>
#include <string>

namespace hh::train {

class JobLock {
 public:
  // Takes <dir>/.lock (created if absent) and writes this process's id and host into it. A reader's
  // probe holds the lock for microseconds, so a busy lock is tried again for about a second before the
  // directory counts as taken; then throws "<dir>: another training job is running in this directory".
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

// The process that holds <dir>/.lock now, as it wrote itself there; none when no job holds it. pid 0 and
// an empty host when the file does not say (a lock taken by an older version).
struct JobOwner {
  int64_t pid = 0;
  std::string host;
};
std::optional<JobOwner> job_owner(const std::filesystem::path& dir);
// This machine's host name, as job owners are written.
std::string this_host();
// Asks the job that holds <dir> to stop as Ctrl-C does (SIGINT: it writes a checkpoint and exits 130).
// Only a job of this host that names itself can be asked; false with *why (no job holds the directory,
// it runs on another host, it does not say its process, it ended meanwhile) otherwise.
bool interrupt_job(const std::filesystem::path& dir, std::string* why);

}  // namespace hh::train
