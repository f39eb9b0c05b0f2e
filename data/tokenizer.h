// tokenizer.h: byte-level BPE tokenizers loaded from Hugging Face tokenizer.json files
// (GPT-2, Qwen3, or one trained by `mhar data train-tokenizer`).
// Conventions: text is bytes (any byte string, valid UTF-8 or not); ids are int32.
// encode() treats text as plain text: "<|endoftext|>" in a document is just characters.
// encode_with_special() also matches the added tokens, as Hugging Face's encode does.
// decode() returns the exact bytes (no U+FFFD substitution), so for tokenizers without
// a normalizer decode(encode(s)) == s for every byte string; with NFC (Qwen3) it holds
// for every NFC string. A Tokenizer is immutable after load and cheap to copy; all
// methods are safe to call from many threads at once.
#pragma once
#include <nlohmann/json.hpp>

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace mhar::data {

// The most threads any data command (encode_batch, prepare, train-tokenizer,
// bench-tokenizer) starts. Encoding and pair counting are CPU-bound with a memo or count
// table per thread, so threads beyond the cores add memory and no speed; 256 is above
// the hardware threads of the largest single machines (2 sockets x 64 cores x 2), and a
// fixed bound (not a multiple of this machine's cores) keeps a command line valid on
// every machine, which matters because every output is identical for any thread count.
inline constexpr int kMaxThreads = 256;

struct TokenizerModel;  // the loaded vocabulary, merges and rules (tokenizer.cpp)

class Tokenizer {
 public:
  // "gpt2" or "qwen3" (files under the assets folder written by tools/fetch_assets.sh,
  // found through $MHAR_ASSETS, else an assets/ folder above the working directory or
  // the executable, else the source tree's), or a path to a tokenizer.json (or to a
  // folder holding one).
  static Tokenizer load(const std::string& name_or_path);
  // From an already-parsed tokenizer.json; `origin` names it in error messages. Every
  // field is validated (types, ids in [0, 2^24), each id and each token text used once,
  // no empty token, merges of vocabulary tokens, a supported model); anything else is
  // refused with an mhar::Error naming origin, the field (e.g. added_tokens[3].id) and
  // its value.
  static Tokenizer from_json(const nlohmann::json& json, const std::string& origin);
  // From the text of a tokenizer.json, parsed strictly (engine/json_io.h: depth limit,
  // duplicate keys refused).
  static Tokenizer from_text(const std::string& text, const std::string& origin);

  std::vector<int32_t> encode(std::string_view text) const;
  std::vector<int32_t> encode_with_special(std::string_view text) const;
  // Plain-text encoding of many documents on `threads` threads (0: all cores; at most
  // kMaxThreads). The result is identical to calling encode() on each, whatever the
  // thread count.
  std::vector<std::vector<int32_t>> encode_batch(const std::vector<std::string>& texts,
                                                 int threads = 0) const;
  std::vector<std::vector<int32_t>> encode_batch(const std::vector<std::string_view>& texts,
                                                 int threads = 0) const;

  std::string decode(const std::vector<int32_t>& ids) const;
  std::string decode(const int32_t* ids, size_t count) const;
  const std::string& token_bytes(int32_t id) const;  // the bytes one id decodes to

  int vocab_size() const;  // largest id + 1 (an unused id below it decodes to nothing)
  int32_t eot_id() const;  // <|endoftext|>; fails if the tokenizer has none
  std::optional<int32_t> token_id(std::string_view content) const;
  const std::string& origin() const;  // the file it was loaded from
  std::string describe() const;       // one line: origin, vocab size, rules

  // The pre-tokenizer's pieces (after normalization), for tests and the trainer.
  std::vector<std::string> pretokenize(std::string_view text) const;
  // BPE of one piece by one of the two merge algorithms (the scan used for pieces of
  // up to 256 bytes, or the heap used above), so tests can check they agree.
  std::vector<int32_t> bpe_piece_for_test(std::string_view piece, bool use_heap) const;

 private:
  std::shared_ptr<const TokenizerModel> model_;
};

// Where tools/fetch_assets.sh puts things; fails with the places it looked if none.
std::string assets_dir();

// The pre-tokenizer regex of GPT-2 (Hugging Face ByteLevel with use_regex) and of
// Qwen2/Qwen3; these are the two rules implemented (plus cl100k/Llama-3's, which is
// Qwen's with \p{N}{1,3}).
extern const char* const kGpt2Pattern;
extern const char* const kQwenPattern;
extern const char* const kCl100kPattern;

// Splits text into pieces by the GPT-2 rule (used by the BPE trainer).
void pretokenize_gpt2(std::string_view text, std::vector<std::string_view>& pieces);

}  // namespace mhar::data
