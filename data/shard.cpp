// shard.cpp: llm.c shard writing (temp file + rename) and validated reading (pread, with
// a check after every read that the file is still the one validated at open).
// Host byte order is assumed little-endian, as llm.c assumes.
#include "data/shard.h"

#include <fcntl.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <mutex>
#include <vector>

#include "engine/error.h"
#include "engine/file_io.h"

namespace mhar::data {
namespace {

void write_all(int fd, const void* data, size_t bytes, const std::string& path) {
  const char* p = static_cast<const char*>(data);
  while (bytes > 0) {
    const ssize_t n = ::write(fd, p, bytes);
    if (n < 0) {
      if (errno == EINTR) continue;
      fail(path, ": write failed: ", std::strerror(errno));
    }
    p += n;
    bytes -= static_cast<size_t>(n);
  }
}

}  // namespace

void write_shard(const std::string& path, const std::vector<int32_t>& tokens, int token_bytes) {
  write_shard(path, tokens.data(), tokens.size(), token_bytes);
}

void write_shard(const std::string& path, const int32_t* tokens, size_t count, int token_bytes) {
  if (token_bytes != 2 && token_bytes != 4) fail(path, ": token width ", token_bytes, " bytes is invalid (2 or 4)");
  if (count > static_cast<size_t>(INT32_MAX))
    fail(path, ": ", count, " tokens do not fit one shard (the header count is int32; at most ", INT32_MAX, ")");
  const int64_t limit = token_bytes == 2 ? 65535 : INT32_MAX;
  for (size_t i = 0; i < count; ++i)
    if (tokens[i] < 0 || tokens[i] > limit)
      fail(path, ": token ", i, " has id ", tokens[i], ", outside 0..", limit, " for ", token_bytes, "-byte tokens");
  int32_t header[kShardHeaderInts] = {};
  header[0] = token_bytes == 2 ? kShardMagicU16 : kShardMagicU32;
  header[1] = token_bytes == 2 ? kShardVersionU16 : kShardVersionU32;
  header[2] = static_cast<int32_t>(count);
  const std::string tmp = path + ".tmp." + std::to_string(::getpid());
  const int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
  if (fd < 0) fail(tmp, ": cannot create: ", std::strerror(errno));
  try {
    write_all(fd, header, sizeof(header), tmp);
    std::vector<char> buf;
    const size_t chunk = 1 << 20;
    for (size_t start = 0; start < count; start += chunk) {
      const size_t n = std::min(chunk, count - start);
      buf.resize(n * token_bytes);
      if (token_bytes == 2) {
        auto* out = reinterpret_cast<uint16_t*>(buf.data());
        for (size_t i = 0; i < n; ++i) out[i] = static_cast<uint16_t>(tokens[start + i]);
      } else {
        std::memcpy(buf.data(), tokens + start, n * 4);
      }
      write_all(fd, buf.data(), buf.size(), tmp);
    }
    if (::fsync(fd) != 0) fail(tmp, ": fsync failed: ", std::strerror(errno));
  } catch (...) {
    ::close(fd);
    ::unlink(tmp.c_str());
    throw;
  }
  ::close(fd);
  if (::rename(tmp.c_str(), path.c_str()) != 0) {
    const int err = errno;
    ::unlink(tmp.c_str());
    fail(path, ": cannot rename ", tmp, " into place: ", std::strerror(err));
  }
}

namespace {

ShardInfo parse_header(const std::string& path, const int32_t* header, uint64_t file_bytes) {
  ShardInfo info;
  info.path = path;
  info.file_bytes = file_bytes;
  info.magic = header[0];
  info.version = header[1];
  if (info.magic == kShardMagicU16) {
    if (info.version != kShardVersionU16)
      fail(path, ": version ", info.version, " with magic ", info.magic, " (uint16 shards are version ",
           kShardVersionU16, ")");
    info.token_bytes = 2;
  } else if (info.magic == kShardMagicU32) {
    if (info.version != kShardVersionU32)
      fail(path, ": version ", info.version, " with magic ", info.magic, " (uint32 shards are version ",
           kShardVersionU32, ")");
    info.token_bytes = 4;
  } else {
    fail(path, ": not a token shard: magic ", info.magic, " (expected ", kShardMagicU16, " for uint16 or ",
         kShardMagicU32, " for uint32 tokens)");
  }
  if (header[2] < 0) fail(path, ": negative token count ", header[2], " in the header");
  info.tokens = static_cast<uint64_t>(header[2]);
  const uint64_t expected = kShardHeaderBytes + info.tokens * info.token_bytes;
  if (file_bytes != expected)
    fail(path, ": header says ", info.tokens, " tokens of ", info.token_bytes, " bytes (", expected,
         " bytes with the header) but the file has ", file_bytes, " bytes",
         file_bytes < expected ? " (truncated?)" : " (trailing data?)");
  return info;
}

struct stat stat_of(int fd, const std::string& path) {
  struct stat st {};
  if (::fstat(fd, &st) != 0) fail(path, ": stat failed: ", std::strerror(errno));
  return st;
}

// A reader keeps its shard open (one descriptor per shard), and a dataset of a thousand
// llm.c shards is over the common default soft limit of 1024 descriptors: the soft limit
// is raised to the hard one, once, when it is reached. True if it went up.
bool raise_open_file_limit() {
  static std::mutex mutex;
  std::lock_guard<std::mutex> lock(mutex);
  struct rlimit rl {};
  if (::getrlimit(RLIMIT_NOFILE, &rl) != 0 || rl.rlim_cur >= rl.rlim_max) return false;
  rl.rlim_cur = rl.rlim_max;
  return ::setrlimit(RLIMIT_NOFILE, &rl) == 0;
}

// Opens a shard for reading; only a regular file is kept open.
int open_shard(const std::string& path) {
  // O_NONBLOCK: opening a FIFO for reading would otherwise wait for a writer forever.
  // (It changes nothing for reads of a regular file.)
  int fd = ::open(path.c_str(), O_RDONLY | O_NONBLOCK | O_CLOEXEC);
  if (fd < 0 && errno == EMFILE && raise_open_file_limit())
    fd = ::open(path.c_str(), O_RDONLY | O_NONBLOCK | O_CLOEXEC);
  if (fd < 0 && errno == EMFILE) {
    struct rlimit rl {};
    ::getrlimit(RLIMIT_NOFILE, &rl);
    fail(path, ": cannot open shard: too many open files (the loader keeps each shard open, and this process "
         "may have ", static_cast<unsigned long long>(rl.rlim_cur), "; raise `ulimit -n` or use fewer, larger shards)");
  }
  if (fd < 0) fail(path, ": cannot open shard: ", std::strerror(errno));
  struct stat st {};
  if (::fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
    const int err = errno;
    ::close(fd);
    if (!S_ISREG(st.st_mode) && st.st_mode != 0)
      fail(path, ": is ", file_type_name(st.st_mode), ", but a shard must be a regular file");
    fail(path, ": stat failed: ", std::strerror(err));
  }
  return fd;
}

// Reads exactly `bytes` at `offset`; returns false on a short read (the file shrank).
bool read_at(int fd, void* out, size_t bytes, uint64_t offset, const std::string& path) {
  char* p = static_cast<char*>(out);
  while (bytes > 0) {
    const ssize_t n = ::pread(fd, p, bytes, static_cast<off_t>(offset));
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) fail(path, ": read failed at byte ", offset, ": ", std::strerror(errno));
    if (n == 0) return false;
    p += n;
    bytes -= static_cast<size_t>(n);
    offset += static_cast<uint64_t>(n);
  }
  return true;
}

struct Fd {
  int fd;
  ~Fd() {
    if (fd >= 0) ::close(fd);
  }
};

ShardInfo header_of_fd(int fd, const std::string& path, const struct stat& st) {
  const uint64_t bytes = static_cast<uint64_t>(st.st_size);
  if (bytes < kShardHeaderBytes)
    fail(path, ": ", bytes, " bytes is shorter than the ", kShardHeaderBytes, "-byte shard header",
         bytes == 0 ? " (empty file)" : " (truncated?)");
  int32_t header[kShardHeaderInts];
  if (!read_at(fd, header, sizeof(header), 0, path))
    fail(path, ": shrank while its header was read (it is being written?)");
  return parse_header(path, header, bytes);
}

void fail_bad_id(const std::string& path, uint64_t index, int64_t id, int vocab_size) {
  fail(path, ": token ", index, " has id ", id, ", outside the vocabulary (0..", vocab_size - 1,
       "); the shard was made with another tokenizer or is corrupt");
}

// The id as stored: a uint32 shard's ids above INT32_MAX read back as negative int32.
int64_t stored_id(const ShardInfo& info, int32_t id) {
  return info.token_bytes == 4 ? static_cast<int64_t>(static_cast<uint32_t>(id)) : id;
}

}  // namespace

size_t first_id_outside(const int32_t* ids, size_t n, int vocab_size) {
  // A branch-free pass first (the common case is a clean batch), then the position.
  uint32_t worst = 0;
  for (size_t i = 0; i < n; ++i) worst = std::max(worst, static_cast<uint32_t>(ids[i]));
  if (worst < static_cast<uint32_t>(vocab_size)) return n;
  for (size_t i = 0; i < n; ++i)
    if (static_cast<uint32_t>(ids[i]) >= static_cast<uint32_t>(vocab_size)) return i;
  return n;
}

ShardInfo read_shard_header(const std::string& path) {
  Fd f{open_shard(path)};
  return header_of_fd(f.fd, path, stat_of(f.fd, path));
}

std::vector<int32_t> read_shard(const std::string& path, int vocab_size) {
  ShardReader shard(path);
  std::vector<int32_t> tokens(shard.size());
  shard.copy(0, tokens.size(), tokens.data());
  if (vocab_size > 0) {
    const size_t bad = first_id_outside(tokens.data(), tokens.size(), vocab_size);
    if (bad < tokens.size()) fail_bad_id(path, bad, stored_id(shard.info(), tokens[bad]), vocab_size);
  }
  return tokens;
}

ShardReader::ShardReader(const std::string& path) {
  Fd f{open_shard(path)};
  const struct stat st = stat_of(f.fd, path);
  info_ = header_of_fd(f.fd, path, st);
  mtime_sec_ = st.st_mtim.tv_sec;
  mtime_nsec_ = st.st_mtim.tv_nsec;
  fd_ = f.fd;
  f.fd = -1;
}

ShardReader::~ShardReader() {
  if (fd_ >= 0) ::close(fd_);
}

ShardReader::ShardReader(ShardReader&& o) noexcept
    : info_(std::move(o.info_)), fd_(o.fd_), mtime_sec_(o.mtime_sec_), mtime_nsec_(o.mtime_nsec_) {
  o.fd_ = -1;
}

// Size and mtime, not ctime: ctime also moves on chmod, chown or a rename of the file,
// which change no token and must not stop a run. Every write(2), truncate or write
// through a mapping moves mtime before the new bytes can be read (the kernel updates it
// first), so a read whose bytes changed is followed by a check that sees it. What can
// escape is a rewrite that keeps the size and the mtime: one that sets the old mtime
// back (rsync --inplace -t), or one within the same clock tick as the shard's last write
// on a filesystem with coarse timestamps (Linux 6.13+ multigrain timestamps stamp a
// change finely once the times were read, as here at open). The loader checks every batch's ids against the
// vocabulary as well, so even those cannot feed the model an id outside its embedding.
void ShardReader::check_unchanged() const {
  const struct stat st = stat_of(fd_, info_.path);
  const uint64_t size = static_cast<uint64_t>(st.st_size);
  if (size != info_.file_bytes)
    fail("shard ", info_.path, " changed on disk while it was being read (size ", info_.file_bytes, " -> ", size,
         " bytes); a shard must not be rewritten in place while a run reads it (write a new file and rename "
         "it over the old one instead)");
  if (st.st_mtim.tv_sec != mtime_sec_ || st.st_mtim.tv_nsec != mtime_nsec_)
    fail("shard ", info_.path, " changed on disk while it was being read (same size, ", size,
         " bytes, but modified again after it was opened); a shard must not be rewritten in place while a run "
         "reads it (write a new file and rename it over the old one instead)");
}

void ShardReader::copy(uint64_t start, size_t count, int32_t* out) const {
  (void)copy_unchecked(start, count, out);
  // After the read: a change that reached the bytes just read moved the size or mtime
  // before them, so it is seen here, and nothing read from a changed file is returned.
  check_unchanged();
}

void ShardReader::read_raw(uint64_t start, size_t count, void* out) const {
  const uint64_t offset = kShardHeaderBytes + start * static_cast<uint64_t>(info_.token_bytes);
  if (!read_at(fd_, out, count * info_.token_bytes, offset, info_.path)) {
    check_unchanged();  // a shrunken file says so, with both sizes
    fail("shard ", info_.path, ": read ended early at token ", start, " (the file is shorter than validated)");
  }
}

uint32_t ShardReader::copy_unchecked(uint64_t start, size_t count, int32_t* out) const {
  MHAR_CHECK(start <= info_.tokens && count <= info_.tokens - start, info_.path);
  uint32_t worst = 0;
  if (info_.token_bytes == 4) {
    read_raw(start, count, out);  // the same bits; ids above INT32_MAX read as negative
    for (size_t i = 0; i < count; ++i) worst = std::max(worst, static_cast<uint32_t>(out[i]));
    return worst;
  }
  // uint16: widened through a small per-thread buffer (a long copy goes by chunks), the
  // largest id found on the way.
  constexpr size_t kChunk = size_t(1) << 16;
  thread_local std::vector<uint16_t> scratch(kChunk);
  uint16_t worst16 = 0;
  for (size_t done = 0; done < count;) {
    const size_t n = std::min(kChunk, count - done);
    read_raw(start + done, n, scratch.data());
    const uint16_t* src = scratch.data();
    int32_t* dst = out + done;
    for (size_t i = 0; i < n; ++i) {
      dst[i] = src[i];
      worst16 = std::max(worst16, src[i]);
    }
    done += n;
  }
  return worst16;
}

void ShardReader::check_ids(int vocab_size) const {
  // Scanned in the stored width (no widening), a chunk at a time, then checked unchanged.
  constexpr size_t kChunk = size_t(1) << 20;
  std::vector<char> buf(static_cast<size_t>(std::min<uint64_t>(kChunk, info_.tokens)) * info_.token_bytes);
  for (uint64_t start = 0; start < info_.tokens; start += kChunk) {
    const size_t n = static_cast<size_t>(std::min<uint64_t>(kChunk, info_.tokens - start));
    read_raw(start, n, buf.data());
    size_t bad = n;
    if (info_.token_bytes == 2) {
      const auto* p = reinterpret_cast<const uint16_t*>(buf.data());
      uint16_t worst = 0;
      for (size_t i = 0; i < n; ++i) worst = std::max(worst, p[i]);
      if (worst >= vocab_size)
        for (bad = 0; p[bad] < vocab_size; ++bad) {
        }
      if (bad < n) {
        check_unchanged();  // a change on disk is reported as that
        fail_bad_id(info_.path, start + bad, p[bad], vocab_size);
      }
    } else {
      const auto* p = reinterpret_cast<const uint32_t*>(buf.data());
      uint32_t worst = 0;
      for (size_t i = 0; i < n; ++i) worst = std::max(worst, p[i]);
      if (worst >= static_cast<uint32_t>(vocab_size))
        for (bad = 0; p[bad] < static_cast<uint32_t>(vocab_size); ++bad) {
        }
      if (bad < n) {
        check_unchanged();
        fail_bad_id(info_.path, start + bad, p[bad], vocab_size);
      }
    }
  }
  check_unchanged();
}

}  // namespace mhar::data
