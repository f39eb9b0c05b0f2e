// file_io.cpp: regular-file reading and atomic, checked writing (see file_io.h).
#include "engine/file_io.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <mutex>

#include "engine/error.h"

namespace fs = std::filesystem;

namespace mhar {

namespace {

constexpr uint64_t kFnvPrime = 1099511628211ULL;

// Bytes written through this module since the simulated-disk value was last seen to
// change (see file_io.h), and that value.
std::mutex g_sim_mutex;
uint64_t g_bytes_written = 0;
std::string g_sim_value;

// The simulated-disk limit, or UINT64_MAX when unset. A malformed value is a usage error.
uint64_t simulated_disk_limit() {
  const char* env = std::getenv("MHAR_SIMULATE_DISK_FULL_AFTER_BYTES");
  if (!env || !*env) return UINT64_MAX;
  char* end = nullptr;
  errno = 0;
  const unsigned long long v = std::strtoull(env, &end, 10);
  if (errno || *end || env[0] == '-')
    fail("MHAR_SIMULATE_DISK_FULL_AFTER_BYTES=", env, ": expected a byte count (a whole number >= 0)");
  return v;
}

// write(2) of all `n` bytes to `fd`, each chunk checked and counted against the simulated
// full disk. Throws naming `path`; bytes written before a failure stay in the file (the
// caller decides what to do with them).
void write_all_checked(int fd, const std::string& path, const void* data, size_t n) {
  const auto* p = static_cast<const char*>(data);
  while (n) {
    const size_t chunk = std::min<size_t>(n, size_t(1) << 24);
    {
      std::lock_guard<std::mutex> lock(g_sim_mutex);
      const char* env = std::getenv("MHAR_SIMULATE_DISK_FULL_AFTER_BYTES");
      const std::string value = env ? env : "";
      if (value != g_sim_value) g_sim_value = value, g_bytes_written = 0;
      const uint64_t limit = simulated_disk_limit();
      if (limit != UINT64_MAX && g_bytes_written + chunk > limit)
        fail(path, ": write failed (No space left on device) [simulated by MHAR_SIMULATE_DISK_FULL_AFTER_BYTES]");
    }
    const ssize_t w = ::write(fd, p, chunk);
    if (w < 0) {
      if (errno == EINTR) continue;
      fail(path, ": write failed (", std::strerror(errno), ")");
    }
    if (w == 0) fail(path, ": write failed (wrote nothing)");
    p += w;
    n -= size_t(w);
    std::lock_guard<std::mutex> lock(g_sim_mutex);
    g_bytes_written += uint64_t(w);
  }
}

}  // namespace

const char* file_type_name(mode_t m) {
  if (S_ISREG(m)) return "a regular file";
  if (S_ISDIR(m)) return "a directory";
  if (S_ISFIFO(m)) return "a FIFO (named pipe)";
  if (S_ISCHR(m)) return "a character device";
  if (S_ISBLK(m)) return "a block device";
  if (S_ISSOCK(m)) return "a socket";
  return "neither a file nor a directory";
}

void require_regular_file(const std::string& path, const char* what) {
  struct stat st {};
  if (::stat(path.c_str(), &st) != 0)
    fail(path, ": cannot open ", what, " (", std::strerror(errno), ")");
  if (!S_ISREG(st.st_mode))
    fail(path, ": is ", file_type_name(st.st_mode), ", but a ", what, " must be a regular file");
}

std::string read_regular_file(const std::string& path, const char* what, uint64_t max_bytes) {
  // O_NONBLOCK: opening a FIFO for reading would otherwise wait for a writer forever.
  const int fd = ::open(path.c_str(), O_RDONLY | O_NONBLOCK | O_CLOEXEC);
  if (fd < 0) fail(path, ": cannot open ", what, " (", std::strerror(errno), ")");
  struct stat st {};
  if (::fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
    ::close(fd);
    fail(path, ": is ", file_type_name(st.st_mode), ", but a ", what, " must be a regular file");
  }
  if (uint64_t(st.st_size) > max_bytes) {
    ::close(fd);
    fail(path, ": ", what, " of ", uint64_t(st.st_size), " bytes exceeds the limit of ", max_bytes,
         " bytes");
  }
  std::string out(size_t(st.st_size), '\0');
  size_t got = 0;
  while (got < out.size()) {
    const ssize_t r = ::read(fd, out.data() + got, out.size() - got);
    if (r < 0 && errno == EINTR) continue;
    if (r < 0) {
      const int e = errno;
      ::close(fd);
      fail(path, ": read failed (", std::strerror(e), ")");
    }
    if (r == 0) break;  // shrank while reading
    got += size_t(r);
  }
  ::close(fd);
  out.resize(got);
  return out;
}

uint64_t fnv1a64(uint64_t h, const void* data, size_t n) {
  const auto* p = static_cast<const uint8_t*>(data);
  for (size_t i = 0; i < n; ++i) h = (h ^ p[i]) * kFnvPrime;
  return h;
}

std::string hex64(uint64_t v) {
  char buf[17];
  std::snprintf(buf, sizeof buf, "%016llx", static_cast<unsigned long long>(v));
  return buf;
}

CheckedFile::CheckedFile(const std::string& path) : path_(path) {
  fd_ = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd_ < 0) fail(path, ": cannot create (", std::strerror(errno), ")");
}

CheckedFile::~CheckedFile() {
  if (fd_ >= 0) {
    ::close(fd_);
    ::unlink(path_.c_str());
  }
}

void CheckedFile::write(const void* data, size_t n) {
  MHAR_CHECK(fd_ >= 0, path_, " written after close");
  hash_ = fnv1a64(hash_, data, n);
  write_all_checked(fd_, path_, data, n);
  bytes_ += n;
}

void CheckedFile::close() {
  MHAR_CHECK(fd_ >= 0, path_, " closed twice");
  if (::fsync(fd_) != 0) fail(path_, ": fsync failed (", std::strerror(errno), ")");
  const int fd = fd_;
  fd_ = -1;
  if (::close(fd) != 0) {
    ::unlink(path_.c_str());
    fail(path_, ": close failed (", std::strerror(errno), ")");
  }
}

std::string temp_path_for(const std::string& path) {
  const fs::path p(path);
  return (p.parent_path() / ("." + p.filename().string() + ".tmp-" + std::to_string(::getpid())))
      .string();
}

void publish(CheckedFile& f, const std::string& target) {
  if (f.is_open()) f.close();  // on failure the destructor removes the temporary file
  if (::rename(f.path().c_str(), target.c_str()) != 0) {
    const int e = errno;
    ::unlink(f.path().c_str());
    fail(target, ": cannot replace (", std::strerror(e), ")");
  }
  const fs::path dir = fs::path(target).parent_path();
  fsync_dir(dir.empty() ? "." : dir.string());
}

void write_file_atomic(const std::string& path, const std::string& contents) {
  CheckedFile f(temp_path_for(path));  // removes the temporary file if anything below throws
  f.write(contents);
  publish(f, path);
}

AppendFile::AppendFile(const std::string& path) : path_(path) {
  // O_NONBLOCK: a FIFO put in the file's place must not block the open.
  fd_ = ::open(path.c_str(), O_WRONLY | O_APPEND | O_CLOEXEC | O_NONBLOCK);
  if (fd_ < 0) fail(path, ": cannot open for appending (", std::strerror(errno), ")");
  struct stat st {};
  if (::fstat(fd_, &st) != 0 || !S_ISREG(st.st_mode)) {
    ::close(fd_);
    fd_ = -1;
    fail(path, ": is ", file_type_name(st.st_mode), ", but it must be a regular file");
  }
}

AppendFile::~AppendFile() {
  if (fd_ >= 0) ::close(fd_);
}

void AppendFile::append(const std::string& record) {
  struct stat st {};
  if (::fstat(fd_, &st) != 0) fail(path_, ": cannot stat (", std::strerror(errno), ")");
  try {
    write_all_checked(fd_, path_, record.data(), record.size());
  } catch (const Error& e) {
    // Cut a partly written record off again: the file keeps exactly the whole records.
    if (::ftruncate(fd_, st.st_size) != 0)
      fail(e.what(), "; cutting the partial record off failed too (", std::strerror(errno),
           "): the last line of ", path_, " is incomplete");
    throw;
  }
}

void AppendFile::sync() {
  if (::fdatasync(fd_) != 0) fail(path_, ": fsync failed (", std::strerror(errno), ")");
}

void fsync_dir(const std::string& dir) {
  const int fd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd >= 0) {
    ::fsync(fd);
    ::close(fd);
  }
}

}  // namespace mhar
