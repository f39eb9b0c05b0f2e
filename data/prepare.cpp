// prepare.cpp: the prepare pipeline: count, read chunks of documents, encode each chunk
// in parallel, append to the train/validation shard writers in document order. The
// output is written into a staging folder inside --out and moved into place only when
// complete, so a failure (a full disk) leaves the folder's old shards and prepare.json as
// they were; re-preparing into a folder therefore needs room for the old and the new.
#include "data/prepare.h"

#include <spdlog/spdlog.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "data/corpus.h"
#include "data/shard.h"
#include "data/tokenizer.h"
#include "engine/error.h"
#include "engine/file_io.h"
#include "engine/run_lock.h"

namespace mhar::data {
namespace fs = std::filesystem;

namespace {

class ShardWriter {
 public:
  ShardWriter(std::string dir, std::string prefix, uint64_t shard_tokens, int token_bytes)
      : dir_(std::move(dir)), prefix_(std::move(prefix)), shard_tokens_(shard_tokens), token_bytes_(token_bytes) {}
  void append(const std::vector<int32_t>& tokens) {
    size_t at = 0;
    while (at < tokens.size()) {
      const size_t take = std::min<size_t>(tokens.size() - at, shard_tokens_ - buffer_.size());
      buffer_.insert(buffer_.end(), tokens.begin() + at, tokens.begin() + at + take);
      at += take;
      if (buffer_.size() == shard_tokens_) flush();
    }
    total_ += tokens.size();
  }
  void flush() {
    if (buffer_.empty()) return;
    char name[64];
    std::snprintf(name, sizeof(name), "%s_%06zu.bin", prefix_.c_str(), written_.size());
    const std::string path = (fs::path(dir_) / name).string();
    write_shard(path, buffer_, token_bytes_);
    written_.push_back(path);
    buffer_.clear();
  }
  uint64_t total() const { return total_; }
  const std::vector<std::string>& written() const { return written_; }

 private:
  std::string dir_, prefix_;
  uint64_t shard_tokens_;
  int token_bytes_;
  std::vector<int32_t> buffer_;
  std::vector<std::string> written_;
  uint64_t total_ = 0;
};

class Progress {
 public:
  Progress(bool enabled, uint64_t total) : enabled_(enabled), total_(std::max<uint64_t>(total, 1)) {
    tty_ = ::isatty(2);
    start_ = last_ = std::chrono::steady_clock::now();
  }
  void update(uint64_t done, uint64_t tokens, bool final = false) {
    if (!enabled_) return;
    const auto now = std::chrono::steady_clock::now();
    const double since = std::chrono::duration<double>(now - last_).count();
    if (!final && since < (tty_ ? 0.2 : 10.0)) return;
    last_ = now;
    // The total counted jsonl line bytes (with escapes), so the end is pinned to 100%.
    const double frac = final ? 1.0 : std::min(1.0, static_cast<double>(done) / total_);
    const double secs = std::chrono::duration<double>(now - start_).count();
    const int width = 30, filled = static_cast<int>(frac * width);
    std::fprintf(stderr, "%s[%.*s%*s] %5.1f%%  %.1f MB  %.2fM tokens  %.1f MB/s%s", tty_ ? "\r" : "", filled,
                 "##############################", width - filled, "", 100 * frac, done / 1e6, tokens / 1e6,
                 secs > 0 ? done / 1e6 / secs : 0.0, tty_ && !final ? "" : "\n");
    std::fflush(stderr);
  }

 private:
  bool enabled_, tty_;
  uint64_t total_;
  std::chrono::steady_clock::time_point start_, last_;
};

constexpr const char* kStagingPrefix = ".prepare-tmp-";

bool is_shard_name(const std::string& name) {
  return (name.rfind("train_", 0) == 0 || name.rfind("val_", 0) == 0) && fs::path(name).extension() == ".bin";
}

// Staging folders of `data prepare` runs that were killed. One whose pid is running is
// left alone: prepare takes no lock, so it may be another prepare writing right now.
void remove_stale_staging(const std::string& out_dir) {
  std::error_code ec;
  for (fs::directory_iterator it(out_dir, ec), end; !ec && it != end; it.increment(ec)) {
    const std::string name = it->path().filename().string();
    if (name.rfind(kStagingPrefix, 0) != 0) continue;
    const std::string pid = name.substr(std::string(kStagingPrefix).size());
    if (pid.empty() || pid.size() > 9 || pid.find_first_not_of("0123456789") != std::string::npos) continue;
    if (process_alive(std::atoll(pid.c_str()))) continue;
    std::error_code rm;
    fs::remove_all(it->path(), rm);
    if (!rm) spdlog::warn("removed {} (the staging folder of an interrupted prepare)", it->path().string());
  }
}

// Replaces the output in `out_dir` by the complete one in `staging`, with renames only (no
// space needed). prepare.json goes first and comes back last, so a kill part-way leaves a
// folder without prepare.json (visibly incomplete), never one whose prepare.json
// describes other shards.
void publish_output(const fs::path& staging, const std::string& out_dir) {
  const fs::path meta = fs::path(out_dir) / "prepare.json";
  if (::unlink(meta.c_str()) != 0 && errno != ENOENT)
    fail(meta.string(), ": cannot replace (", std::strerror(errno), ")");
  fsync_dir(out_dir);
  std::error_code ec;
  std::vector<fs::path> old;
  for (fs::directory_iterator it(out_dir, ec), end; !ec && it != end; it.increment(ec))
    if (is_shard_name(it->path().filename().string())) old.push_back(it->path());
  if (ec) fail(out_dir, ": cannot list (", ec.message(), ")");
  for (const auto& p : old)  // old shards would otherwise be globbed with the new ones
    if (::unlink(p.c_str()) != 0) fail(p.string(), ": cannot remove the old shard (", std::strerror(errno), ")");
  std::vector<fs::path> fresh;
  for (fs::directory_iterator it(staging, ec), end; !ec && it != end; it.increment(ec))
    if (is_shard_name(it->path().filename().string())) fresh.push_back(it->path());
  if (ec) fail(staging.string(), ": cannot list (", ec.message(), ")");
  fresh.push_back(staging / "prepare.json");  // last
  for (const auto& p : fresh) {
    const fs::path to = fs::path(out_dir) / p.filename();
    if (::rename(p.c_str(), to.c_str()) != 0)
      fail(to.string(), ": cannot move ", p.string(), " into place (", std::strerror(errno), ")");
  }
  fsync_dir(out_dir);
  fs::remove(staging, ec);
}

}  // namespace

PrepareSummary prepare(const PrepareOptions& opt) {
  const auto t0 = std::chrono::steady_clock::now();
  if (opt.out_dir.empty()) fail("prepare: --out is required");
  if (opt.val_docs >= 0 && opt.val_fraction >= 0) fail("prepare: give --val-docs or --val-fraction, not both");
  if (opt.val_fraction > 1.0) fail("prepare: --val-fraction ", opt.val_fraction, " must be within 0..1");
  if (opt.shard_tokens < 1 || opt.shard_tokens > static_cast<uint64_t>(INT32_MAX))
    fail("prepare: --shard-tokens ", opt.shard_tokens, " must be within 1..", INT32_MAX);

  const Tokenizer tok = Tokenizer::load(opt.tokenizer);
  const int32_t eot = tok.eot_id();
  const int token_bytes = shard_token_bytes(tok.vocab_size());

  const CorpusCount count = count_documents(opt.inputs);
  if (count.documents == 0) fail("prepare: the inputs hold no documents");
  const uint64_t D = count.documents;
  uint64_t n_val;
  if (opt.val_docs >= 0) {
    n_val = static_cast<uint64_t>(opt.val_docs);
  } else {
    const double f = opt.val_fraction >= 0 ? opt.val_fraction : 0.01;
    n_val = static_cast<uint64_t>(std::llround(f * D));
    if (f > 0 && n_val == 0) n_val = 1;
  }
  if (n_val >= D)
    fail("prepare: ", n_val, " validation documents would leave none of the ", D, " for training");

  std::error_code ec;
  fs::create_directories(opt.out_dir, ec);
  if (ec) fail(opt.out_dir, ": cannot create the output folder (", ec.message(), ")");
  remove_stale_staging(opt.out_dir);
  // The new output is written into a staging folder beside the old one, which stays
  // whole until the new one is complete (see publish_output).
  const fs::path staging = fs::path(opt.out_dir) / (kStagingPrefix + std::to_string(::getpid()));
  fs::remove_all(staging, ec);
  if (!fs::create_directory(staging, ec) && ec)
    fail(staging.string(), ": cannot create the staging folder (", ec.message(), ")");
  try {
    ShardWriter train(staging.string(), "train", opt.shard_tokens, token_bytes);
    ShardWriter val(staging.string(), "val", opt.shard_tokens, token_bytes);
    PrepareSummary sum;
    sum.tokenizer = tok.origin();
    sum.vocab_size = tok.vocab_size();
    std::vector<std::string> val_ids;
    DocumentReader reader(opt.inputs);
    Progress progress(opt.progress, count.text_bytes);
    uint64_t doc_index = 0, bytes_done = 0;
    for (;;) {
      std::vector<Document> docs = reader.next_chunk(32u << 20);
      if (docs.empty()) break;
      std::vector<std::string_view> texts;
      for (const auto& d : docs) texts.emplace_back(d.text);
      std::vector<std::vector<int32_t>> encoded = tok.encode_batch(texts, opt.threads);
      for (size_t k = 0; k < docs.size(); ++k, ++doc_index) {
        const bool is_val = (doc_index + 1) * n_val / D > doc_index * n_val / D;
        std::vector<int32_t>& ids = encoded[k];
        ids.insert(ids.begin(), eot);
        (is_val ? val : train).append(ids);
        (is_val ? sum.val_documents : sum.train_documents) += 1;
        if (is_val) val_ids.push_back(docs[k].id);
        sum.text_bytes += docs[k].text.size();
        bytes_done += docs[k].text.size();
      }
      progress.update(bytes_done, train.total() + val.total());
    }
    train.flush();
    val.flush();
    progress.update(bytes_done, train.total() + val.total(), true);
    if (doc_index != D)
      fail("prepare: counted ", D, " documents but read ", doc_index, "; did an input change during the run?");

    sum.documents = doc_index;
    sum.train_tokens = train.total();
    sum.val_tokens = val.total();
    auto in_out_dir = [&](const std::vector<std::string>& paths) {
      std::vector<std::string> out;
      for (const auto& p : paths) out.push_back((fs::path(opt.out_dir) / fs::path(p).filename()).string());
      return out;
    };
    sum.train_shards = in_out_dir(train.written());
    sum.val_shards = in_out_dir(val.written());
    sum.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();

    nlohmann::ordered_json meta;
    meta["tokenizer"] = opt.tokenizer;
    meta["tokenizer_file"] = tok.origin();
    meta["vocab_size"] = tok.vocab_size();
    meta["eot_id"] = eot;
    meta["token_bytes"] = token_bytes;
    meta["documents"] = {{"train", sum.train_documents}, {"val", sum.val_documents}};
    meta["tokens"] = {{"train", sum.train_tokens}, {"val", sum.val_tokens}};
    meta["text_bytes"] = sum.text_bytes;
    meta["shard_tokens"] = opt.shard_tokens;
    auto names = [](const std::vector<std::string>& paths) {
      std::vector<std::string> out;
      for (const auto& p : paths) out.push_back(fs::path(p).filename().string());
      return out;
    };
    meta["train_shards"] = names(sum.train_shards);
    meta["val_shards"] = names(sum.val_shards);
    meta["val_document_ids"] = val_ids;
    meta["inputs"] = opt.inputs;
    write_file_atomic((staging / "prepare.json").string(), meta.dump(1) + "\n");
    publish_output(staging, opt.out_dir);
    return sum;
  } catch (...) {
    fs::remove_all(staging, ec);  // the old output is untouched
    throw;
  }
}

}  // namespace mhar::data
