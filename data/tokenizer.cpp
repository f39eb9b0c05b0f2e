// tokenizer.cpp: loading tokenizer.json, the pre-tokenizer rules, byte-level BPE.
// Pre-tokenization is hand-written rather than run through a regex engine: each rule
// below is the exact left-to-right, first-alternative-wins, backtracking semantics of
// its regex, written as a scanner (several times faster, and identical by test against
// the reference libraries). BPE merges the lowest-ranked adjacent pair first, leftmost
// on ties, like Hugging Face's BPE model; results are memoized per piece and thread.
#include "data/tokenizer.h"

#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <queue>
#include <sstream>
#include <thread>
#include <unordered_map>

#include "data/unicode.h"
#include "engine/error.h"

namespace mhar::data {

const char* const kGpt2Pattern =
    R"('s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+)";
const char* const kQwenPattern =
    R"((?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+)";
const char* const kCl100kPattern =
    R"((?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+)";

namespace {

// ---------------------------------------------------------------- characters

struct Char {
  char32_t code;
  uint8_t length;
  CharClass cls;
};

const std::array<CharClass, 128>& ascii_classes() {
  static const auto table = [] {
    std::array<CharClass, 128> t{};
    for (char32_t c = 0; c < 128; ++c) t[c] = char_class(c);
    return t;
  }();
  return table;
}

inline Char char_at(std::string_view s, size_t i) {
  const auto b = static_cast<uint8_t>(s[i]);
  if (b < 0x80) return {b, 1, ascii_classes()[b]};
  const DecodedChar d = decode_utf8(s, i);
  return {d.code, d.length, char_class(d.code)};
}

// End of the run of characters of class `cls` starting at i.
inline size_t run_end(std::string_view s, size_t i, CharClass cls) {
  while (i < s.size()) {
    const Char c = char_at(s, i);
    if (c.cls != cls) break;
    i += c.length;
  }
  return i;
}

// Length of the contraction ('s 't 're 've 'm 'll 'd) at s[i] == '\'', or 0.
// Case-insensitive matching follows Unicode simple case folding, in which U+017F
// (long s) folds to 's'.
size_t contraction_length(std::string_view s, size_t i, bool ignore_case) {
  if (i + 1 >= s.size()) return 0;
  auto fold = [&](size_t k, size_t* len) -> char32_t {
    if (k >= s.size()) return 0;
    const Char c = char_at(s, k);
    *len = c.length;
    if (!ignore_case) return c.code;
    if (c.code >= 'A' && c.code <= 'Z') return c.code + 32;
    if (c.code == 0x17F) return 's';
    return c.code;
  };
  size_t l1 = 0, l2 = 0;
  const char32_t a = fold(i + 1, &l1);
  if (a == 's' || a == 't' || a == 'm' || a == 'd') return 1 + l1;
  const char32_t b = fold(i + 1 + l1, &l2);
  if ((a == 'r' && b == 'e') || (a == 'v' && b == 'e') || (a == 'l' && b == 'l'))
    return 1 + l1 + l2;
  return 0;
}

// ' ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+' after the contractions.
template <class Emit>
void split_gpt2(std::string_view s, Emit&& emit) {
  const size_t n = s.size();
  size_t i = 0;
  while (i < n) {
    const Char c = char_at(s, i);
    if (c.code == '\'') {
      if (size_t len = contraction_length(s, i, false)) {
        emit(i, len);
        i += len;
        continue;
      }
    }
    if (c.code == ' ' && i + 1 < n) {
      const Char d = char_at(s, i + 1);
      if (d.cls != CharClass::Space) {
        const size_t end = run_end(s, i + 1, d.cls);
        emit(i, end - i);
        i = end;
        continue;
      }
    } else if (c.cls != CharClass::Space) {
      const size_t end = run_end(s, i, c.cls);
      emit(i, end - i);
      i = end;
      continue;
    }
    // Whitespace run [i, end); a run followed by a non-space leaves its last character
    // to lead the next piece (\s+(?!\S) backtracks by one), unless it is that one char.
    size_t end = i, last = i;
    while (end < n) {
      const Char w = char_at(s, end);
      if (w.cls != CharClass::Space) break;
      last = end;
      end += w.length;
    }
    const size_t stop = (end == n || last == i) ? end : last;
    emit(i, stop - i);
    i = stop;
  }
}

// Qwen2/Qwen3 (max_digits 1) and cl100k/Llama-3 (max_digits 3):
// (?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,k}|
//  ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+
template <class Emit>
void split_qwen(std::string_view s, int max_digits, Emit&& emit) {
  const size_t n = s.size();
  size_t i = 0;
  while (i < n) {
    const Char c = char_at(s, i);
    if (c.code == '\'') {
      if (size_t len = contraction_length(s, i, true)) {
        emit(i, len);
        i += len;
        continue;
      }
    }
    if (c.cls == CharClass::Letter) {
      const size_t end = run_end(s, i, CharClass::Letter);
      emit(i, end - i);
      i = end;
      continue;
    }
    if (c.cls != CharClass::Number && c.code != '\r' && c.code != '\n' && i + c.length < n &&
        char_at(s, i + c.length).cls == CharClass::Letter) {
      const size_t end = run_end(s, i + c.length, CharClass::Letter);
      emit(i, end - i);
      i = end;
      continue;
    }
    if (c.cls == CharClass::Number) {
      size_t end = i;
      for (int k = 0; k < max_digits && end < n; ++k) {
        const Char d = char_at(s, end);
        if (d.cls != CharClass::Number) break;
        end += d.length;
      }
      emit(i, end - i);
      i = end;
      continue;
    }
    size_t other_start = n;
    if (c.cls == CharClass::Other) {
      other_start = i;
    } else if (c.code == ' ' && i + 1 < n && char_at(s, i + 1).cls == CharClass::Other) {
      other_start = i + 1;
    }
    if (other_start != n) {
      size_t end = run_end(s, other_start, CharClass::Other);
      while (end < n && (s[end] == '\r' || s[end] == '\n')) ++end;
      emit(i, end - i);
      i = end;
      continue;
    }
    // c is whitespace. \s*[\r\n]+ ends after the last newline of the run; otherwise
    // \s+(?!\S) and \s+ as in GPT-2.
    size_t end = i, last = i, after_newline = 0;
    while (end < n) {
      const Char w = char_at(s, end);
      if (w.cls != CharClass::Space) break;
      last = end;
      end += w.length;
      if (w.code == '\r' || w.code == '\n') after_newline = end;
    }
    size_t stop;
    if (after_newline) {
      stop = after_newline;
    } else {
      stop = (end == n || last == i) ? end : last;
    }
    emit(i, stop - i);
    i = stop;
  }
}

// ---------------------------------------------------------------- byte level

// GPT-2's reversible map from bytes to printable characters, used to spell tokens.
std::array<char32_t, 256> byte_to_char_table() {
  std::array<char32_t, 256> t{};
  char32_t next = 256;
  for (int b = 0; b < 256; ++b) {
    const bool printable = (b >= 33 && b <= 126) || (b >= 161 && b <= 172) || (b >= 174);
    t[b] = printable ? static_cast<char32_t>(b) : next++;
  }
  return t;
}

uint64_t hash_bytes(std::string_view s) {
  uint64_t h = 0xcbf29ce484222325ull;  // FNV-1a, then a final mix
  for (unsigned char c : s) h = (h ^ c) * 0x100000001b3ull;
  h ^= h >> 29;
  h *= 0xbf58476d1ce4e5b9ull;
  return h ^ (h >> 32);
}

inline uint64_t mix64(uint64_t x) {
  x ^= x >> 33;
  x *= 0xff51afd7ed558ccdull;
  x ^= x >> 33;
  x *= 0xc4ceb9fe1a85ec53ull;
  return x ^ (x >> 33);
}

// Open-addressing map from an id pair to (merge rank, merged id).
class PairTable {
 public:
  static constexpr uint32_t kNone = UINT32_MAX;
  void reserve(size_t n) {
    size_t cap = 16;
    while (cap < 2 * n) cap <<= 1;
    slots_.assign(cap, Slot{});
    mask_ = cap - 1;
  }
  bool insert(int32_t a, int32_t b, uint32_t rank, int32_t merged) {
    const uint64_t key = pack(a, b);
    for (size_t p = mix64(key) & mask_;; p = (p + 1) & mask_) {
      if (slots_[p].rank == kNone) {
        slots_[p] = {key, rank, merged};
        return true;
      }
      if (slots_[p].key == key) return false;
    }
  }
  // The rank of merging (a, b), kNone if not a merge; sets *merged.
  inline uint32_t find(int32_t a, int32_t b, int32_t* merged) const {
    const uint64_t key = pack(a, b);
    for (size_t p = mix64(key) & mask_;; p = (p + 1) & mask_) {
      const Slot& s = slots_[p];
      if (s.rank == kNone) return kNone;
      if (s.key == key) {
        *merged = s.merged;
        return s.rank;
      }
    }
  }

 private:
  struct Slot {
    uint64_t key = 0;
    uint32_t rank = kNone;
    int32_t merged = 0;
  };
  static uint64_t pack(int32_t a, int32_t b) {
    return (static_cast<uint64_t>(static_cast<uint32_t>(a)) << 32) | static_cast<uint32_t>(b);
  }
  std::vector<Slot> slots_;
  size_t mask_ = 0;
};

enum class Rule { Gpt2, Qwen };

}  // namespace

// ---------------------------------------------------------------- the model

struct AddedToken {
  std::string content;
  int32_t id;
  bool special;
};

// A memo of piece bytes -> ids: open addressing over offsets into two arenas, so an
// entry costs no allocation of its own.
class PieceTable {
 public:
  PieceTable() { slots_.resize(1 << 8); }
  // Appends the ids of piece to out and returns true if present.
  bool find(std::string_view piece, uint64_t hash, std::vector<int32_t>& out) const {
    for (size_t p = hash & (slots_.size() - 1);; p = (p + 1) & (slots_.size() - 1)) {
      const Slot& s = slots_[p];
      if (s.key_len == kEmpty) return false;
      if (s.hash == hash && s.key_len == piece.size() &&
          std::string_view(keys_.data() + s.key_off, s.key_len) == piece) {
        out.insert(out.end(), values_.begin() + s.val_off, values_.begin() + s.val_off + s.val_len);
        return true;
      }
    }
  }
  // Adds a piece known to be absent. Past max_key_bytes it starts over (memory stays
  // bounded on endless streams of new pieces).
  void insert(std::string_view piece, uint64_t hash, const int32_t* ids, size_t count, size_t max_key_bytes) {
    if (keys_.size() + piece.size() > max_key_bytes) clear();
    if (2 * (used_ + 1) > slots_.size()) grow();
    size_t p = hash & (slots_.size() - 1);
    while (slots_[p].key_len != kEmpty) p = (p + 1) & (slots_.size() - 1);
    slots_[p] = {hash, static_cast<uint32_t>(keys_.size()), static_cast<uint32_t>(piece.size()),
                 static_cast<uint32_t>(values_.size()), static_cast<uint32_t>(count)};
    keys_.append(piece);
    values_.insert(values_.end(), ids, ids + count);
    ++used_;
  }

 private:
  static constexpr uint32_t kEmpty = UINT32_MAX;
  struct Slot {
    uint64_t hash = 0;
    uint32_t key_off = 0, key_len = kEmpty, val_off = 0, val_len = 0;
  };
  void clear() {
    std::fill(slots_.begin(), slots_.end(), Slot{});
    keys_.clear();
    values_.clear();
    used_ = 0;
  }
  void grow() {
    std::vector<Slot> old(slots_.size() * 2);
    old.swap(slots_);
    for (const Slot& s : old) {
      if (s.key_len == kEmpty) continue;
      size_t p = s.hash & (slots_.size() - 1);
      while (slots_[p].key_len != kEmpty) p = (p + 1) & (slots_.size() - 1);
      slots_[p] = s;
    }
  }
  std::vector<Slot> slots_;
  std::string keys_;
  std::vector<int32_t> values_;
  size_t used_ = 0;
};

struct TokenizerModel {
  std::string origin;
  Rule rule = Rule::Gpt2;
  int max_digits = 1;
  bool add_prefix_space = false;
  bool nfc = false;
  std::vector<std::string> token_bytes;  // id -> bytes
  std::unordered_map<std::string, int32_t> id_of_bytes;
  std::array<int32_t, 256> byte_token{};  // single-byte token of each byte
  PairTable merges;
  size_t merge_count = 0;
  std::vector<AddedToken> added;  // longest first, for leftmost-longest matching
  int32_t eot = -1;
};

namespace {

// Memoized BPE for one thread: piece bytes -> ids. Keys and values live in arenas.
class Encoder {
 public:
  explicit Encoder(const TokenizerModel& m) : m_(m) {}

  void encode_plain(std::string_view text, std::vector<int32_t>& out) {
    std::string prefixed, normalized;
    if (m_.add_prefix_space && (text.empty() || text[0] != ' ')) {
      prefixed = " ";
      prefixed.append(text);
      text = prefixed;
    }
    if (m_.nfc && may_need_nfc(text)) {
      normalized = nfc(text);
      text = normalized;
    }
    auto emit = [&](size_t start, size_t len) { encode_piece(text.substr(start, len), out); };
    if (m_.rule == Rule::Gpt2)
      split_gpt2(text, emit);
    else
      split_qwen(text, m_.max_digits, emit);
  }

  // force: 1 = the scan, 2 = the heap (tests); 0 = by length.
  void bpe_uncached(std::string_view piece, std::vector<int32_t>& out, int force) {
    if (!piece.empty()) bpe(piece, out, force);
  }

  void encode_piece(std::string_view piece, std::vector<int32_t>& out) {
    if (piece.size() == 1) {
      out.push_back(m_.byte_token[static_cast<uint8_t>(piece[0])]);
      return;
    }
    const uint64_t h = hash_bytes(piece);
    if (local_.find(piece, h, out)) return;
    // Each thread keeps its own memo: a table shared between threads (tried, with
    // sharded locks) cost more than the merges it saved (BENCHMARKS.md, Tokenizer).
    const size_t before = out.size();
    bpe(piece, out);
    local_.insert(piece, h, out.data() + before, out.size() - before, kMaxLocalKeyBytes);
  }

 private:
  static constexpr size_t kMaxLocalKeyBytes = 64u << 20;

  void bpe(std::string_view piece, std::vector<int32_t>& out, int force = 0) {
    syms_.clear();
    for (unsigned char b : piece) syms_.push_back(m_.byte_token[b]);
    if (force == 2 || (force == 0 && syms_.size() > 256)) {
      bpe_heap(out);
      return;
    }
    // Short pieces: ranks_[k] is the rank of merging syms_[k], syms_[k+1].
    ranks_.resize(syms_.size());
    merged_.resize(syms_.size());
    const size_t n0 = syms_.size();
    for (size_t k = 0; k + 1 < n0; ++k) ranks_[k] = m_.merges.find(syms_[k], syms_[k + 1], &merged_[k]);
    size_t n = n0;
    while (n > 1) {
      uint32_t best = PairTable::kNone;
      size_t at = 0;
      for (size_t k = 0; k + 1 < n; ++k)
        if (ranks_[k] < best) best = ranks_[k], at = k;
      if (best == PairTable::kNone) break;
      syms_[at] = merged_[at];
      for (size_t k = at + 1; k + 1 < n; ++k) {
        syms_[k] = syms_[k + 1];
        ranks_[k] = ranks_[k + 1];
        merged_[k] = merged_[k + 1];
      }
      --n;
      if (at + 1 < n) ranks_[at] = m_.merges.find(syms_[at], syms_[at + 1], &merged_[at]);
      if (at > 0) ranks_[at - 1] = m_.merges.find(syms_[at - 1], syms_[at], &merged_[at - 1]);
    }
    out.insert(out.end(), syms_.begin(), syms_.begin() + n);
  }

  // Long pieces (long whitespace or symbol runs): a heap of candidate merges over a
  // linked list, stale entries skipped when popped. Same order as the scan above.
  void bpe_heap(std::vector<int32_t>& out) {
    const size_t n = syms_.size();
    std::vector<int32_t> prev(n), next(n);
    for (size_t k = 0; k < n; ++k) prev[k] = static_cast<int32_t>(k) - 1, next[k] = static_cast<int32_t>(k + 1);
    next[n - 1] = -1;
    struct Cand {
      uint32_t rank;
      int32_t pos, left, right, merged;
      bool operator>(const Cand& o) const { return rank != o.rank ? rank > o.rank : pos > o.pos; }
    };
    std::priority_queue<Cand, std::vector<Cand>, std::greater<Cand>> heap;
    auto push = [&](int32_t a) {
      const int32_t b = next[a];
      if (a < 0 || b < 0) return;
      int32_t merged;
      const uint32_t r = m_.merges.find(syms_[a], syms_[b], &merged);
      if (r != PairTable::kNone) heap.push({r, a, syms_[a], syms_[b], merged});
    };
    for (size_t k = 0; k + 1 < n; ++k) push(static_cast<int32_t>(k));
    std::vector<bool> dead(n, false);
    while (!heap.empty()) {
      const Cand c = heap.top();
      heap.pop();
      const int32_t b = next[c.pos];
      if (dead[c.pos] || b < 0 || syms_[c.pos] != c.left || syms_[b] != c.right) continue;
      syms_[c.pos] = c.merged;
      dead[b] = true;
      next[c.pos] = next[b];
      if (next[b] >= 0) prev[next[b]] = c.pos;
      push(c.pos);
      if (prev[c.pos] >= 0) push(prev[c.pos]);
    }
    for (int32_t k = 0; k >= 0; k = next[k]) out.push_back(syms_[k]);
  }

  const TokenizerModel& m_;
  PieceTable local_;
  std::vector<int32_t> syms_;
  std::vector<uint32_t> ranks_;
  std::vector<int32_t> merged_;
};

std::string read_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) fail("tokenizer: cannot open ", path);
  std::ostringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

std::string json_type(const nlohmann::json& j) { return j.is_null() ? "null" : j.dump(); }

// Reads the pre_tokenizer section; returns a description of what is unsupported.
void read_pre_tokenizer(const nlohmann::json& pt, TokenizerModel& m, const std::string& origin) {
  auto unsupported = [&](const std::string& what) {
    fail(origin, ": unsupported pre_tokenizer (", what, "): ", pt.dump().substr(0, 300),
         "; supported: ByteLevel with use_regex (GPT-2), or Sequence[Split(Qwen or cl100k "
         "regex, Isolated), ByteLevel without regex]");
  };
  if (pt.is_null()) unsupported("none");
  const std::string type = pt.value("type", "");
  if (type == "ByteLevel") {
    if (!pt.value("use_regex", true)) unsupported("ByteLevel without a regex split");
    m.rule = Rule::Gpt2;
    m.add_prefix_space = pt.value("add_prefix_space", false);
    return;
  }
  if (type != "Sequence") unsupported("type " + type);
  const auto& list = pt.at("pretokenizers");
  if (list.size() != 2) unsupported("a sequence of " + std::to_string(list.size()));
  const auto& split = list[0];
  const auto& byte_level = list[1];
  if (split.value("type", "") != "Split" || byte_level.value("type", "") != "ByteLevel")
    unsupported("not Split then ByteLevel");
  if (byte_level.value("use_regex", true)) unsupported("ByteLevel after Split also splits");
  m.add_prefix_space = byte_level.value("add_prefix_space", false);
  if (split.value("behavior", "") != "Isolated" || split.value("invert", false))
    unsupported("Split behavior must be Isolated, not inverted");
  const auto& pattern = split.at("pattern");
  const std::string regex = pattern.contains("Regex") ? pattern["Regex"].get<std::string>() : "";
  if (regex == kGpt2Pattern) {
    m.rule = Rule::Gpt2;
  } else if (regex == kQwenPattern) {
    m.rule = Rule::Qwen;
    m.max_digits = 1;
  } else if (regex == kCl100kPattern) {
    m.rule = Rule::Qwen;
    m.max_digits = 3;
  } else {
    unsupported("split pattern " + pattern.dump());
  }
}

std::string spell_to_bytes(const std::string& spelled, const std::unordered_map<char32_t, int>& char_to_byte,
                           const std::string& origin) {
  std::string bytes;
  for (size_t i = 0; i < spelled.size();) {
    const DecodedChar d = decode_utf8(spelled, i);
    auto it = char_to_byte.find(d.code);
    if (it == char_to_byte.end())
      fail(origin, ": vocabulary token \"", spelled,
           "\" has a character outside the byte-level alphabet; only byte-level BPE "
           "vocabularies are supported");
    bytes.push_back(static_cast<char>(it->second));
    i += d.length;
  }
  return bytes;
}

}  // namespace

// ---------------------------------------------------------------- loading

Tokenizer Tokenizer::from_json(const nlohmann::json& j, const std::string& origin) {
  auto m = std::make_shared<TokenizerModel>();
  m->origin = origin;
  try {
    const auto& model = j.at("model");
    if (model.value("type", "BPE") != "BPE")
      fail(origin, ": model type ", model.value("type", ""), " is not supported; only BPE is");
    for (const char* key : {"dropout", "unk_token"})
      if (model.contains(key) && !model[key].is_null())
        fail(origin, ": model.", key, " = ", model[key].dump(), " is not supported (must be null)");
    for (const char* key : {"continuing_subword_prefix", "end_of_word_suffix"})
      if (model.contains(key) && !model[key].is_null() && model[key] != "")
        fail(origin, ": model.", key, " = ", model[key].dump(), " is not supported (must be empty)");
    if (model.value("byte_fallback", false)) fail(origin, ": model.byte_fallback = true is not supported");
    if (model.value("ignore_merges", false)) fail(origin, ": model.ignore_merges = true is not supported");

    const auto& normalizer = j.contains("normalizer") ? j["normalizer"] : nlohmann::json();
    if (!normalizer.is_null()) {
      if (normalizer.value("type", "") != "NFC")
        fail(origin, ": normalizer ", json_type(normalizer), " is not supported (null or NFC)");
      m->nfc = true;
    }
    read_pre_tokenizer(j.contains("pre_tokenizer") ? j["pre_tokenizer"] : nlohmann::json(), *m, origin);

    const auto table = byte_to_char_table();
    std::unordered_map<char32_t, int> char_to_byte;
    for (int b = 0; b < 256; ++b) char_to_byte[table[b]] = b;

    const auto& vocab = model.at("vocab");
    int32_t max_id = -1;
    for (auto it = vocab.begin(); it != vocab.end(); ++it) max_id = std::max(max_id, it.value().get<int32_t>());
    std::vector<AddedToken> added;
    if (j.contains("added_tokens")) {
      for (const auto& a : j["added_tokens"]) {
        for (const char* flag : {"single_word", "lstrip", "rstrip"})
          if (a.value(flag, false))
            fail(origin, ": added token ", a.value("content", ""), " sets ", flag, " = true, which is not supported");
        added.push_back({a.at("content").get<std::string>(), a.at("id").get<int32_t>(), a.value("special", false)});
        max_id = std::max(max_id, added.back().id);
      }
    }
    if (max_id < 0) fail(origin, ": empty vocabulary");
    m->token_bytes.assign(static_cast<size_t>(max_id) + 1, std::string());
    std::vector<bool> present(m->token_bytes.size(), false);
    std::unordered_map<std::string, int32_t> id_of_spelling;
    id_of_spelling.reserve(vocab.size());
    for (auto it = vocab.begin(); it != vocab.end(); ++it) {
      const int32_t id = it.value().get<int32_t>();
      if (id < 0) fail(origin, ": vocabulary id ", id, " of \"", it.key(), "\" is negative");
      if (present[id]) fail(origin, ": vocabulary id ", id, " is used twice");
      present[id] = true;
      m->token_bytes[id] = spell_to_bytes(it.key(), char_to_byte, origin);
      id_of_spelling.emplace(it.key(), id);
      m->id_of_bytes.emplace(m->token_bytes[id], id);
    }
    for (int b = 0; b < 256; ++b) {
      auto it = m->id_of_bytes.find(std::string(1, static_cast<char>(b)));
      if (it == m->id_of_bytes.end())
        fail(origin, ": the vocabulary lacks the single-byte token for byte ", b,
             "; byte-level BPE needs all 256");
      m->byte_token[b] = it->second;
    }
    for (const AddedToken& a : added) {
      if (!present[a.id]) {
        m->token_bytes[a.id] = a.content;
        present[a.id] = true;
      }
      m->id_of_bytes[a.content] = a.id;
      if (a.content == "<|endoftext|>") m->eot = a.id;
    }
    if (m->eot < 0) {
      auto it = m->id_of_bytes.find("<|endoftext|>");
      if (it != m->id_of_bytes.end()) m->eot = it->second;
    }
    m->added = added;
    std::stable_sort(m->added.begin(), m->added.end(),
                     [](const AddedToken& a, const AddedToken& b) { return a.content.size() > b.content.size(); });

    const auto& merges = model.at("merges");
    m->merges.reserve(merges.size());
    uint32_t rank = 0;
    for (const auto& merge : merges) {
      std::string left, right;
      if (merge.is_string()) {
        const std::string s = merge.get<std::string>();
        const size_t space = s.find(' ');
        if (space == std::string::npos || s.find(' ', space + 1) != std::string::npos)
          fail(origin, ": merge ", rank, " \"", s, "\" is not two tokens separated by one space");
        left = s.substr(0, space);
        right = s.substr(space + 1);
      } else {
        if (!merge.is_array() || merge.size() != 2) fail(origin, ": merge ", rank, " is not a pair: ", merge.dump());
        left = merge[0].get<std::string>();
        right = merge[1].get<std::string>();
      }
      auto l = id_of_spelling.find(left), r = id_of_spelling.find(right), lr = id_of_spelling.find(left + right);
      if (l == id_of_spelling.end() || r == id_of_spelling.end() || lr == id_of_spelling.end())
        fail(origin, ": merge ", rank, " (", left, " ", right, ") uses or makes a token missing from the vocabulary");
      m->merges.insert(l->second, r->second, rank, lr->second);  // a repeated pair keeps its first rank
      ++rank;
    }
    m->merge_count = rank;
  } catch (const nlohmann::json::exception& e) {
    fail(origin, ": not a valid tokenizer.json: ", e.what());
  }
  Tokenizer t;
  t.model_ = std::move(m);
  return t;
}

namespace {

bool is_assets_dir(const std::filesystem::path& p) {
  std::error_code ec;
  return std::filesystem::is_directory(p / "tokenizers", ec) || std::filesystem::is_directory(p / "corpus", ec);
}

}  // namespace

std::string assets_dir() {
  namespace fs = std::filesystem;
  std::vector<std::string> tried;
  if (const char* env = std::getenv("MHAR_ASSETS"); env && *env) {
    if (!fs::is_directory(env)) fail("MHAR_ASSETS=", env, " is not a directory");
    return env;
  }
  auto search_up = [&](fs::path dir) -> std::string {
    for (; !dir.empty(); dir = dir.parent_path()) {
      tried.push_back((dir / "assets").string());
      if (is_assets_dir(dir / "assets")) return (dir / "assets").string();
      if (dir == dir.parent_path()) break;
    }
    return "";
  };
  std::error_code ec;
  if (auto found = search_up(fs::current_path(ec)); !found.empty()) return found;
  char exe[4096];
  const ssize_t len = readlink("/proc/self/exe", exe, sizeof(exe) - 1);
  if (len > 0) {
    exe[len] = 0;
    if (auto found = search_up(fs::path(exe).parent_path()); !found.empty()) return found;
  }
#ifdef MHAR_REPO_DIR
  tried.push_back(std::string(MHAR_REPO_DIR) + "/assets");
  if (is_assets_dir(fs::path(MHAR_REPO_DIR) / "assets")) return std::string(MHAR_REPO_DIR) + "/assets";
#endif
  std::string list;
  for (size_t i = 0; i < tried.size() && i < 6; ++i) list += (i ? ", " : "") + tried[i];
  fail("no assets folder found (looked at $MHAR_ASSETS, ", list,
       "); run tools/fetch_assets.sh or set MHAR_ASSETS");
}

Tokenizer Tokenizer::load(const std::string& name_or_path) {
  namespace fs = std::filesystem;
  std::string path = name_or_path;
  if (name_or_path == "gpt2" || name_or_path == "qwen3") {
    path = assets_dir() + "/tokenizers/" + name_or_path + "/tokenizer.json";
    if (!fs::exists(path))
      fail("tokenizer ", name_or_path, ": ", path, " does not exist; run tools/fetch_assets.sh --tokenizers-only");
  } else if (fs::is_directory(path)) {
    path += "/tokenizer.json";
  }
  if (!fs::exists(path))
    fail("tokenizer ", name_or_path, ": no such file; give gpt2, qwen3, or a path to a tokenizer.json");
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(read_file(path));
  } catch (const nlohmann::json::parse_error& e) {
    fail(path, ": not valid JSON: ", e.what());
  }
  return from_json(j, path);
}

// ---------------------------------------------------------------- encoding

std::vector<int32_t> Tokenizer::encode(std::string_view text) const {
  std::vector<int32_t> out;
  out.reserve(text.size() / 3 + 4);
  Encoder enc(*model_);
  enc.encode_plain(text, out);
  return out;
}

std::vector<int32_t> Tokenizer::encode_with_special(std::string_view text) const {
  std::vector<int32_t> out;
  Encoder enc(*model_);
  size_t i = 0;
  while (i < text.size()) {
    // Leftmost match, longest among those starting there.
    size_t best_pos = std::string_view::npos;
    const AddedToken* best = nullptr;
    for (const AddedToken& a : model_->added) {
      const size_t p = text.find(a.content, i);
      if (p < best_pos) best_pos = p, best = &a;
    }
    if (!best) {
      enc.encode_plain(text.substr(i), out);
      break;
    }
    if (best_pos > i) enc.encode_plain(text.substr(i, best_pos - i), out);
    out.push_back(best->id);
    i = best_pos + best->content.size();
  }
  return out;
}

namespace {

template <class Text>
std::vector<std::vector<int32_t>> encode_many(const TokenizerModel& model, const std::vector<Text>& texts,
                                              int threads) {
  std::vector<std::vector<int32_t>> out(texts.size());
  if (threads <= 0) threads = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  threads = static_cast<int>(std::min<size_t>(threads, std::max<size_t>(1, texts.size())));
  std::atomic<size_t> next{0};
  auto work = [&] {
    Encoder enc(model);
    for (size_t k; (k = next.fetch_add(1)) < texts.size();) {
      std::string_view t(texts[k]);
      out[k].reserve(t.size() / 3 + 4);
      enc.encode_plain(t, out[k]);
    }
  };
  if (threads == 1) {
    work();
    return out;
  }
  std::vector<std::thread> pool;
  for (int t = 0; t < threads; ++t) pool.emplace_back(work);
  for (auto& th : pool) th.join();
  return out;
}

}  // namespace

std::vector<std::vector<int32_t>> Tokenizer::encode_batch(const std::vector<std::string>& texts, int threads) const {
  return encode_many(*model_, texts, threads);
}
std::vector<std::vector<int32_t>> Tokenizer::encode_batch(const std::vector<std::string_view>& texts,
                                                          int threads) const {
  return encode_many(*model_, texts, threads);
}

std::string Tokenizer::decode(const int32_t* ids, size_t count) const {
  std::string out;
  for (size_t k = 0; k < count; ++k) out += token_bytes(ids[k]);
  return out;
}

std::string Tokenizer::decode(const std::vector<int32_t>& ids) const { return decode(ids.data(), ids.size()); }

const std::string& Tokenizer::token_bytes(int32_t id) const {
  if (id < 0 || static_cast<size_t>(id) >= model_->token_bytes.size())
    fail("token id ", id, " is outside the vocabulary of ", model_->origin, " (valid: 0..",
         model_->token_bytes.size() - 1, ")");
  return model_->token_bytes[id];
}

int Tokenizer::vocab_size() const { return static_cast<int>(model_->token_bytes.size()); }

int32_t Tokenizer::eot_id() const {
  if (model_->eot < 0) fail(model_->origin, ": the tokenizer has no <|endoftext|> token");
  return model_->eot;
}

std::optional<int32_t> Tokenizer::token_id(std::string_view content) const {
  auto it = model_->id_of_bytes.find(std::string(content));
  if (it == model_->id_of_bytes.end()) return std::nullopt;
  return it->second;
}

const std::string& Tokenizer::origin() const { return model_->origin; }

std::string Tokenizer::describe() const {
  std::ostringstream os;
  os << model_->origin << ": byte-level BPE, vocab " << vocab_size() << ", " << model_->merge_count
     << " merges, pre-tokenizer "
     << (model_->rule == Rule::Gpt2 ? "gpt2" : (model_->max_digits == 1 ? "qwen" : "cl100k"))
     << (model_->nfc ? ", NFC" : "") << ", eot " << model_->eot;
  return os.str();
}

std::vector<std::string> Tokenizer::pretokenize(std::string_view text) const {
  std::string normalized;
  if (model_->nfc) {
    normalized = nfc(text);
    text = normalized;
  }
  std::vector<std::string> pieces;
  auto emit = [&](size_t start, size_t len) { pieces.emplace_back(text.substr(start, len)); };
  if (model_->rule == Rule::Gpt2)
    split_gpt2(text, emit);
  else
    split_qwen(text, model_->max_digits, emit);
  return pieces;
}

std::vector<int32_t> Tokenizer::bpe_piece_for_test(std::string_view piece, bool use_heap) const {
  std::vector<int32_t> out;
  Encoder enc(*model_);
  enc.bpe_uncached(piece, out, use_heap ? 2 : 1);
  return out;
}

void pretokenize_gpt2(std::string_view text, std::vector<std::string_view>& pieces) {
  split_gpt2(text, [&](size_t start, size_t len) { pieces.push_back(text.substr(start, len)); });
}

}  // namespace mhar::data
