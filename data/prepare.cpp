// prepare.cpp: the prepare pipeline: count, read chunks of documents, encode each chunk
// in parallel, append to the train/validation shard writers in document order.
#include "data/prepare.h"

#include <unistd.h>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "data/corpus.h"
#include "data/shard.h"
#include "data/tokenizer.h"
#include "engine/error.h"

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

  fs::create_directories(opt.out_dir);
  // Old shards in the folder would otherwise be globbed together with the new ones.
  for (const auto& entry : fs::directory_iterator(opt.out_dir)) {
    const std::string name = entry.path().filename().string();
    if ((name.rfind("train_", 0) == 0 || name.rfind("val_", 0) == 0) && entry.path().extension() == ".bin")
      fs::remove(entry.path());
  }

  ShardWriter train(opt.out_dir, "train", opt.shard_tokens, token_bytes);
  ShardWriter val(opt.out_dir, "val", opt.shard_tokens, token_bytes);
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
  sum.train_shards = train.written();
  sum.val_shards = val.written();
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
  const std::string meta_path = (fs::path(opt.out_dir) / "prepare.json").string();
  {
    std::ofstream out(meta_path + ".tmp");
    out << meta.dump(1) << "\n";
    if (!out) fail(meta_path, ": write failed");
  }
  fs::rename(meta_path + ".tmp", meta_path);
  return sum;
}

}  // namespace mhar::data
