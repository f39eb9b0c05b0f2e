// loader.cpp: window arithmetic, seeded permutations and the prefetch thread.
// Window orders use a keyed Feistel permutation (cycle-walked to the exact range), so
// any window of any epoch is computed in O(1) without materializing permutations.
#include "data/loader.h"

#include <glob.h>

#include <algorithm>
#include <cstring>
#include <filesystem>
#include <sstream>

#include "engine/error.h"
#include "engine/file_io.h"

namespace mhar::data {
namespace {

uint64_t splitmix(uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

uint64_t key_of(uint64_t seed, uint64_t epoch, uint64_t salt) {
  return splitmix(splitmix(splitmix(seed) ^ epoch) ^ salt);
}

// A bijection of [0, n) chosen by key.
uint64_t permute(uint64_t i, uint64_t n, uint64_t key) {
  if (n <= 1) return 0;
  int bits = 1;
  while ((uint64_t{1} << bits) < n) ++bits;
  const int half = (bits + 1) / 2;
  const uint64_t mask = (uint64_t{1} << half) - 1;
  do {
    uint64_t left = i >> half, right = i & mask;
    for (uint64_t round = 0; round < 4; ++round) {
      const uint64_t f = splitmix(right ^ key ^ (round << 60)) & mask;
      const uint64_t next = left ^ f;
      left = right;
      right = next;
    }
    i = (left << half) | right;
  } while (i >= n);
  return i;
}

bool has_glob_chars(const std::string& s) { return s.find_first_of("*?[") != std::string::npos; }

}  // namespace

std::vector<std::string> expand_glob(const std::string& pattern) {
  if (!has_glob_chars(pattern)) {
    std::error_code ec;
    const auto st = std::filesystem::status(pattern, ec);
    if (st.type() == std::filesystem::file_type::not_found) fail("shard ", pattern, ": no such file");
    if (st.type() == std::filesystem::file_type::directory)
      fail("shard ", pattern, ": is a directory, but a shard must be a file; give a shard file or a glob of them (",
           (std::filesystem::path(pattern) / "train_*.bin").string(), " or ",
           (std::filesystem::path(pattern) / "val_*.bin").string(), " as `mhar data prepare` names them)");
    require_regular_file(pattern, "shard");
    return {pattern};
  }
  glob_t g;
  std::memset(&g, 0, sizeof(g));
  const int rc = ::glob(pattern.c_str(), 0, nullptr, &g);
  std::vector<std::string> out;
  if (rc == 0)
    for (size_t i = 0; i < g.gl_pathc; ++i) out.emplace_back(g.gl_pathv[i]);
  ::globfree(&g);
  if (out.empty()) fail("shard pattern ", pattern, " matches no files");
  std::sort(out.begin(), out.end());
  return out;
}

DataLoader::DataLoader(const std::string& shard_glob, int B, int T, uint64_t seed, int rank, int world_size,
                       int vocab_size, LoaderMode mode, int prefetch_batches)
    : DataLoader(std::vector<std::string>{shard_glob}, B, T, seed, rank, world_size, vocab_size, mode,
                 prefetch_batches) {}

DataLoader::DataLoader(const std::vector<std::string>& shards, int B, int T, uint64_t seed, int rank,
                       int world_size, int vocab_size, LoaderMode mode, int prefetch_batches)
    : B_(B), T_(T), rank_(rank), world_(world_size), seed_(seed), mode_(mode), prefetch_(prefetch_batches) {
  if (B < 1) fail("data loader: batch size B = ", B, " must be at least 1");
  if (T < 1) fail("data loader: sequence length T = ", T, " must be at least 1");
  if (world_size < 1) fail("data loader: world_size = ", world_size, " must be at least 1");
  if (rank < 0 || rank >= world_size) fail("data loader: rank ", rank, " is outside 0..", world_size - 1);
  if (prefetch_ < 1) prefetch_ = 1;
  if (shards.empty()) fail("data loader: no shards given");
  std::vector<std::string> paths;
  for (const auto& s : shards) {
    auto found = expand_glob(s);
    paths.insert(paths.end(), found.begin(), found.end());
  }
  std::sort(paths.begin(), paths.end());
  paths.erase(std::unique(paths.begin(), paths.end()), paths.end());
  init(std::move(paths), vocab_size);
  start_worker();
}

DataLoader::~DataLoader() { stop_worker(); }

void DataLoader::init(std::vector<std::string> paths, int vocab_size) {
  paths_ = std::move(paths);
  vocab_size_ = vocab_size;
  for (const auto& p : paths_) {
    shards_.emplace_back(p);
    if (vocab_size > 0) shards_.back().check_ids(vocab_size);
  }
  const uint64_t per_window = static_cast<uint64_t>(T_);
  for (const auto& s : shards_) {
    stream_start_.push_back(total_tokens_);
    total_tokens_ += s.size();
    shard_windows_.push_back(s.size() > 0 ? (s.size() - 1) / per_window : 0);
  }
  std::ostringstream what;
  what << paths_.size() << " shard(s) (" << paths_.front() << (paths_.size() > 1 ? " ..." : "") << ") with "
       << total_tokens_ << " tokens";
  if (mode_ == LoaderMode::Shuffled) {
    for (uint64_t w : shard_windows_) total_windows_ += w;
    steps_per_epoch_ = total_windows_ / (static_cast<uint64_t>(B_) * world_);
    if (steps_per_epoch_ == 0)
      fail("data loader: ", what.str(), " hold ", total_windows_, " windows of T+1 = ", T_ + 1,
           " tokens (windows stay within a shard), fewer than one batch of B = ", B_, " per rank x ", world_,
           " rank(s); use more data or a smaller B or T");
  } else {
    total_windows_ = total_tokens_ > 0 ? (total_tokens_ - 1) / per_window : 0;
    steps_per_epoch_ = total_windows_ / B_ / world_;
    if (steps_per_epoch_ == 0)
      fail("data loader: ", what.str(), " hold ", total_windows_, " windows of T+1 = ", T_ + 1,
           " tokens, fewer than one batch of B = ", B_, " per rank x ", world_,
           " rank(s); use more data or a smaller B or T");
  }
}

std::vector<uint32_t> DataLoader::shard_order(uint64_t epoch) const {
  const uint64_t n = shards_.size(), key = key_of(seed_, epoch, 0x5eed5a4d);
  std::vector<uint32_t> order(n);
  for (uint64_t i = 0; i < n; ++i) order[i] = static_cast<uint32_t>(permute(i, n, key));
  return order;
}

uint64_t DataLoader::window_of_shard(uint64_t epoch, uint64_t shard, uint64_t k) const {
  return permute(k, shard_windows_[shard], key_of(seed_, epoch, 0x77696e64ull + (shard << 20)));
}

void DataLoader::copy_stream(uint64_t start, size_t count, int32_t* out, std::vector<Piece>& pieces) const {
  size_t s = std::upper_bound(stream_start_.begin(), stream_start_.end(), start) - stream_start_.begin() - 1;
  while (count > 0) {
    const uint64_t local = start - stream_start_[s];
    const size_t n = static_cast<size_t>(std::min<uint64_t>(count, shards_[s].size() - local));
    const uint32_t worst = shards_[s].copy_unchecked(local, n, out);
    pieces.push_back({static_cast<uint32_t>(s), local, n, out, worst});
    out += n;
    count -= n;
    start += n;
    ++s;
  }
}

// After all of a batch's reads and before the batch is handed out: each shard read from
// is still the file validated at open (one fstat per shard, not per window), and every
// id is inside the vocabulary. The ids were all checked at open; this second look costs
// one comparison per token and keeps an id outside the embedding from ever reaching the
// model, even after a change to a shard that its size and mtime did not show.
void DataLoader::verify(const std::vector<Piece>& pieces) const {
  // A batch's windows go through the shards in order, so each shard's pieces are adjacent.
  uint32_t last = UINT32_MAX;
  for (const Piece& p : pieces) {
    if (p.shard != last) shards_[p.shard].check_unchanged();
    last = p.shard;
  }
  if (vocab_size_ <= 0) return;
  for (const Piece& p : pieces) {
    if (p.max_id < static_cast<uint32_t>(vocab_size_)) continue;
    const size_t bad = first_id_outside(p.out, p.count, vocab_size_);
    if (bad < p.count) {
      const ShardInfo& info = shards_[p.shard].info();
      const int64_t id = info.token_bytes == 4 ? int64_t(uint32_t(p.out[bad])) : int64_t(p.out[bad]);
      fail("shard ", info.path, " changed on disk while it was being read: token ", p.start + bad, " now has id ", id,
           ", outside the vocabulary (0..", vocab_size_ - 1, ") it was checked against when opened");
    }
  }
}

void DataLoader::fill(Position pos, int32_t* windows) const {
  const size_t W = static_cast<size_t>(T_) + 1;
  thread_local std::vector<Piece> pieces;
  pieces.clear();
  if (mode_ == LoaderMode::Sequential) {
    const uint64_t batch = pos.step * world_ + rank_;
    for (int b = 0; b < B_; ++b)
      copy_stream((batch * B_ + b) * static_cast<uint64_t>(T_), W, windows + b * W, pieces);
    verify(pieces);
    return;
  }
  const std::vector<uint32_t> order = shard_order(pos.epoch);
  // Cumulative window counts in this epoch's shard order.
  uint64_t first = (pos.step * world_ + rank_) * static_cast<uint64_t>(B_);
  size_t slot = 0;
  uint64_t before = 0;
  while (before + shard_windows_[order[slot]] <= first) before += shard_windows_[order[slot++]];
  for (int b = 0; b < B_; ++b) {
    const uint64_t g = first + b;
    while (before + shard_windows_[order[slot]] <= g) before += shard_windows_[order[slot++]];
    const uint32_t shard = order[slot];
    const uint64_t k = window_of_shard(pos.epoch, shard, g - before);
    const uint32_t worst = shards_[shard].copy_unchecked(k * static_cast<uint64_t>(T_), W, windows + b * W);
    pieces.push_back({shard, k * static_cast<uint64_t>(T_), W, windows + b * W, worst});
  }
  verify(pieces);
}

void DataLoader::start_worker() {
  stopping_ = false;
  worker_error_ = nullptr;
  ready_.clear();
  worker_ = std::thread(&DataLoader::worker_loop, this, Position{epoch_, step_});
}

void DataLoader::stop_worker() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stopping_ = true;
  }
  cv_.notify_all();
  if (worker_.joinable()) worker_.join();
  ready_.clear();
}

void DataLoader::worker_loop(Position pos) {
  const size_t batch_tokens = static_cast<size_t>(B_) * (T_ + 1);
  try {
    for (;;) {
      std::vector<int32_t> buf(batch_tokens);
      fill(pos, buf.data());
      std::unique_lock<std::mutex> lock(mutex_);
      cv_.wait(lock, [&] { return stopping_ || ready_.size() < static_cast<size_t>(prefetch_); });
      if (stopping_) return;
      ready_.push_back(std::move(buf));
      cv_.notify_all();
      lock.unlock();
      if (++pos.step == steps_per_epoch_) pos.step = 0, ++pos.epoch;
    }
  } catch (...) {
    std::lock_guard<std::mutex> lock(mutex_);
    worker_error_ = std::current_exception();
    cv_.notify_all();
  }
}

void DataLoader::next_batch(int32_t* inputs, int32_t* targets) {
  std::vector<int32_t> buf;
  {
    std::unique_lock<std::mutex> lock(mutex_);
    if (ready_.empty() && !worker_error_) ++stalls_;
    cv_.wait(lock, [&] { return !ready_.empty() || worker_error_; });
    if (ready_.empty() && worker_error_) std::rethrow_exception(worker_error_);
    buf = std::move(ready_.front());
    ready_.pop_front();
  }
  cv_.notify_all();
  const size_t W = static_cast<size_t>(T_) + 1;
  for (int b = 0; b < B_; ++b) {
    std::memcpy(inputs + static_cast<size_t>(b) * T_, buf.data() + b * W, sizeof(int32_t) * T_);
    std::memcpy(targets + static_cast<size_t>(b) * T_, buf.data() + b * W + 1, sizeof(int32_t) * T_);
  }
  if (++step_ == steps_per_epoch_) step_ = 0, ++epoch_;
}

std::string DataLoader::fingerprint() const {
  uint64_t h = splitmix(paths_.size());
  for (size_t i = 0; i < paths_.size(); ++i) {
    const std::string name = std::filesystem::path(paths_[i]).filename().string();
    for (unsigned char c : name) h = splitmix(h ^ c);
    h = splitmix(h ^ shards_[i].size());
  }
  char buf[17];
  std::snprintf(buf, sizeof(buf), "%016llx", static_cast<unsigned long long>(h));
  return buf;
}

nlohmann::json DataLoader::state() const {
  return {{"mode", mode_ == LoaderMode::Shuffled ? "shuffled" : "sequential"},
          {"epoch", epoch_},
          {"step", step_},
          {"seed", seed_},
          {"B", B_},
          {"T", T_},
          {"world_size", world_},
          {"shards", paths_.size()},
          {"tokens", total_tokens_},
          {"fingerprint", fingerprint()}};
}

void DataLoader::restore(const nlohmann::json& s) {
  auto expect = [&](const char* key, const nlohmann::json& want) {
    if (!s.contains(key)) fail("data loader state: missing \"", key, "\" in ", s.dump());
    if (s[key] != want)
      fail("data loader state: ", key, " = ", s[key].dump(), " but this loader has ", want.dump(),
           "; a state restores only onto the same shards, B, T, seed, world size and mode");
  };
  const nlohmann::json mine = state();
  for (const char* key : {"mode", "seed", "B", "T", "world_size", "shards", "tokens", "fingerprint"})
    expect(key, mine[key]);
  uint64_t epoch, step;
  try {
    epoch = s.at("epoch").get<uint64_t>();
    step = s.at("step").get<uint64_t>();
  } catch (const nlohmann::json::exception& e) {
    fail("data loader state: epoch/step are not non-negative integers: ", s.dump());
  }
  if (step >= steps_per_epoch_)
    fail("data loader state: step ", step, " is outside 0..", steps_per_epoch_ - 1, " for this data");
  stop_worker();
  epoch_ = epoch;
  step_ = step;
  start_worker();
}

void DataLoader::reset() {
  stop_worker();
  epoch_ = 0;
  step_ = 0;
  start_worker();
}

}  // namespace mhar::data
