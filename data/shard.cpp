// shard.cpp: llm.c shard writing (temp file + rename) and validated reading/mapping.
// Host byte order is assumed little-endian, as llm.c assumes.
#include "data/shard.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>

#include "engine/error.h"

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

uint64_t file_size_of(int fd, const std::string& path) {
  struct stat st;
  if (::fstat(fd, &st) != 0) fail(path, ": stat failed: ", std::strerror(errno));
  if (!S_ISREG(st.st_mode)) fail(path, ": not a regular file");
  return static_cast<uint64_t>(st.st_size);
}

void read_exact(int fd, void* out, size_t bytes, uint64_t offset, const std::string& path) {
  char* p = static_cast<char*>(out);
  while (bytes > 0) {
    const ssize_t n = ::pread(fd, p, bytes, static_cast<off_t>(offset));
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) fail(path, ": read failed at byte ", offset, n < 0 ? std::string(": ") + std::strerror(errno) : "");
    p += n;
    bytes -= static_cast<size_t>(n);
    offset += static_cast<uint64_t>(n);
  }
}

struct Fd {
  int fd;
  ~Fd() {
    if (fd >= 0) ::close(fd);
  }
};

int open_shard(const std::string& path) {
  const int fd = ::open(path.c_str(), O_RDONLY);
  if (fd < 0) fail(path, ": cannot open shard: ", std::strerror(errno));
  return fd;
}

ShardInfo header_of_fd(int fd, const std::string& path) {
  const uint64_t bytes = file_size_of(fd, path);
  if (bytes < kShardHeaderBytes)
    fail(path, ": ", bytes, " bytes is shorter than the ", kShardHeaderBytes, "-byte shard header",
         bytes == 0 ? " (empty file)" : " (truncated?)");
  int32_t header[kShardHeaderInts];
  read_exact(fd, header, sizeof(header), 0, path);
  return parse_header(path, header, bytes);
}

void fail_bad_id(const std::string& path, uint64_t index, int64_t id, int vocab_size) {
  fail(path, ": token ", index, " has id ", id, ", outside the vocabulary (0..", vocab_size - 1,
       "); the shard was made with another tokenizer or is corrupt");
}

}  // namespace

ShardInfo read_shard_header(const std::string& path) {
  Fd f{open_shard(path)};
  return header_of_fd(f.fd, path);
}

std::vector<int32_t> read_shard(const std::string& path, int vocab_size) {
  MappedShard shard(path);
  if (vocab_size > 0) shard.check_ids(vocab_size);
  std::vector<int32_t> tokens(shard.size());
  shard.copy(0, tokens.size(), tokens.data());
  return tokens;
}

MappedShard::MappedShard(const std::string& path) {
  Fd f{open_shard(path)};
  info_ = header_of_fd(f.fd, path);
  map_bytes_ = static_cast<size_t>(info_.file_bytes);
  map_ = ::mmap(nullptr, map_bytes_, PROT_READ, MAP_SHARED, f.fd, 0);
  if (map_ == MAP_FAILED) {
    map_ = nullptr;
    fail(path, ": mmap failed: ", std::strerror(errno));
  }
  tokens_ = static_cast<const char*>(map_) + kShardHeaderBytes;
}

MappedShard::~MappedShard() {
  if (map_) ::munmap(map_, map_bytes_);
}

MappedShard::MappedShard(MappedShard&& o) noexcept
    : info_(std::move(o.info_)), map_(o.map_), map_bytes_(o.map_bytes_), tokens_(o.tokens_) {
  o.map_ = nullptr;
  o.tokens_ = nullptr;
}

void MappedShard::copy(uint64_t start, size_t count, int32_t* out) const {
  MHAR_CHECK(start + count <= info_.tokens, info_.path);
  if (info_.token_bytes == 2) {
    const auto* p = static_cast<const uint16_t*>(tokens_) + start;
    for (size_t i = 0; i < count; ++i) out[i] = p[i];
  } else {
    std::memcpy(out, static_cast<const uint32_t*>(tokens_) + start, count * 4);
  }
}

void MappedShard::check_ids(int vocab_size) const {
  const uint64_t n = info_.tokens;
  if (info_.token_bytes == 2) {
    const auto* p = static_cast<const uint16_t*>(tokens_);
    uint16_t worst = 0;
    for (uint64_t i = 0; i < n; ++i) worst = std::max(worst, p[i]);
    if (worst >= vocab_size)
      for (uint64_t i = 0; i < n; ++i)
        if (p[i] >= vocab_size) fail_bad_id(info_.path, i, p[i], vocab_size);
  } else {
    const auto* p = static_cast<const uint32_t*>(tokens_);
    uint32_t worst = 0;
    for (uint64_t i = 0; i < n; ++i) worst = std::max(worst, p[i]);
    if (worst >= static_cast<uint32_t>(vocab_size))
      for (uint64_t i = 0; i < n; ++i)
        if (p[i] >= static_cast<uint32_t>(vocab_size)) fail_bad_id(info_.path, i, p[i], vocab_size);
  }
}

}  // namespace mhar::data
