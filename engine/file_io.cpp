// file_io.cpp: regular-file reading and atomic, checked writing (see file_io.h).
#include "engine/file_io.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>

#include "engine/error.h"

namespace fs = std::filesystem;

namespace mhar {

namespace {

constexpr uint64_t kFnvPrime = 1099511628211ULL;

// Bytes written through CheckedFile by this process, for the simulated full disk.
std::atomic<uint64_t> g_bytes_written{0};

const char* kind_of(mode_t m) {
  if (S_ISDIR(m)) return "a directory";
  if (S_ISFIFO(m)) return "a FIFO (named pipe)";
  if (S_ISCHR(m)) return "a character device";
  if (S_ISBLK(m)) return "a block device";
  if (S_ISSOCK(m)) return "a socket";
  return "not a regular file";
}

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

}  // namespace

void require_regular_file(const std::string& path, const char* what) {
  struct stat st {};
  if (::stat(path.c_str(), &st) != 0)
    fail(path, ": cannot open ", what, " (", std::strerror(errno), ")");
  if (!S_ISREG(st.st_mode))
    fail(path, ": is ", kind_of(st.st_mode), ", but a ", what, " must be a regular file");
}

std::string read_regular_file(const std::string& path, const char* what, uint64_t max_bytes) {
  // O_NONBLOCK: opening a FIFO for reading would otherwise wait for a writer forever.
  const int fd = ::open(path.c_str(), O_RDONLY | O_NONBLOCK | O_CLOEXEC);
  if (fd < 0) fail(path, ": cannot open ", what, " (", std::strerror(errno), ")");
  struct stat st {};
  if (::fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
    ::close(fd);
    fail(path, ": is ", kind_of(st.st_mode), ", but a ", what, " must be a regular file");
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
  const uint64_t limit = simulated_disk_limit();
  const auto* p = static_cast<const char*>(data);
  hash_ = fnv1a64(hash_, data, n);
  while (n) {
    const size_t chunk = std::min<size_t>(n, size_t(1) << 24);
    if (limit != UINT64_MAX && g_bytes_written + chunk > limit)
      fail(path_, ": write failed (No space left on device) [simulated by MHAR_SIMULATE_DISK_FULL_AFTER_BYTES]");
    const ssize_t w = ::write(fd_, p, chunk);
    if (w < 0) {
      if (errno == EINTR) continue;
      fail(path_, ": write failed (", std::strerror(errno), ")");
    }
    p += w;
    n -= size_t(w);
    bytes_ += uint64_t(w);
    g_bytes_written += uint64_t(w);
  }
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

void write_file_atomic(const std::string& path, const std::string& contents) {
  const std::string tmp = temp_path_for(path);
  {
    CheckedFile f(tmp);  // removes tmp if anything below throws
    f.write(contents);
    f.close();
  }
  if (::rename(tmp.c_str(), path.c_str()) != 0) {
    const int e = errno;
    ::unlink(tmp.c_str());
    fail(path, ": cannot replace (", std::strerror(e), ")");
  }
  const fs::path dir = fs::path(path).parent_path();
  fsync_dir(dir.empty() ? "." : dir.string());
}

void fsync_dir(const std::string& dir) {
  const int fd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd >= 0) {
    ::fsync(fd);
    ::close(fd);
  }
}

}  // namespace mhar
