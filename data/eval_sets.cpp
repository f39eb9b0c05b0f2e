// eval_sets.cpp: `mhar data make-eval` (see eval_sets.h): held-out document selection,
// 13-gram decontamination against the training documents, and the three writers.
#include "data/eval_sets.h"

#include <algorithm>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <string_view>

#include "data/corpus.h"
#include "engine/error.h"
#include "engine/file_io.h"
#include "engine/json_io.h"

namespace mhar::data {

namespace fs = std::filesystem;

namespace {

constexpr int kNgram = 13;

bool is_space(char c) { return c == ' ' || c == '\t' || c == '\n' || c == '\r' || c == '\f' || c == '\v'; }

std::vector<std::string_view> split_words(std::string_view s) {
  std::vector<std::string_view> out;
  size_t i = 0;
  while (i < s.size()) {
    while (i < s.size() && is_space(s[i])) ++i;
    size_t j = i;
    while (j < s.size() && !is_space(s[j])) ++j;
    if (j > i) out.push_back(s.substr(i, j - i));
    i = j;
  }
  return out;
}

uint64_t word_hash(std::string_view w) { return fnv1a64(kFnv1aOffset, w.data(), w.size()); }

uint64_t mix(uint64_t x) {  // splitmix64 finalizer
  x += 0x9E3779B97F4A7C15ULL;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ULL;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBULL;
  return x ^ (x >> 31);
}

// Hash of words[i, i+n): order-sensitive combination of the word hashes.
uint64_t ngram_at(const std::vector<uint64_t>& wh, size_t i, int n) {
  uint64_t h = 0;
  for (int k = 0; k < n; ++k) h = mix(h ^ wh[i + k]);
  return h;
}

std::vector<uint64_t> hashes_of(const std::vector<std::string_view>& words) {
  std::vector<uint64_t> wh(words.size());
  for (size_t i = 0; i < words.size(); ++i) wh[i] = word_hash(words[i]);
  return wh;
}

// True when any n-gram of words[b, e) is in the sorted training set. Items shorter than
// n words are checked as a whole n-gram window of what they have (never: they are
// always longer here).
bool contaminated(const std::vector<uint64_t>& wh, size_t b, size_t e, const std::vector<uint64_t>& train) {
  for (size_t i = b; i + kNgram <= e; ++i)
    if (std::binary_search(train.begin(), train.end(), ngram_at(wh, i, kNgram))) return true;
  return false;
}

bool all_letters(std::string_view w) {
  for (char c : w)
    if (!((c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z'))) return false;
  return true;
}

// A word without the punctuation around it ("garden," -> "garden").
std::string_view bare(std::string_view w) {
  auto letter = [](char c) { return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c & 0x80); };
  size_t b = 0, e = w.size();
  while (b < e && !letter(w[b])) ++b;
  while (e > b && !letter(w[e - 1])) --e;
  return w.substr(b, e - b);
}

std::string join(const std::vector<std::string_view>& words, size_t b, size_t e) {
  std::string s;
  for (size_t i = b; i < e; ++i) {
    if (i > b) s += ' ';
    s.append(words[i]);
  }
  return s;
}

}  // namespace

std::vector<uint64_t> ngram_hashes(const std::string& text, int n) {
  const std::vector<std::string_view> words = split_words(text);
  const std::vector<uint64_t> wh = hashes_of(words);
  std::vector<uint64_t> out;
  for (size_t i = 0; i + size_t(n) <= words.size(); ++i) out.push_back(ngram_at(wh, i, n));
  std::sort(out.begin(), out.end());
  out.erase(std::unique(out.begin(), out.end()), out.end());
  return out;
}

MakeEvalSummary make_eval_sets(const MakeEvalOptions& opt) {
  if (opt.max_items < 4) fail("make-eval: --items ", opt.max_items, " must be at least 4 (HellaSwag needs 4 endings)");
  const std::string meta_path = (fs::path(opt.shards_dir) / "prepare.json").string();
  const nlohmann::json meta = read_json_file(meta_path, "prepare.json of the shards");
  const nlohmann::json& inputs_j = json_member(meta, "inputs", meta_path);
  std::vector<std::string> inputs;
  if (!inputs_j.is_array() || inputs_j.empty()) fail(meta_path, ": inputs must be a non-empty array of paths");
  for (size_t i = 0; i < inputs_j.size(); ++i)
    inputs.push_back(json_to_string(inputs_j[i], meta_path + ": inputs[" + std::to_string(i) + "]"));
  const nlohmann::json& docs_j = json_member(meta, "documents", meta_path);
  const uint64_t n_train = json_to_uint(json_member(docs_j, "train", meta_path + ": documents"), meta_path + ": documents.train", 0, UINT64_MAX / 2);
  const uint64_t n_val = json_to_uint(json_member(docs_j, "val", meta_path + ": documents"), meta_path + ": documents.val", 0, UINT64_MAX / 2);
  const uint64_t D = n_train + n_val;
  const nlohmann::json& val_ids = json_member(meta, "val_document_ids", meta_path);
  if (!val_ids.is_array() || val_ids.size() != n_val)
    fail(meta_path, ": val_document_ids must list the ", n_val, " held-out documents");
  if (n_val == 0) fail(meta_path, ": no documents were held out (prepare with --val-docs N or --val-fraction F)");

  // One pass: training documents feed the n-gram set, held-out ones are kept.
  std::vector<uint64_t> train;
  std::vector<Document> held;
  {
    DocumentReader reader(inputs);
    Document doc;
    uint64_t i = 0;
    while (reader.next(doc)) {
      if (i >= D) fail(meta_path, ": the inputs now hold more than the ", D, " documents prepare read; re-run prepare");
      const bool is_val = (i + 1) * n_val / D > i * n_val / D;  // prepare.h's rule
      if (is_val) {
        const std::string want = json_to_string(val_ids[held.size()], meta_path + ": val_document_ids");
        if (doc.id != want)
          fail(meta_path, ": held-out document ", held.size(), " is '", want, "' but the inputs now give '", doc.id,
               "' there; the inputs changed since prepare (re-run prepare)");
        held.push_back(std::move(doc));
      } else {
        const std::vector<uint64_t> h = ngram_hashes(doc.text);
        train.insert(train.end(), h.begin(), h.end());
      }
      ++i;
    }
    if (i != D) fail(meta_path, ": the inputs now hold ", i, " documents, prepare read ", D, "; re-run prepare");
    std::sort(train.begin(), train.end());
    train.erase(std::unique(train.begin(), train.end()), train.end());
  }

  MakeEvalSummary sum;
  sum.held_out_documents = int64_t(held.size());
  std::string lambada, wikitext;
  struct McItem {
    std::string ctx, ending, source;
  };
  std::vector<McItem> mc;
  for (const Document& doc : held) {
    const std::vector<std::string_view> words = split_words(doc.text);
    const std::vector<uint64_t> wh = hashes_of(words);
    // LAMBADA: consecutive, disjoint passages.
    for (size_t s = 0; s + 41 <= words.size() && sum.lambada < opt.max_items;) {
      size_t found = 0;
      for (size_t e = s + 40; e < std::min(words.size(), s + 120); ++e) {
        const std::string_view w = words[e];
        if (w.size() < 3 || !all_letters(w)) continue;
        bool earlier = false;
        for (size_t k = s; k < e && !earlier; ++k) earlier = bare(words[k]) == w;
        if (earlier) {
          found = e;
          break;
        }
      }
      if (!found) {
        s += 120;
        continue;
      }
      if (contaminated(wh, s, found + 1, train)) {
        ++sum.dropped_contaminated;
      } else {
        lambada += nlohmann::json({{"text", join(words, s, found + 1)}}).dump() + "\n";
        ++sum.lambada;
      }
      s = found + 1;
    }
    // HellaSwag candidates: 45 words of context, 15 of ending, disjoint.
    for (size_t s = 0; s + 60 <= words.size() && int64_t(mc.size()) < opt.max_items; s += 60) {
      if (contaminated(wh, s, s + 60, train)) {
        ++sum.dropped_contaminated;
        continue;
      }
      mc.push_back({join(words, s, s + 45), join(words, s + 45, s + 60), doc.id});
    }
    // WikiText: the document's paragraphs (blank-line separated), whitespace collapsed.
    if (sum.wikitext_paragraphs < opt.max_items) {
      std::string title = doc.id;
      std::replace(title.begin(), title.end(), '=', '-');
      std::replace(title.begin(), title.end(), '\n', ' ');
      std::string page = " = " + title + " = \n \n";
      int64_t paragraphs = 0;
      size_t pos = 0;
      const std::string& t = doc.text;
      while (pos < t.size() && sum.wikitext_paragraphs < opt.max_items) {
        size_t end = t.find("\n\n", pos);
        if (end == std::string::npos) end = t.size();
        const std::vector<std::string_view> pw = split_words(std::string_view(t).substr(pos, end - pos));
        pos = end + 2;
        if (pw.size() < 20) continue;
        const std::vector<uint64_t> ph = hashes_of(pw);
        if (contaminated(ph, 0, pw.size(), train)) {
          ++sum.dropped_contaminated;
          continue;
        }
        page += " " + join(pw, 0, pw.size()) + " \n \n";
        ++paragraphs;
        ++sum.wikitext_paragraphs;
      }
      if (paragraphs) wikitext += page;
    }
  }
  if (mc.size() < 4) fail("make-eval: the held-out documents give ", mc.size(), " clean 60-word passages; HellaSwag needs at least 4");
  std::string hellaswag;
  const size_t n = mc.size();
  for (size_t i = 0; i < n; ++i) {
    // Distractors: the endings of three other items, spread over the set.
    std::vector<std::string> endings;
    for (size_t k = 1; k <= 3; ++k) endings.push_back(mc[(i + k * (n / 4 ? n / 4 : 1) + k - 1) % n].ending);
    for (size_t k = 1; k <= 3; ++k)
      if (endings[k - 1] == mc[i].ending) endings[k - 1] = mc[(i + k) % n].ending;
    const int label = int(mix(opt.seed ^ mix(i)) % 4);
    endings.insert(endings.begin() + label, mc[i].ending);
    nlohmann::json j = {{"ind", i},          {"activity_label", mc[i].source}, {"ctx_a", mc[i].ctx},
                        {"ctx_b", ""},       {"ctx", mc[i].ctx},               {"endings", endings},
                        {"label", label},    {"split", "heldout"}};
    hellaswag += j.dump() + "\n";
  }
  sum.hellaswag = int64_t(n);
  if (sum.lambada == 0) fail("make-eval: no LAMBADA passage found in the held-out documents");
  if (sum.wikitext_paragraphs == 0) fail("make-eval: no paragraph of 20+ words in the held-out documents");
  fs::create_directories(opt.out_dir);
  sum.lambada_path = (fs::path(opt.out_dir) / "lambada.jsonl").string();
  sum.hellaswag_path = (fs::path(opt.out_dir) / "hellaswag.jsonl").string();
  sum.wikitext_path = (fs::path(opt.out_dir) / "wikitext.raw").string();
  write_file_atomic(sum.lambada_path, lambada);
  write_file_atomic(sum.hellaswag_path, hellaswag);
  write_file_atomic(sum.wikitext_path, wikitext);
  return sum;
}

}  // namespace mhar::data
