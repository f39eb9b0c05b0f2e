// loader.h: the training and evaluation data loader over llm.c shards.
// Conventions: a batch is B windows of T+1 consecutive tokens; inputs are tokens
// [0, T) of each window and targets tokens [1, T] (row-major B x T, int32).
// Shuffled mode (training): each epoch permutes the shard order and, within each
// shard, the order of its windows (window k of a shard = tokens [k*T, k*T+T]; windows
// never cross shards), both from (seed, epoch) alone. The epoch's window sequence is
// cut into steps of world_size*B windows; rank r takes windows [r*B, r*B+B) of each
// step, so ranks never share a window within an epoch. The tail that does not fill a
// step is skipped (it differs every epoch). Sequential mode (evaluation): shards in
// name order form one stream, window k covers stream tokens [k*T, k*T+T], batch g is
// windows [g*B, g*B+B), rank r takes batches r, r+W, ...; num_batches() full batches
// per rank, then it starts over.
// Every batch is a pure function of (seed, position), so state()/restore() (a few
// numbers) resume exactly; a background thread computes the next batches ahead so a
// training step never waits on the disk.
// A shard changed on disk while the loader reads it (truncated or rewritten in place)
// makes next_batch() throw an mhar::Error naming the shard, after the batches read
// before the change and never with data read after it (ShardReader); the trainer then
// checkpoints its last completed step before it stops.
#pragma once
#include <nlohmann/json.hpp>

#include <condition_variable>
#include <cstdint>
#include <deque>
#include <exception>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "data/shard.h"

namespace mhar::data {

// Expands a glob (or plain path) to the sorted list of matching files; fails naming
// the pattern if nothing matches, or the path if it is a folder or another non-file.
std::vector<std::string> expand_glob(const std::string& pattern);

enum class LoaderMode { Shuffled, Sequential };

class DataLoader {
 public:
  // `shards`: paths and/or glob patterns; the union is used in sorted name order.
  // vocab_size > 0 checks every token id of every shard up front.
  DataLoader(const std::vector<std::string>& shards, int B, int T, uint64_t seed, int rank, int world_size,
             int vocab_size, LoaderMode mode = LoaderMode::Shuffled, int prefetch_batches = 4);
  DataLoader(const std::string& shard_glob, int B, int T, uint64_t seed, int rank, int world_size,
             int vocab_size, LoaderMode mode = LoaderMode::Shuffled, int prefetch_batches = 4);
  ~DataLoader();
  DataLoader(const DataLoader&) = delete;
  DataLoader& operator=(const DataLoader&) = delete;

  void next_batch(int32_t* inputs, int32_t* targets);

  // The position of the next batch, with what must match to restore it.
  nlohmann::json state() const;
  // Continues from a state() of a loader over the same shards, B, T, seed, world size
  // and mode (the rank may differ: the position is common to all ranks).
  void restore(const nlohmann::json& state);
  void reset();  // back to the first batch of epoch 0

  // Sequential: full batches per rank in one pass. Shuffled: steps per epoch.
  uint64_t num_batches() const { return steps_per_epoch_; }
  uint64_t epoch() const { return epoch_; }
  uint64_t step() const { return step_; }
  uint64_t total_tokens() const { return total_tokens_; }
  uint64_t total_windows() const { return total_windows_; }
  const std::vector<std::string>& shard_paths() const { return paths_; }
  // How many next_batch() calls found their batch not yet prepared (had to wait).
  uint64_t stalls() const { return stalls_; }

 private:
  struct Position {
    uint64_t epoch, step;
  };
  void init(std::vector<std::string> paths, int vocab_size);
  void fill(Position pos, int32_t* windows) const;  // B*(T+1) tokens
  struct Piece {  // tokens [start, start + count) of one shard, read into out
    uint32_t shard;
    uint64_t start;
    size_t count;
    int32_t* out;
    uint32_t max_id;  // the largest id read (as stored)
  };
  void copy_stream(uint64_t start, size_t count, int32_t* out, std::vector<Piece>& pieces) const;
  void verify(const std::vector<Piece>& pieces) const;
  uint64_t window_of_shard(uint64_t epoch, uint64_t shard, uint64_t k) const;
  std::vector<uint32_t> shard_order(uint64_t epoch) const;
  std::string fingerprint() const;
  void start_worker();
  void stop_worker();
  void worker_loop(Position from);

  std::vector<std::string> paths_;
  std::vector<ShardReader> shards_;
  std::vector<uint64_t> shard_windows_;  // shuffled: windows per shard
  std::vector<uint64_t> stream_start_;   // sequential: first stream token of each shard
  int B_, T_, rank_, world_;
  int vocab_size_ = 0;  // > 0: every batch's ids are checked against it
  uint64_t seed_;
  LoaderMode mode_;
  int prefetch_;
  uint64_t total_tokens_ = 0, total_windows_ = 0, steps_per_epoch_ = 0;
  uint64_t epoch_ = 0, step_ = 0, stalls_ = 0;

  std::thread worker_;
  mutable std::mutex mutex_;
  std::condition_variable cv_;
  std::deque<std::vector<int32_t>> ready_;
  bool stopping_ = false;
  std::exception_ptr worker_error_;
};

}  // namespace mhar::data
