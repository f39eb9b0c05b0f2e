// bpe_trainer.cpp: piece counting (parallel) and the merge loop. Pair counts live in a
// hash map with a lazily-updated max-heap; each pair remembers the pieces it occurs
// in, so a merge touches only those pieces.
#include "data/bpe_trainer.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <queue>
#include <thread>
#include <unordered_map>

#include "data/corpus.h"
#include "data/tokenizer.h"
#include "engine/error.h"
#include "engine/file_io.h"

namespace mhar::data {
namespace {

using PieceCounts = std::unordered_map<std::string, uint64_t>;

void count_pieces(const std::vector<Document>& docs, int threads, PieceCounts& total) {
  std::vector<PieceCounts> partial(threads);
  std::atomic<size_t> next{0};
  auto work = [&](int t) {
    std::vector<std::string_view> pieces;
    for (size_t k; (k = next.fetch_add(1)) < docs.size();) {
      pieces.clear();
      pretokenize_gpt2(docs[k].text, pieces);
      for (auto p : pieces) ++partial[t][std::string(p)];
    }
  };
  std::vector<std::thread> pool;
  for (int t = 0; t < threads; ++t) pool.emplace_back(work, t);
  for (auto& th : pool) th.join();
  for (auto& p : partial)
    for (auto& [piece, c] : p) total[piece] += c;
}

uint64_t pair_key(int32_t a, int32_t b) { return (static_cast<uint64_t>(a) << 32) | static_cast<uint32_t>(b); }

std::string spell(const std::string& bytes) {
  static const auto table = [] {
    std::array<std::string, 256> t;
    uint32_t next = 256;
    for (int b = 0; b < 256; ++b) {
      const bool printable = (b >= 33 && b <= 126) || (b >= 161 && b <= 172) || (b >= 174);
      const uint32_t c = printable ? b : next++;
      std::string s;
      if (c < 0x80) {
        s.push_back(static_cast<char>(c));
      } else {
        s.push_back(static_cast<char>(0xC0 | (c >> 6)));
        s.push_back(static_cast<char>(0x80 | (c & 0x3F)));
      }
      t[b] = s;
    }
    return t;
  }();
  std::string out;
  for (unsigned char b : bytes) out += table[b];
  return out;
}

}  // namespace

TrainTokenizerSummary train_tokenizer(const TrainTokenizerOptions& opt) {
  const auto t0 = std::chrono::steady_clock::now();
  if (opt.out.empty()) fail("train-tokenizer: --out is required");
  if (opt.vocab_size < 258 || opt.vocab_size > 1'000'000)
    fail("train-tokenizer: --vocab ", opt.vocab_size, " must be within 258..1000000 (256 bytes + merges + <|endoftext|>)");
  if (opt.min_frequency < 1) fail("train-tokenizer: min frequency ", opt.min_frequency, " must be at least 1");
  const int threads = opt.threads > 0 ? opt.threads : static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));

  TrainTokenizerSummary sum;
  PieceCounts counts;
  DocumentReader reader(opt.inputs);
  for (;;) {
    size_t budget = 16u << 20;
    if (opt.max_bytes) {
      if (sum.text_bytes >= opt.max_bytes) break;
      budget = std::min<uint64_t>(budget, opt.max_bytes - sum.text_bytes);
    }
    std::vector<Document> docs = reader.next_chunk(budget);
    if (docs.empty()) break;
    for (const auto& d : docs) sum.text_bytes += d.text.size();
    sum.documents += docs.size();
    count_pieces(docs, threads, counts);
  }
  if (counts.empty()) fail("train-tokenizer: the inputs hold no text");
  sum.unique_pieces = counts.size();
  sum.count_seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();

  // Pieces in a fixed order (sorted bytes) so ids and ties never depend on hashing.
  std::vector<std::pair<std::string, uint64_t>> sorted(counts.begin(), counts.end());
  counts.clear();
  std::sort(sorted.begin(), sorted.end());
  std::vector<std::vector<int32_t>> words;
  std::vector<uint64_t> freq;
  for (auto& [piece, c] : sorted) {
    if (piece.size() < 2) continue;
    words.emplace_back(piece.begin(), piece.end());
    for (auto& s : words.back()) s = static_cast<uint8_t>(s);
    freq.push_back(c);
  }
  sorted.clear();

  std::unordered_map<uint64_t, int64_t> pair_count;
  std::unordered_map<uint64_t, std::vector<uint32_t>> where;
  for (uint32_t w = 0; w < words.size(); ++w) {
    const auto& s = words[w];
    for (size_t i = 0; i + 1 < s.size(); ++i) {
      const uint64_t k = pair_key(s[i], s[i + 1]);
      pair_count[k] += static_cast<int64_t>(freq[w]);
      auto& list = where[k];
      if (list.empty() || list.back() != w) list.push_back(w);
    }
  }
  // Max count first; ties to the smaller pair key.
  using Entry = std::pair<int64_t, uint64_t>;
  auto cmp = [](const Entry& a, const Entry& b) { return a.first != b.first ? a.first < b.first : a.second > b.second; };
  std::priority_queue<Entry, std::vector<Entry>, decltype(cmp)> heap(cmp);
  for (const auto& [k, c] : pair_count) heap.push({c, k});

  std::vector<std::string> token_bytes(256);
  for (int b = 0; b < 256; ++b) token_bytes[b] = std::string(1, static_cast<char>(b));
  std::unordered_map<std::string, int32_t> id_of;
  for (int b = 0; b < 256; ++b) id_of[token_bytes[b]] = b;
  std::vector<std::pair<int32_t, int32_t>> merges;
  const int target_tokens = opt.vocab_size - 1;  // the last id is <|endoftext|>
  std::vector<uint32_t> seen(words.size(), UINT32_MAX);
  std::unordered_map<uint64_t, int64_t> delta;
  std::vector<int32_t> merged_word;

  while (static_cast<int>(token_bytes.size()) < target_tokens && !heap.empty()) {
    const auto [count, key] = heap.top();
    heap.pop();
    auto it = pair_count.find(key);
    const int64_t current = it == pair_count.end() ? 0 : it->second;
    if (current != count) {
      if (current > 0) heap.push({current, key});
      continue;
    }
    if (count < opt.min_frequency) break;
    const int32_t a = static_cast<int32_t>(key >> 32), b = static_cast<int32_t>(key & 0xffffffffu);
    const std::string bytes = token_bytes[a] + token_bytes[b];
    int32_t id;
    if (auto found = id_of.find(bytes); found != id_of.end()) {
      id = found->second;  // the same string reached by another pair: one token, two merges
    } else {
      id = static_cast<int32_t>(token_bytes.size());
      token_bytes.push_back(bytes);
      id_of.emplace(bytes, id);
    }
    merges.emplace_back(a, b);
    const uint32_t stamp = static_cast<uint32_t>(merges.size());
    delta.clear();
    const std::vector<uint32_t> affected = std::move(where[key]);
    where.erase(key);
    for (uint32_t w : affected) {
      if (seen[w] == stamp) continue;
      seen[w] = stamp;
      auto& s = words[w];
      bool any = false;
      for (size_t i = 0; i + 1 < s.size(); ++i)
        if (s[i] == a && s[i + 1] == b) any = true;
      if (!any) continue;
      const int64_t f = static_cast<int64_t>(freq[w]);
      for (size_t i = 0; i + 1 < s.size(); ++i) delta[pair_key(s[i], s[i + 1])] -= f;
      merged_word.clear();
      for (size_t i = 0; i < s.size(); ++i) {
        if (i + 1 < s.size() && s[i] == a && s[i + 1] == b) {
          merged_word.push_back(id);
          ++i;
        } else {
          merged_word.push_back(s[i]);
        }
      }
      s = merged_word;
      for (size_t i = 0; i + 1 < s.size(); ++i) {
        const uint64_t k = pair_key(s[i], s[i + 1]);
        delta[k] += f;
        if (s[i] == id || s[i + 1] == id) {
          auto& list = where[k];
          if (list.empty() || list.back() != w) list.push_back(w);
        }
      }
    }
    for (const auto& [k, d] : delta) {
      if (d == 0) continue;
      int64_t& c = pair_count[k];
      c += d;
      if (c <= 0) {
        pair_count.erase(k);
      } else if (d > 0) {
        heap.push({c, k});
      }
      // A decreased count is found stale when popped and re-pushed then.
    }
  }

  const int32_t eot = static_cast<int32_t>(token_bytes.size());
  nlohmann::ordered_json vocab = nlohmann::ordered_json::object();
  for (size_t id = 0; id < token_bytes.size(); ++id)
    if (id_of[token_bytes[id]] == static_cast<int32_t>(id)) vocab[spell(token_bytes[id])] = id;
  vocab["<|endoftext|>"] = eot;
  nlohmann::ordered_json merge_list = nlohmann::ordered_json::array();
  for (const auto& [l, r] : merges) merge_list.push_back(spell(token_bytes[l]) + " " + spell(token_bytes[r]));
  const nlohmann::ordered_json byte_level = {
      {"type", "ByteLevel"}, {"add_prefix_space", false}, {"trim_offsets", true}, {"use_regex", true}};
  nlohmann::ordered_json j;
  j["version"] = "1.0";
  j["truncation"] = nullptr;
  j["padding"] = nullptr;
  j["added_tokens"] = {{{"id", eot},
                        {"content", "<|endoftext|>"},
                        {"single_word", false},
                        {"lstrip", false},
                        {"rstrip", false},
                        {"normalized", false},
                        {"special", true}}};
  j["normalizer"] = nullptr;
  j["pre_tokenizer"] = byte_level;
  j["post_processor"] = byte_level;
  j["decoder"] = byte_level;
  j["model"] = {{"type", "BPE"},
                {"dropout", nullptr},
                {"unk_token", nullptr},
                {"continuing_subword_prefix", ""},
                {"end_of_word_suffix", ""},
                {"fuse_unk", false},
                {"byte_fallback", false},
                {"vocab", vocab},
                {"merges", merge_list}};
  // Atomic (engine/file_io.h): an existing tokenizer.json stays whole if this fails.
  write_file_atomic(opt.out, j.dump(1, ' ', false, nlohmann::ordered_json::error_handler_t::strict) + "\n");
  sum.vocab_size = eot + 1;
  sum.merges = static_cast<int>(merges.size());
  sum.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return sum;
}

}  // namespace mhar::data
