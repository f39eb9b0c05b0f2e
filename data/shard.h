// shard.h: llm.c token shards (DESIGN.md section 6), so llm.c data works unchanged.
// Layout: a header of 256 little-endian int32 ([0] magic, [1] version, [2] token
// count, the rest zero), then the tokens: magic 20240520 / version 1 = uint16 tokens,
// magic 20240801 / version 7 = uint32 tokens (for vocabularies above 65536 ids).
// Writes go to "<path>.tmp.<pid>" and are renamed into place, so a shard that exists
// is always whole. Readers validate everything against the file size and name the
// file and the problem in every error.
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

// A read-only memory map of a validated shard.
class MappedShard {
 public:
  explicit MappedShard(const std::string& path);
  ~MappedShard();
  MappedShard(const MappedShard&) = delete;
  MappedShard& operator=(const MappedShard&) = delete;
  MappedShard(MappedShard&& other) noexcept;

  const ShardInfo& info() const { return info_; }
  uint64_t size() const { return info_.tokens; }
  int32_t at(uint64_t i) const {
    return info_.token_bytes == 2 ? static_cast<int32_t>(static_cast<const uint16_t*>(tokens_)[i])
                                  : static_cast<int32_t>(static_cast<const uint32_t*>(tokens_)[i]);
  }
  // Copies tokens [start, start + count) as int32.
  void copy(uint64_t start, size_t count, int32_t* out) const;
  // Fails (naming file and position) on the first id outside [0, vocab_size).
  void check_ids(int vocab_size) const;

 private:
  ShardInfo info_;
  void* map_ = nullptr;
  size_t map_bytes_ = 0;
  const void* tokens_ = nullptr;
};

}  // namespace mhar::data
