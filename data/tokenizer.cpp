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
#include "engine/json_io.h"

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

// How byte b is spelled in a vocabulary (UTF-8 of its printable stand-in).
std::string spell_of_byte(const std::array<char32_t, 256>& table, int b) {
  const char32_t c = table[b];
  std::string s;
  if (c < 0x80) {
    s.push_back(static_cast<char>(c));
  } else {  // the stand-ins are below U+0800: two bytes
    s.push_back(static_cast<char>(0xC0 | (c >> 6)));
    s.push_back(static_cast<char>(0x80 | (c & 0x3F)));
  }
  return s;
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
  // id -> token bytes through a slot table (4 bytes per id; -1 for an unused id), so
  // a sparse id range costs little.
  std::vector<int32_t> slot_of_id;
  std::vector<std::string> token_strings;
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

// Reading tokenizer.json. Every field is read through a typed, range-checked accessor,
// so a malformed file is refused with the file, the field and its value named, before
// anything is allocated from a value in it (an id of -5 or 2e9 must never index or size
// a table).
using json = nlohmann::json;

// Ids are bounded so that the id -> token table (4 bytes per id up to the largest) stays
// under 64 MiB whatever a file says: 2^24 is 64 times the largest vocabularies in use
// (Gemma's 262,144), and below the 2^31 a uint32 token shard can hold.
constexpr int64_t kMaxTokenIds = int64_t(1) << 24;

// A member that is absent or null reads as the default.
const json* optional_member(const json& obj, const char* key) {
  auto it = obj.find(key);
  return it == obj.end() || it->is_null() ? nullptr : &*it;
}
std::string opt_string(const json& obj, const char* key, const std::string& def, const std::string& where) {
  const json* v = optional_member(obj, key);
  return v ? json_to_string(*v, where + "." + key) : def;
}
bool opt_bool(const json& obj, const char* key, bool def, const std::string& where) {
  const json* v = optional_member(obj, key);
  return v ? json_to_bool(*v, where + "." + key) : def;
}
void require_object(const json& v, const std::string& where) {
  if (!v.is_object()) fail(where, " = ", json_excerpt(v), " has type ", v.type_name(), "; expected an object");
}
void require_array(const json& v, const std::string& where) {
  if (!v.is_array()) fail(where, " = ", json_excerpt(v), " has type ", v.type_name(), "; expected an array");
}
std::string quoted(const std::string& s) { return json_excerpt(json(s), 60); }

void read_pre_tokenizer(const json* pt, TokenizerModel& m, const std::string& origin) {
  const std::string where = origin + ": pre_tokenizer";
  auto unsupported = [&](const std::string& what) {
    fail(origin, ": unsupported pre_tokenizer (", what, "): ", pt ? json_excerpt(*pt, 200) : std::string("null"),
         "; supported: ByteLevel with use_regex (GPT-2), or Sequence[Split(Qwen or cl100k regex, "
         "Isolated), ByteLevel without regex]");
  };
  if (!pt) unsupported("none");
  require_object(*pt, where);
  const std::string type = opt_string(*pt, "type", "", where);
  if (type == "ByteLevel") {
    if (!opt_bool(*pt, "use_regex", true, where)) unsupported("ByteLevel without a regex split");
    m.rule = Rule::Gpt2;
    m.add_prefix_space = opt_bool(*pt, "add_prefix_space", false, where);
    return;
  }
  if (type != "Sequence") unsupported("type " + quoted(type));
  const json& list = json_member(*pt, "pretokenizers", where);
  require_array(list, where + ".pretokenizers");
  if (list.size() != 2) unsupported("a sequence of " + std::to_string(list.size()));
  const json& split = list[0];
  const json& byte_level = list[1];
  const std::string split_where = where + ".pretokenizers[0]", bl_where = where + ".pretokenizers[1]";
  require_object(split, split_where);
  require_object(byte_level, bl_where);
  if (opt_string(split, "type", "", split_where) != "Split" || opt_string(byte_level, "type", "", bl_where) != "ByteLevel")
    unsupported("not Split then ByteLevel");
  if (opt_bool(byte_level, "use_regex", true, bl_where)) unsupported("ByteLevel after Split also splits");
  m.add_prefix_space = opt_bool(byte_level, "add_prefix_space", false, bl_where);
  if (opt_string(split, "behavior", "", split_where) != "Isolated" || opt_bool(split, "invert", false, split_where))
    unsupported("Split behavior must be Isolated, not inverted");
  const json& pattern = json_member(split, "pattern", split_where);
  require_object(pattern, split_where + ".pattern");
  const std::string regex = opt_string(pattern, "Regex", "", split_where + ".pattern");
  if (regex == kGpt2Pattern) {
    m.rule = Rule::Gpt2;
  } else if (regex == kQwenPattern) {
    m.rule = Rule::Qwen;
    m.max_digits = 1;
  } else if (regex == kCl100kPattern) {
    m.rule = Rule::Qwen;
    m.max_digits = 3;
  } else {
    unsupported("split pattern " + json_excerpt(pattern, 120));
  }
}

std::string spell_to_bytes(const std::string& spelled, const std::unordered_map<char32_t, int>& char_to_byte,
                           const std::string& where) {
  std::string bytes;
  for (size_t i = 0; i < spelled.size();) {
    const DecodedChar d = decode_utf8(spelled, i);
    auto it = char_to_byte.find(d.code);
    if (it == char_to_byte.end())
      fail(where, ": token ", quoted(spelled),
           " has a character outside the byte-level alphabet; only byte-level BPE vocabularies are supported");
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
  const std::string at = origin + ": ";
  if (!j.is_object()) fail(origin, ": expected a tokenizer.json object at the top level, got ", j.type_name());

  const json& model = json_member(j, "model", origin);
  require_object(model, at + "model");
  const std::string model_where = at + "model";
  const std::string type = opt_string(model, "type", "BPE", model_where);
  if (type != "BPE") fail(at, "model.type = ", quoted(type), " is not supported; only BPE is");
  for (const char* key : {"dropout", "unk_token"})
    if (const json* v = optional_member(model, key))
      fail(at, "model.", key, " = ", json_excerpt(*v), " is not supported (must be null)");
  for (const char* key : {"continuing_subword_prefix", "end_of_word_suffix"})
    if (!opt_string(model, key, "", model_where).empty())
      fail(at, "model.", key, " = ", json_excerpt(model[key]), " is not supported (must be empty)");
  for (const char* key : {"byte_fallback", "ignore_merges"})
    if (opt_bool(model, key, false, model_where)) fail(at, "model.", key, " = true is not supported");

  if (const json* normalizer = optional_member(j, "normalizer")) {
    require_object(*normalizer, at + "normalizer");
    if (opt_string(*normalizer, "type", "", at + "normalizer") != "NFC")
      fail(at, "normalizer = ", json_excerpt(*normalizer), " is not supported (null or NFC)");
    m->nfc = true;
  }
  read_pre_tokenizer(optional_member(j, "pre_tokenizer"), *m, origin);

  const auto table = byte_to_char_table();
  std::unordered_map<char32_t, int> char_to_byte;
  for (int b = 0; b < 256; ++b) char_to_byte[table[b]] = b;

  // The vocabulary: spelled token -> id.
  const json& vocab = json_member(model, "vocab", model_where);
  require_object(vocab, at + "model.vocab");
  if (vocab.empty()) fail(at, "model.vocab is empty");
  struct Entry {
    std::string bytes;
    int32_t id;
    std::string field;  // names it in messages
  };
  std::vector<Entry> entries;
  entries.reserve(vocab.size());
  std::unordered_map<std::string, int32_t> id_of_spelling;
  id_of_spelling.reserve(vocab.size());
  int64_t max_id = -1;
  for (auto it = vocab.begin(); it != vocab.end(); ++it) {
    const std::string field = "model.vocab[" + quoted(it.key()) + "]";
    if (it.key().empty()) fail(at, field, ": an empty token is not allowed (every token is at least one byte)");
    const int32_t id = static_cast<int32_t>(json_to_int(it.value(), at + field, 0, kMaxTokenIds - 1));
    entries.push_back({spell_to_bytes(it.key(), char_to_byte, at + field), id, field});
    id_of_spelling.emplace(it.key(), id);
    max_id = std::max<int64_t>(max_id, id);
  }
  const size_t vocab_entries = entries.size();

  // Added tokens: raw text, matched in encode_with_special.
  std::vector<AddedToken> added;
  if (const json* list = optional_member(j, "added_tokens")) {
    require_array(*list, at + "added_tokens");
    for (size_t i = 0; i < list->size(); ++i) {
      const json& a = (*list)[i];
      const std::string field = "added_tokens[" + std::to_string(i) + "]";
      require_object(a, at + field);
      const std::string content = json_to_string(json_member(a, "content", at + field), at + field + ".content");
      if (content.empty())
        fail(at, field, ".content = \"\": an added token must have non-empty content (an empty one matches "
             "everywhere)");
      const int32_t id =
          static_cast<int32_t>(json_to_int(json_member(a, "id", at + field), at + field + ".id", 0, kMaxTokenIds - 1));
      for (const char* flag : {"single_word", "lstrip", "rstrip"})
        if (opt_bool(a, flag, false, at + field))
          fail(at, field, ".", flag, " = true (token ", quoted(content), ") is not supported");
      opt_bool(a, "normalized", false, at + field);  // type-checked; mhar matches added tokens on raw text
      added.push_back({content, id, opt_bool(a, "special", false, at + field)});
      entries.push_back({content, id, field + " (content " + quoted(content) + ")"});
      max_id = std::max<int64_t>(max_id, id);
    }
  }

  // Every id belongs to one token: a vocabulary entry, an added token, or both when the
  // added token is the vocabulary's own entry (GPT-2's <|endoftext|>). Ids may leave
  // holes (they decode to nothing), as Hugging Face allows.
  m->slot_of_id.assign(static_cast<size_t>(max_id) + 1, -1);
  std::unordered_map<std::string, size_t> entry_of_bytes;
  entry_of_bytes.reserve(entries.size());
  for (size_t k = 0; k < entries.size(); ++k) {
    const Entry& e = entries[k];
    int32_t& slot = m->slot_of_id[static_cast<size_t>(e.id)];
    const bool is_added = k >= vocab_entries;
    if (slot >= 0) {
      const Entry& first = entries[static_cast<size_t>(slot)];
      const bool same_token = is_added && static_cast<size_t>(slot) < vocab_entries && first.bytes == e.bytes;
      if (!same_token)
        fail(at, e.field, " has id ", e.id, ", already the id of ", first.field,
             "; each id belongs to one token (an added token may only repeat its own vocabulary entry)");
      continue;
    }
    auto [it, fresh] = entry_of_bytes.emplace(e.bytes, k);
    if (!fresh)
      fail(at, e.field, " has id ", e.id, ", but the same text is ", entries[it->second].field, " with id ",
           entries[it->second].id, "; a token's text may have only one id");
    slot = static_cast<int32_t>(k);
  }
  // Compact the strings: slot_of_id points into token_strings.
  m->token_strings.reserve(entry_of_bytes.size());
  for (auto& slot : m->slot_of_id) {
    if (slot < 0) continue;
    Entry& e = entries[static_cast<size_t>(slot)];
    slot = static_cast<int32_t>(m->token_strings.size());
    m->id_of_bytes.emplace(e.bytes, e.id);
    m->token_strings.push_back(std::move(e.bytes));
  }
  for (int b = 0; b < 256; ++b) {
    auto it = m->id_of_bytes.find(std::string(1, static_cast<char>(b)));
    if (it == m->id_of_bytes.end())
      fail(at, "model.vocab lacks the single-byte token for byte ", b, " (spelled ",
           quoted(spell_of_byte(table, b)), "); byte-level BPE needs all 256");
    m->byte_token[b] = it->second;
  }
  for (const AddedToken& a : added)
    if (a.content == "<|endoftext|>") m->eot = a.id;
  if (m->eot < 0) {
    auto it = m->id_of_bytes.find("<|endoftext|>");
    if (it != m->id_of_bytes.end()) m->eot = it->second;
  }
  m->added = std::move(added);
  std::stable_sort(m->added.begin(), m->added.end(),
                   [](const AddedToken& a, const AddedToken& b) { return a.content.size() > b.content.size(); });

  const json& merges = json_member(model, "merges", model_where);
  require_array(merges, at + "model.merges");
  m->merges.reserve(merges.size());
  uint32_t rank = 0;
  for (const auto& merge : merges) {
    const std::string field = at + "model.merges[" + std::to_string(rank) + "]";
    std::string left, right;
    if (merge.is_string()) {
      const std::string& s = merge.get_ref<const std::string&>();
      const size_t space = s.find(' ');
      if (space == std::string::npos || s.find(' ', space + 1) != std::string::npos || space == 0 ||
          space + 1 == s.size())
        fail(field, " = ", quoted(s), " is not two tokens separated by one space");
      left = s.substr(0, space);
      right = s.substr(space + 1);
    } else {
      if (!merge.is_array() || merge.size() != 2)
        fail(field, " = ", json_excerpt(merge), " is neither \"left right\" nor a pair [\"left\", \"right\"]");
      left = json_to_string(merge[0], field + "[0]");
      right = json_to_string(merge[1], field + "[1]");
    }
    auto l = id_of_spelling.find(left), r = id_of_spelling.find(right), lr = id_of_spelling.find(left + right);
    if (l == id_of_spelling.end() || r == id_of_spelling.end() || lr == id_of_spelling.end()) {
      const std::string& missing = l == id_of_spelling.end() ? left : r == id_of_spelling.end() ? right : left + right;
      fail(field, " = (", quoted(left), ", ", quoted(right), ") ",
           lr == id_of_spelling.end() && missing == left + right ? "makes" : "uses", " the token ", quoted(missing),
           ", which model.vocab lacks");
    }
    m->merges.insert(l->second, r->second, rank, lr->second);  // a repeated pair keeps its first rank
    ++rank;
  }
  m->merge_count = rank;
  Tokenizer t;
  t.model_ = std::move(m);
  return t;
}

Tokenizer Tokenizer::from_text(const std::string& text, const std::string& origin) {
  return from_json(parse_json_strict(text, origin), origin);
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
    std::error_code ec;
    if (!fs::is_directory(env, ec)) fail("MHAR_ASSETS=", env, " is not a directory");
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
  std::error_code ec;
  if (name_or_path == "gpt2" || name_or_path == "qwen3") {
    path = assets_dir() + "/tokenizers/" + name_or_path + "/tokenizer.json";
    if (!fs::exists(path, ec))
      fail("tokenizer ", name_or_path, ": ", path, " does not exist; run tools/fetch_assets.sh --tokenizers-only");
  } else if (fs::is_directory(path, ec)) {
    path += "/tokenizer.json";
  } else if (!fs::exists(fs::symlink_status(path, ec))) {
    fail("tokenizer ", name_or_path, ": no such file; give gpt2, qwen3, or a path to a tokenizer.json");
  }
  // Tokenizer files are a few MB (Qwen3's is 11 MB); 256 MB is far above any real one.
  return from_json(read_json_file(path, "tokenizer.json", {}, uint64_t(256) << 20), path);
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
  if (threads < 0 || threads > kMaxThreads)
    fail("encoding threads = ", threads, " is out of range; valid: 0 (all cores) or 1 to ", kMaxThreads);
  if (threads == 0) threads = static_cast<int>(std::clamp(std::thread::hardware_concurrency(), 1u, unsigned(kMaxThreads)));
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
  static const std::string kUnused;
  if (id < 0 || static_cast<size_t>(id) >= model_->slot_of_id.size())
    fail("token id ", id, " is outside the vocabulary of ", model_->origin, " (valid: 0..",
         model_->slot_of_id.size() - 1, ")");
  const int32_t slot = model_->slot_of_id[static_cast<size_t>(id)];
  return slot < 0 ? kUnused : model_->token_strings[static_cast<size_t>(slot)];
}

int Tokenizer::vocab_size() const { return static_cast<int>(model_->slot_of_id.size()); }

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
