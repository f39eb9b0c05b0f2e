// run_lock.cpp: the run-directory lock (see run_lock.h).
#include "engine/run_lock.h"

#include <fcntl.h>
#include <signal.h>
#include <spdlog/spdlog.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstring>
#include <ctime>
#include <filesystem>
#include <thread>

#include <nlohmann/json.hpp>

#include "engine/error.h"
#include "engine/json_io.h"

namespace fs = std::filesystem;

namespace mhar {

namespace {

struct Holder {
  bool present = false;  // the file holds a record
  bool readable = false;  // ... that parses
  long long pid = -1;
  std::string host, started;
};

Holder read_holder(int fd, const std::string& path) {
  Holder h;
  char buf[4096];
  const ssize_t n = ::pread(fd, buf, sizeof buf, 0);
  if (n <= 0) return h;
  h.present = true;
  try {
    const nlohmann::json j = parse_json_strict(std::string(buf, size_t(n)), path);
    h.pid = json_to_int(json_member(j, "pid", path), path + ": pid", 1, INT64_MAX);
    h.host = json_to_string(json_member(j, "host", path), path + ": host");
    h.started = json_to_string(json_member(j, "started", path), path + ": started");
    h.readable = true;
  } catch (const Error&) {
  }
  return h;
}

std::string describe(const Holder& h) {
  if (!h.present) return "a process that has not recorded itself yet";
  if (!h.readable) return "a process whose record in the lock file cannot be read";
  return "pid " + std::to_string(h.pid) + " on host " + h.host + " (started " + h.started + ")";
}

std::string utc_now() {
  const std::time_t t = std::time(nullptr);
  std::tm tm{};
  gmtime_r(&t, &tm);
  char buf[32];
  std::strftime(buf, sizeof buf, "%Y-%m-%dT%H:%M:%SZ", &tm);
  return buf;
}

}  // namespace

std::string this_host_name() {
  char buf[256] = {0};
  if (::gethostname(buf, sizeof buf - 1) != 0 || !buf[0]) return "unknown-host";
  return buf;
}

bool process_alive(long long pid) {
  if (pid <= 0 || pid > INT32_MAX) return false;
  return ::kill(pid_t(pid), 0) == 0 || errno == EPERM;
}

RunLock::RunLock(const std::string& run_dir) : path_((fs::path(run_dir) / ".lock").string()) {
  // O_NOFOLLOW: a symlink planted as .lock must not redirect the record's writes;
  // O_NONBLOCK: nor must a FIFO there block the open.
  fd_ = ::open(path_.c_str(), O_RDWR | O_CREAT | O_CLOEXEC | O_NOFOLLOW | O_NONBLOCK, 0644);
  if (fd_ < 0) {
    const int e = errno;
    if (e == ELOOP) fail(path_, ": is a symbolic link, but the run lock must be a regular file; remove it");
    fail(path_, ": cannot open the run lock (", std::strerror(e), ")");
  }
  struct stat st {};
  if (::fstat(fd_, &st) != 0 || !S_ISREG(st.st_mode)) {
    ::close(fd_);
    fd_ = -1;
    fail(path_, ": is not a regular file, but the run lock must be one; remove it");
  }
  if (::flock(fd_, LOCK_EX | LOCK_NB) != 0) {
    const int e = errno;
    if (e != EWOULDBLOCK) {
      ::close(fd_);
      fd_ = -1;
      fail(path_, ": cannot lock (", std::strerror(e),
           "); a run directory must be on a filesystem that supports flock(2)");
    }
    // The holder writes its record right after taking the lock: give it a moment.
    Holder h = read_holder(fd_, path_);
    for (int i = 0; i < 20 && !h.present; ++i) {
      std::this_thread::sleep_for(std::chrono::milliseconds(25));
      h = read_holder(fd_, path_);
    }
    ::close(fd_);
    fd_ = -1;
    std::string note;
    if (h.readable && h.host == this_host_name() && !process_alive(h.pid))
      note = " (that pid is no longer running, so a process it started holds the lock now)";
    fail(run_dir, ": another trainer is using this run directory: ", describe(h), note,
         " holds its lock ", path_, ". Two trainers in one run directory would overwrite each "
         "other's metrics and checkpoints; wait for it to finish or stop it (Ctrl-C checkpoints "
         "and exits), then continue with --resume ", run_dir);
  }
  // Ours. A record on a free lock was left by a holder that never released it: killed.
  const Holder prev = read_holder(fd_, path_);
  if (prev.present) {
    std::string why = "it ended without releasing it (killed?)";
    if (prev.readable && prev.host == this_host_name())
      why = process_alive(prev.pid) && prev.pid != ::getpid()
                ? "pid " + std::to_string(prev.pid) + " is another process now"
                : "that process is gone";
    spdlog::warn("{}: taking over the stale lock of {}: {}", path_, describe(prev), why);
  }
  const std::string record = nlohmann::json({{"pid", (long long)::getpid()},
                                             {"host", this_host_name()},
                                             {"started", utc_now()}})
                                 .dump() + "\n";
  // Written over the old bytes and then cut to length, so no space is freed before the
  // new record is in (a full disk must not lose the lock's description). A failure only
  // costs the description: the lock itself is held, so the run goes on.
  const ssize_t w = ::pwrite(fd_, record.data(), record.size(), 0);
  if (w != ssize_t(record.size()) || ::ftruncate(fd_, off_t(record.size())) != 0 || ::fdatasync(fd_) != 0)
    spdlog::warn("{}: lock held, but recording the holder failed ({}); a second trainer will be "
                 "refused without being told who holds it", path_, std::strerror(errno));
}

RunLock::~RunLock() {
  if (fd_ < 0) return;
  // An empty record on a free lock means the last holder ended normally.
  // (If that fails the next holder logs a stale-lock takeover; nothing else depends on it.)
  const int cleared = ::ftruncate(fd_, 0);
  (void)cleared;
  ::close(fd_);
}

}  // namespace mhar
