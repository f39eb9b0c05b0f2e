// tokenizer_validation_test.cpp: a malformed tokenizer.json is refused at load with an
// mhar::Error naming the file, the field and the value (never an abort, a segfault,
// std::bad_alloc or an endless loop): one test per mechanism (id range, id and text
// uniqueness, empty tokens, merges, strict JSON, supported model), then a fuzz loop of
// generated mutations of a small valid tokenizer in which every case either loads, and
// then encodes and decodes a sample exactly and promptly, or is refused with mhar::Error.
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <mutex>
#include <random>
#include <thread>

#include "data/tokenizer.h"
#include "engine/error.h"
#include "tests/data_test_util.h"
#include "tests/wall_clock.h"

using mhar::test::error_of;
using mhar::test::TempDir;
using mhar::test::write_bytes;
using json = nlohmann::json;
namespace md = mhar::data;

namespace {

// How GPT-2's byte-level BPE spells byte b in a vocabulary.
std::string spell(int b) {
  int next = 256;
  for (int x = 0; x < 256; ++x) {
    const bool printable = (x >= 33 && x <= 126) || (x >= 161 && x <= 172) || (x >= 174);
    const int c = printable ? x : next++;
    if (x != b) continue;
    std::string s;
    if (c < 0x80) {
      s.push_back(static_cast<char>(c));
    } else {
      s.push_back(static_cast<char>(0xC0 | (c >> 6)));
      s.push_back(static_cast<char>(0x80 | (c & 0x3F)));
    }
    return s;
  }
  return "";
}

// A small valid tokenizer: the 256 bytes, 12 merges, <|endoftext|> (in the vocabulary,
// like GPT-2's) and one added special token of its own id.
json small_tokenizer() {
  json vocab = json::object();
  for (int b = 0; b < 256; ++b) vocab[spell(b)] = b;
  const std::vector<std::pair<std::string, std::string>> merges = {
      {"h", "e"}, {"t", "he"}, {"Ġ", "the"}, {"a", "n"}, {"an", "d"}, {"Ġ", "and"},
      {"i", "n"}, {"Ġ", "in"}, {"e", "r"}, {"o", "r"}, {"Ġ", "w"}, {"Ġw", "or"}};
  json merge_list = json::array();
  int id = 256;
  for (const auto& [l, r] : merges) {
    vocab[l + r] = id++;
    merge_list.push_back(l + " " + r);
  }
  vocab["<|endoftext|>"] = id;
  json added = json::array();
  added.push_back({{"id", id}, {"content", "<|endoftext|>"}, {"single_word", false}, {"lstrip", false},
                   {"rstrip", false}, {"normalized", true}, {"special", true}});
  added.push_back({{"id", id + 1}, {"content", "<|pad|>"}, {"special", true}});
  return {{"version", "1.0"},
          {"added_tokens", added},
          {"normalizer", nullptr},
          {"pre_tokenizer", {{"type", "ByteLevel"}, {"add_prefix_space", false}, {"use_regex", true}}},
          {"decoder", {{"type", "ByteLevel"}}},
          {"model",
           {{"type", "BPE"}, {"dropout", nullptr}, {"unk_token", nullptr}, {"continuing_subword_prefix", ""},
            {"end_of_word_suffix", ""}, {"byte_fallback", false}, {"vocab", vocab}, {"merges", merge_list}}}};
}

const std::string kSample = "the word and the other <|endoftext|>in <|pad|> caf\xc3\xa9 \xff\xfe x";

// Loads `text` written to a file (so errors must name that file); returns the error.
std::string load_error(const TempDir& dir, const std::string& text) {
  const std::string path = dir / "tok.json";
  write_bytes(path, text);
  return error_of([&] { md::Tokenizer::load(path); });
}

void expect_names(const std::string& error, std::initializer_list<const char*> parts) {
  EXPECT_FALSE(error.empty()) << "the tokenizer loaded, but should have been refused";
  EXPECT_NE(error.find("tok.json"), std::string::npos) << "the error names the file: " << error;
  for (const char* p : parts) EXPECT_NE(error.find(p), std::string::npos) << "'" << p << "' missing from: " << error;
}

}  // namespace

TEST(TokenizerValidation, TheSmallTokenizerIsValidAndRoundTrips) {
  const auto tok = md::Tokenizer::from_json(small_tokenizer(), "small");
  EXPECT_EQ(tok.vocab_size(), 256 + 12 + 2);
  EXPECT_EQ(tok.eot_id(), 268);
  EXPECT_EQ(tok.decode(tok.encode(kSample)), kSample);
  const auto special = tok.encode_with_special(kSample);
  EXPECT_EQ(tok.decode(special), kSample);
  EXPECT_NE(std::find(special.begin(), special.end(), 269), special.end()) << "<|pad|> matched";
  EXPECT_EQ(tok.encode(" the"), std::vector<int32_t>{258});
}

TEST(TokenizerValidation, NegativeIdsAreRefused) {
  TempDir dir;
  json j = small_tokenizer();
  j["added_tokens"][1]["id"] = -5;  // was "double free or corruption"
  expect_names(load_error(dir, j.dump()), {"added_tokens[1].id", "-5", "0 to 16777215"});
  j["added_tokens"][1]["id"] = -1000000;  // was a segfault
  expect_names(load_error(dir, j.dump()), {"added_tokens[1].id", "-1000000"});
  j = small_tokenizer();
  j["model"]["vocab"]["an"] = -1;
  expect_names(load_error(dir, j.dump()), {"model.vocab[\"an\"]", "-1"});
}

TEST(TokenizerValidation, HugeIdsAreRefusedWithoutAllocating) {
  TempDir dir;
  json j = small_tokenizer();
  j["model"]["vocab"]["an"] = 2000000000;  // was std::bad_alloc
  expect_names(load_error(dir, j.dump()), {"model.vocab[\"an\"]", "2000000000"});
  // 2e9 written as a float, and an integer past 64 bits.
  std::string text = j.dump();
  const std::string from = "\"an\":2000000000";
  ASSERT_NE(text.find(from), std::string::npos);
  expect_names(load_error(dir, std::string(text).replace(text.find(from), from.size(), "\"an\":2e9")),
               {"model.vocab[\"an\"]", "2000000000"});
  expect_names(load_error(dir, std::string(text).replace(text.find(from), from.size(), "\"an\":99999999999999999999")),
               {"model.vocab[\"an\"]"});
  j = small_tokenizer();
  j["added_tokens"][1]["id"] = int64_t(1) << 24;  // just past the bound
  expect_names(load_error(dir, j.dump()), {"added_tokens[1].id", "16777216", "0 to 16777215"});
  j["added_tokens"][1]["id"] = 1.5;
  expect_names(load_error(dir, j.dump()), {"added_tokens[1].id", "1.5"});
  j["added_tokens"][1]["id"] = "269";
  expect_names(load_error(dir, j.dump()), {"added_tokens[1].id", "string"});
  // The largest allowed id loads, and costs an id table, not a string per id: an unused
  // id decodes to nothing.
  j["added_tokens"][1]["id"] = (int64_t(1) << 24) - 1;
  write_bytes(dir / "tok.json", j.dump());
  const auto t0 = std::chrono::steady_clock::now();
  const auto tok = md::Tokenizer::load(dir / "tok.json");
  EXPECT_LT(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count(),
            mhar::test::wall_clock_bound(5.0));
  EXPECT_EQ(tok.vocab_size(), 1 << 24);
  EXPECT_EQ(tok.token_bytes(1000), "");
  EXPECT_EQ(tok.token_bytes((1 << 24) - 1), "<|pad|>");
  EXPECT_EQ(tok.decode(tok.encode_with_special(kSample)), kSample);
}

TEST(TokenizerValidation, EachIdAndEachTextBelongsToOneToken) {
  TempDir dir;
  json j = small_tokenizer();
  j["model"]["vocab"]["or"] = j["model"]["vocab"]["an"];  // two vocabulary tokens, one id
  expect_names(load_error(dir, j.dump()), {"model.vocab", "already the id of", "each id belongs to one token"});
  j = small_tokenizer();
  j["added_tokens"][1]["id"] = 5;  // an added token taking a byte token's id
  expect_names(load_error(dir, j.dump()), {"added_tokens[1]", "<|pad|>", "already the id of model.vocab"});
  j = small_tokenizer();
  j["added_tokens"].push_back({{"id", 300}, {"content", "<|pad|>"}});  // the same text twice
  expect_names(load_error(dir, j.dump()), {"added_tokens[2]", "same text is added_tokens[1]"});
  j = small_tokenizer();
  j["added_tokens"].push_back({{"id", 269}, {"content", "<|other|>"}});  // two added tokens, one id
  expect_names(load_error(dir, j.dump()), {"added_tokens[2]", "already the id of added_tokens[1]"});
  j = small_tokenizer();
  j["added_tokens"].push_back({{"id", 300}, {"content", "the"}});  // the text of vocabulary token 257
  expect_names(load_error(dir, j.dump()), {"added_tokens[2]", "id 257"});
  // GPT-2's own layout: <|endoftext|> both in the vocabulary and added, with one id.
  EXPECT_EQ(load_error(dir, small_tokenizer().dump()), "");
}

TEST(TokenizerValidation, EmptyTokensAreRefused) {
  TempDir dir;
  json j = small_tokenizer();
  j["added_tokens"][1]["content"] = "";  // made `encode --special` and `sample` loop forever
  expect_names(load_error(dir, j.dump()), {"added_tokens[1].content", "non-empty"});
  j = small_tokenizer();
  j["model"]["vocab"][""] = 400;
  expect_names(load_error(dir, j.dump()), {"model.vocab[\"\"]", "empty token"});
  j = small_tokenizer();
  j["added_tokens"][0].erase("content");
  expect_names(load_error(dir, j.dump()), {"added_tokens[0]", "missing field \"content\""});
}

TEST(TokenizerValidation, MalformedMergesAreRefused) {
  TempDir dir;
  const std::vector<std::pair<json, const char*>> bad = {
      {"the", "not two tokens separated by one space"},
      {"t h e", "not two tokens separated by one space"},
      {" the", "not two tokens separated by one space"},
      {json::array({"t"}), "neither"},
      {json::array({1, 2}), "model.merges[3][0]"},
      {5, "neither"},
      {"zz q", "which model.vocab lacks"},
      {"q x", "makes the token \"qx\""}};
  for (const auto& [merge, what] : bad) {
    json j = small_tokenizer();
    j["model"]["merges"][3] = merge;
    expect_names(load_error(dir, j.dump()), {"model.merges[3]", what});
  }
  json j = small_tokenizer();
  j["model"]["merges"] = "h e";
  expect_names(load_error(dir, j.dump()), {"model.merges", "expected an array"});
  // The pair form Hugging Face writes since tokenizers 0.20 is accepted.
  j = small_tokenizer();
  for (auto& m : j["model"]["merges"]) {
    const std::string s = m.get<std::string>();
    m = json::array({s.substr(0, s.find(' ')), s.substr(s.find(' ') + 1)});
  }
  EXPECT_EQ(load_error(dir, j.dump()), "");
}

TEST(TokenizerValidation, DeepNestingAndDuplicateKeysAreRefused) {
  TempDir dir;
  std::string text = small_tokenizer().dump();
  const std::string deep = std::string(70000, '[') + std::string(70000, ']');
  expect_names(load_error(dir, "{\"decoder\": " + deep + ", " + text.substr(1)), {"nesting deeper than 64"});
  // A second "model" section would otherwise silently replace the first.
  expect_names(load_error(dir, "{\"model\": {\"type\": \"BPE\"}, " + text.substr(1)), {"duplicate key \"model\""});
  const std::string vocab_key = "\"vocab\":{";
  std::string dup = text;
  dup.insert(dup.find(vocab_key) + vocab_key.size(), "\"an\":5,");
  expect_names(load_error(dir, dup), {"duplicate key \"an\""});
  expect_names(load_error(dir, text.substr(0, text.size() / 2)), {"not valid JSON"});
  expect_names(load_error(dir, "[]"), {"top level"});
}

TEST(TokenizerValidation, UnsupportedModelsAreRefused) {
  TempDir dir;
  json j = small_tokenizer();
  j["model"]["type"] = "Unigram";
  expect_names(load_error(dir, j.dump()), {"model.type", "Unigram", "only BPE"});
  j = small_tokenizer();
  j["model"]["vocab"] = json::array();
  expect_names(load_error(dir, j.dump()), {"model.vocab", "expected an object"});
  j = small_tokenizer();
  j["model"]["vocab"].erase(spell(10));
  expect_names(load_error(dir, j.dump()), {"byte 10", "needs all 256"});
  j = small_tokenizer();
  j["normalizer"] = {{"type", "NFKC"}};
  expect_names(load_error(dir, j.dump()), {"normalizer", "NFKC"});
  j = small_tokenizer();
  j["pre_tokenizer"]["use_regex"] = "yes";
  expect_names(load_error(dir, j.dump()), {"pre_tokenizer.use_regex", "string"});
  j = small_tokenizer();
  j["added_tokens"][1]["lstrip"] = true;
  expect_names(load_error(dir, j.dump()), {"added_tokens[1].lstrip", "not supported"});
  j = small_tokenizer();
  j["model"]["byte_fallback"] = 1;
  expect_names(load_error(dir, j.dump()), {"model.byte_fallback", "true or false"});
  // Not a regular file: refused at once, never waited on.
  EXPECT_NE(error_of([&] { md::Tokenizer::load("/dev/zero"); }).find("character device"), std::string::npos);
}

TEST(TokenizerValidation, TheShippedTokenizersStillLoad) {
  // The validation refuses none of the real files (GPT-2's <|endoftext|> is both in the
  // vocabulary and added; Qwen3 adds 26 tokens after its vocabulary).
  const auto trained = md::Tokenizer::load(mhar::test::fixture_dir() + "/trained_4096.json");
  EXPECT_EQ(trained.vocab_size(), 4096);
  MHAR_LOAD_TOKENIZER_OR_SKIP(gpt2, "gpt2");
  EXPECT_EQ(gpt2.vocab_size(), 50257);
  EXPECT_EQ(gpt2.eot_id(), 50256);
  MHAR_LOAD_TOKENIZER_OR_SKIP(qwen, "qwen3");
  EXPECT_EQ(qwen.vocab_size(), 151669);
}

// ---------------------------------------------------------------- fuzz

namespace {

// Values that have broken loaders: out of range, wrong type, boundary, huge.
json interesting_value(std::mt19937& rng, int existing_id) {
  switch (rng() % 18) {
    case 0: return -1;
    case 1: return -5;
    case 2: return -1000000;
    case 3: return int64_t(1) << 24;
    case 4: return (int64_t(1) << 24) - 1 - int64_t(rng() % 4);
    case 5: return int64_t(1) << 31;
    case 6: return 2e9;
    case 7: return 1.5;
    case 8: return "12";
    case 9: return nullptr;
    case 10: return true;
    case 11: return json::array();
    case 12: return json::object();
    case 13: return existing_id;
    case 14: return int(rng() % 300);
    case 15: return "";
    case 16: return std::numeric_limits<int64_t>::min();
    default: return 270 + int(rng() % 100000);
  }
}

std::string random_string(std::mt19937& rng) {
  static const std::vector<std::string> pool = {"", "a", "the", "<|endoftext|>", "<|pad|>", "Ġ", "Ġthe", " ",
                                                "\xc3\xa9", "zz", "<", "|", "\n", "an d", "t he"};
  if (rng() % 4) return pool[rng() % pool.size()];
  std::string s(1 + rng() % 6, ' ');
  for (auto& c : s) c = static_cast<char>(32 + rng() % 95);
  return s;
}

// One mutation of the small tokenizer: on the JSON value, or on its text.
std::string mutate(const json& base, std::mt19937& rng) {
  json j = base;
  auto& vocab = j["model"]["vocab"];
  auto& merges = j["model"]["merges"];
  auto& added = j["added_tokens"];
  auto random_vocab_key = [&] {
    auto it = vocab.begin();
    std::advance(it, rng() % vocab.size());
    return it.key();
  };
  const int kind = static_cast<int>(rng() % 16);
  const int rounds = 1 + static_cast<int>(rng() % 3);
  try {
  for (int r = 0; r < rounds && kind < 11; ++r) {
    switch (static_cast<int>(rng() % 11)) {
      case 0: vocab[random_vocab_key()] = interesting_value(rng, static_cast<int>(rng() % 270)); break;
      case 1: vocab[random_string(rng)] = interesting_value(rng, static_cast<int>(rng() % 270)); break;
      case 2: vocab.erase(random_vocab_key()); break;
      case 3: {
        if (added.empty()) break;
        auto& a = added[rng() % added.size()];
        static const char* fields[] = {"id", "content", "special", "lstrip", "single_word", "normalized"};
        const char* f = fields[rng() % 6];
        if (std::string(f) == "content" && rng() % 2)
          a[f] = random_string(rng);
        else
          a[f] = interesting_value(rng, static_cast<int>(rng() % 270));
        break;
      }
      case 4: added.push_back(added[rng() % added.size()]); break;
      case 5: added.push_back({{"id", interesting_value(rng, 268)}, {"content", random_string(rng)}}); break;
      case 6: {
        const size_t at = rng() % merges.size();
        switch (rng() % 4) {
          case 0: merges[at] = random_string(rng) + " " + random_string(rng); break;
          case 1: merges[at] = random_string(rng); break;
          case 2: merges[at] = json::array({random_string(rng), random_string(rng)}); break;
          default: merges[at] = interesting_value(rng, 0); break;
        }
        break;
      }
      case 7: merges.push_back(merges[rng() % merges.size()]); break;  // a repeated merge
      case 8: {
        static const char* paths[] = {"/model", "/model/vocab", "/model/merges", "/added_tokens", "/pre_tokenizer",
                                      "/normalizer", "/model/type", "/pre_tokenizer/type", "/model/dropout"};
        const json::json_pointer p(paths[rng() % 9]);
        j[p] = interesting_value(rng, 0);
        break;
      }
      case 9: {
        static const char* keys[] = {"model", "added_tokens", "pre_tokenizer", "normalizer"};
        j.erase(keys[rng() % 4]);
        break;
      }
      default: {
        static const json others[] = {
            {{"type", "NFC"}}, {{"type", "NFKC"}}, {{"type", "Sequence"}, {"normalizers", json::array()}}};
        j["normalizer"] = others[rng() % 3];
        break;
      }
    }
    if (!j.contains("model") || !j["model"].is_object() || !j["model"].contains("vocab") ||
        !j["model"]["vocab"].is_object() || j["model"]["vocab"].empty() || !j["model"].contains("merges") ||
        !j["model"]["merges"].is_array() || j["model"]["merges"].empty() || !j.contains("added_tokens") ||
        !j["added_tokens"].is_array() || j["added_tokens"].empty())
      break;  // the structure the next round edits is gone: stop here
  }
  } catch (const json::exception&) {
    // An edit of a part an earlier edit turned into another type: keep what was done.
  }
  std::string text = j.dump(-1, ' ', false, json::error_handler_t::replace);
  switch (kind) {
    case 11: text.resize(rng() % text.size()); break;  // truncated
    case 12: text[rng() % text.size()] = static_cast<char>(rng()); break;  // a byte changed
    case 13: {  // nested deep at a random value position
      const size_t colon = text.find(':', rng() % text.size());
      if (colon != std::string::npos) {
        const size_t depth = 60 + rng() % 40;
        text.insert(colon + 1, std::string(depth, '[') + "1" + std::string(depth, ']') + ",\"x\":");
      }
      break;
    }
    case 14: {  // a key repeated in some object
      const size_t brace = text.find('{', rng() % text.size());
      if (brace != std::string::npos) {
        const size_t key_end = text.find("\":", brace);
        if (key_end != std::string::npos && key_end > brace + 1)
          text.insert(brace + 1, text.substr(brace + 1, key_end + 2 - brace - 1) + "0,");
      }
      break;
    }
    case 15: text.insert(rng() % text.size(), std::string(1, static_cast<char>(0x80 | (rng() & 0x7F)))); break;
    default: break;
  }
  return text;
}

// Ends the process, failing the test, if a case runs longer than `seconds`: a hang must
// be a failure, not a stuck test.
class Watchdog {
 public:
  explicit Watchdog(double seconds) : thread_([this, seconds] {
    std::unique_lock<std::mutex> lock(mutex_);
    while (!done_) {
      const int seen = case_;
      if (!cv_.wait_for(lock, std::chrono::duration<double>(seconds), [&] { return done_ || case_ != seen; })) {
        std::fprintf(stderr, "tokenizer fuzz: case %d ran over %.0f s (a hang)\n", seen, seconds);
        std::fflush(stderr);
        std::_Exit(3);
      }
    }
  }) {}
  ~Watchdog() {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      done_ = true;
    }
    cv_.notify_all();
    thread_.join();
  }
  void next(int c) {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      case_ = c;
    }
    cv_.notify_all();
  }

 private:
  std::mutex mutex_;
  std::condition_variable cv_;
  int case_ = -1;
  bool done_ = false;
  std::thread thread_;
};

}  // namespace

TEST(TokenizerValidation, FuzzedTokenizersLoadAndWorkOrAreRefused) {
  const json base = small_tokenizer();
  std::mt19937 rng(20251130);
  int loaded = 0, refused = 0;
  const auto start = std::chrono::steady_clock::now();
  Watchdog watchdog(30.0);
  const int kMutations = 1500;
  for (int c = 0; c < kMutations; ++c) {
    watchdog.next(c);
    const std::string text = mutate(base, rng);
    try {
      const auto tok = md::Tokenizer::from_text(text, "fuzz.json");
      ++loaded;
      // A loaded tokenizer is a working one: exact round trips, plain and with the added
      // tokens matched (ASCII and NFC text, so a mutation to an NFC normalizer holds too).
      const std::string sample = "the word and <|endoftext|> other<|pad|> in caf\xc3\xa9 " + std::to_string(c);
      EXPECT_EQ(tok.decode(tok.encode(sample)), sample) << "case " << c << ": " << text.substr(0, 300);
      EXPECT_EQ(tok.decode(tok.encode_with_special(sample)), sample) << "case " << c << ": " << text.substr(0, 300);
    } catch (const mhar::Error& e) {
      ++refused;
      EXPECT_NE(std::string(e.what()).find("fuzz.json"), std::string::npos) << "case " << c << ": " << e.what();
    } catch (const std::exception& e) {
      ADD_FAILURE() << "case " << c << " threw a non-mhar exception: " << e.what() << "\n" << text.substr(0, 300);
    }
  }
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  std::printf("[ fuzz ] %d tokenizer.json mutations: %d loaded, %d refused, %.2f s\n", kMutations,
              loaded, refused, seconds);
  // Both outcomes are exercised, so the loop tests the validation and the working path.
  EXPECT_GT(loaded, 100);
  EXPECT_GT(refused, 500);
}
