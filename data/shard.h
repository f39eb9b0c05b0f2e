// shard.h: llm.c token shards (DESIGN.md section 6), so llm.c data works unchanged.
// Layout: a header of 256 little-endian int32 ([0] magic, [1] version, [2] token
// count, the rest zero), then the tokens: magic 20240520 / version 1 = uint16 tokens,
// magic 20240801 / version 7 = uint32 tokens (for vocabularies above 65536 ids).
// Writes go to "<path>.tmp.<pid>" and are renamed into place, so a shard that exists
// is always whole. Readers validate everything against the file size, name the file
// and the problem in every error, and never trust a shard to stay as it was validated
// (see ShardReader).
#pragma once
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

namespace mhar::data {

inline constexpr int kShardHeaderInts = 256;
inline constexpr size_t kShardHeaderBytes = kShardHeaderInts * sizeof(int32_t);
inline constexpr int32_t kShardMagicU16 = 20240520;
inline constexpr int32_t kShardVersionU16 = 1;
inline constexpr int32_t kShardMagicU32 = 20240801;
inline constexpr int32_t kShardVersionU32 = 7;

// Bytes per token for a vocabulary: 2 when every id fits in uint16 (vocab <= 65536).
inline int shard_token_bytes(int vocab_size) { return vocab_size <= 65536 ? 2 : 4; }

// Writes tokens as a shard with 2- or 4-byte tokens (token_bytes). Fails if an id does
// not fit, naming the id and its position.
void write_shard(const std::string& path, const std::vector<int32_t>& tokens, int token_bytes);
void write_shard(const std::string& path, const int32_t* tokens, size_t count, int token_bytes);

struct ShardInfo {
  std::string path;
  int32_t magic = 0;
  int32_t version = 0;
  int token_bytes = 0;    // 2 or 4
  uint64_t tokens = 0;    // header count, checked against the file size
  uint64_t file_bytes = 0;
};

// Reads and validates the header (magic, version, count against file size).
ShardInfo read_shard_header(const std::string& path);

// Reads a whole shard; if vocab_size > 0, fails on the first id >= vocab_size.
std::vector<int32_t> read_shard(const std::string& path, int vocab_size = 0);

// A validated shard held open for reading. Only a regular file is opened (a FIFO or a
// device is refused at once, never waited on). Tokens are read with pread(2), not
// through a memory map: a mapped shard that another process truncates or rewrites in
// place kills the reader with SIGBUS, while pread simply returns what is there. After
// every read the file's size and modification time are compared with those validated
// at open, and a change fails with an mhar::Error ("shard X changed on disk while it
// was being read (size A -> B bytes)") before the bytes read are handed out. A shard
// replaced by rename (the way write_shard publishes) is no change for a reader: its
// descriptor keeps the old, whole file.
class ShardReader {
 public:
  explicit ShardReader(const std::string& path);
  ~ShardReader();
  ShardReader(const ShardReader&) = delete;
  ShardReader& operator=(const ShardReader&) = delete;
  ShardReader(ShardReader&& other) noexcept;

  const ShardInfo& info() const { return info_; }
  uint64_t size() const { return info_.tokens; }
  // Copies tokens [start, start + count) as int32. Thread-safe (pread has no file
  // position); fails if the shard changed on disk since it was opened.
  void copy(uint64_t start, size_t count, int32_t* out) const;
  // The same without the check, returning the largest id copied (as stored, unsigned):
  // a caller reading many windows calls check_unchanged() once after the last read and
  // before it uses any of them (one fstat per batch, not per window).
  uint32_t copy_unchecked(uint64_t start, size_t count, int32_t* out) const;
  // Fails (naming file and position) on the first id outside [0, vocab_size).
  void check_ids(int vocab_size) const;
  // Fails if the file no longer has the size and modification time it was opened with.
  void check_unchanged() const;

 private:
  void read_raw(uint64_t start, size_t count, void* out) const;  // stored width, no check

  ShardInfo info_;
  int fd_ = -1;
  int64_t mtime_sec_ = 0, mtime_nsec_ = 0;
};

// The index of the first id in ids[0, n) outside [0, vocab_size), or n if none.
size_t first_id_outside(const int32_t* ids, size_t n, int vocab_size);

}  // namespace mhar::data
