// run_lock.h: one trainer per run directory.
//
// A trainer holds an advisory lock (flock(2), exclusive) on RUN_DIR/.lock for its whole
// run, taken before anything in the directory is written or rewritten. A second trainer
// on the same directory (a `train` and a `train --resume` beside it) is refused with the
// holder's pid and host, which the lock file records. The kernel drops a flock when its
// holder dies, however it dies, so a lock left by a killed process is free: the next
// trainer takes it over and logs whose it was. A holder that ends normally clears the
// record, so a record found on a free lock always means its writer was killed.
//
// The lock file is the one file the engine rewrites in place: the lock belongs to the
// inode, so the record cannot be published by rename (engine/file_io.h); it is only a
// description of the holder, and is written without freeing its old bytes first.
#pragma once
#include <string>

namespace mhar {

class RunLock {
 public:
  // Takes the lock of `run_dir` (which must exist) or throws mhar::Error naming the
  // holder (pid, host, start time) and the lock file.
  explicit RunLock(const std::string& run_dir);
  ~RunLock();  // clears the record and releases the lock
  RunLock(const RunLock&) = delete;
  RunLock& operator=(const RunLock&) = delete;
  const std::string& path() const { return path_; }

 private:
  std::string path_;
  int fd_ = -1;
};

// This machine's host name (as recorded in lock files).
std::string this_host_name();
// Whether a process with this pid exists on this machine (kill(pid, 0)).
bool process_alive(long long pid);

}  // namespace mhar
