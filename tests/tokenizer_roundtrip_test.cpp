// tokenizer_roundtrip_test.cpp: decode(encode(s)) == s for every byte string (GPT-2,
// a trained tokenizer; Qwen3 for NFC text, since its NFC normalizer is part of the
// model), batch encoding equal to single encoding, the pre-tokenizer rules on known
// cases, and tokenizer.json validation errors.
#include <random>

#include "data/unicode.h"
#include "tests/data_test_util.h"

namespace {

using mhar::data::Tokenizer;

std::vector<std::string> random_byte_strings(int count, uint32_t seed) {
  std::mt19937 rng(seed);
  std::vector<std::string> out;
  const std::vector<std::string> pieces = {"a", " ", "the", "\n", "\xc3\xa9", "\xe4\xb8\xad", "'s", "1",
                                           "\xf0\x9f\x98\x80", "\t", "  ", "\xcc\x81", "<|endoftext|>"};
  for (int i = 0; i < count; ++i) {
    std::string s;
    const int len = rng() % 40;
    for (int k = 0; k < len; ++k) {
      if (rng() % 3 == 0)
        s.push_back(static_cast<char>(rng() & 0xFF));
      else
        s += pieces[rng() % pieces.size()];
    }
    out.push_back(s);
  }
  return out;
}

void expect_round_trip(const Tokenizer& tok, const std::vector<std::string>& texts, bool nfc_only) {
  int checked = 0;
  for (const auto& s : texts) {
    if (nfc_only && mhar::data::nfc(s) != s) continue;
    ++checked;
    ASSERT_EQ(tok.decode(tok.encode(s)), s) << tok.origin() << " on a string of " << s.size() << " bytes";
  }
  EXPECT_GT(checked, 1000);
}

std::vector<std::string> all_test_strings(int random_count) {
  std::vector<std::string> texts = random_byte_strings(random_count, 7);
  for (const auto& s : mhar::test::load_test_strings()) texts.push_back(s.bytes);
  // Every single byte and every pair of bytes from a mixed set.
  for (int b = 0; b < 256; ++b) texts.push_back(std::string(1, static_cast<char>(b)));
  return texts;
}

}  // namespace

TEST(TokenizerRoundTrip, Gpt2EveryByteString) {
  MHAR_LOAD_TOKENIZER_OR_SKIP(tok, "gpt2");
  expect_round_trip(tok, all_test_strings(20000), false);
}

TEST(TokenizerRoundTrip, TrainedEveryByteString) {
  const Tokenizer tok = Tokenizer::load(mhar::test::fixture_dir() + "/trained_4096.json");
  expect_round_trip(tok, all_test_strings(20000), false);
}

TEST(TokenizerRoundTrip, Qwen3EveryNfcByteString) {
  MHAR_LOAD_TOKENIZER_OR_SKIP(tok, "qwen3");
  expect_round_trip(tok, all_test_strings(20000), true);
}

TEST(TokenizerRoundTrip, BatchEqualsSingleAtAnyThreadCount) {
  MHAR_LOAD_TOKENIZER_OR_SKIP(tok, "gpt2");
  const auto texts = random_byte_strings(500, 11);
  std::vector<std::vector<int32_t>> single;
  for (const auto& t : texts) single.push_back(tok.encode(t));
  for (int threads : {1, 2, 3, 8}) EXPECT_EQ(tok.encode_batch(texts, threads), single) << threads << " threads";
}

TEST(TokenizerRoundTrip, LongPieceMergeOrderEqualsShortPieceMergeOrder) {
  // Pieces above 256 bytes take the heap algorithm; both must merge identically (the
  // conformance fixtures pin down the scan used for ordinary pieces).
  MHAR_LOAD_TOKENIZER_OR_SKIP(gpt2, "gpt2");
  MHAR_LOAD_TOKENIZER_OR_SKIP(qwen, "qwen3");
  std::mt19937 rng(3);
  const std::vector<std::string> alphabets = {"etaoin shrdlu", "ab", "=-+*/", "0123456789", " \n\t",
                                              "\xe4\xb8\xad\xe6\x96\x87\xe5\xad\x97"};
  for (int trial = 0; trial < 300; ++trial) {
    const std::string& alphabet = alphabets[trial % alphabets.size()];
    std::string piece;
    const size_t len = 1 + rng() % 1200;
    while (piece.size() < len) piece += alphabet[rng() % alphabet.size()];
    for (const Tokenizer* tok : {&gpt2, &qwen}) {
      const auto scan = tok->bpe_piece_for_test(piece, false);
      ASSERT_EQ(tok->bpe_piece_for_test(piece, true), scan) << "trial " << trial << ", " << piece.size() << " bytes";
      EXPECT_EQ(tok->decode(scan), piece);
    }
  }
  std::string long_run(5000, '=');
  EXPECT_EQ(gpt2.decode(gpt2.encode(long_run)), long_run);
  EXPECT_LT(gpt2.encode(long_run).size(), 1000u);
}

TEST(TokenizerRoundTrip, PreTokenizerRules) {
  MHAR_LOAD_TOKENIZER_OR_SKIP(gpt2, "gpt2");
  using V = std::vector<std::string>;
  EXPECT_EQ(gpt2.pretokenize("Hello world's  end\n\n"), (V{"Hello", " world", "'s", " ", " end", "\n\n"}));
  EXPECT_EQ(gpt2.pretokenize("a   b"), (V{"a", "  ", " b"}));
  EXPECT_EQ(gpt2.pretokenize(" 123abc!!"), (V{" 123", "abc", "!!"}));
  MHAR_LOAD_TOKENIZER_OR_SKIP(qwen, "qwen3");
  EXPECT_EQ(qwen.pretokenize("Hello world's 123\n\n  x"),
            (V{"Hello", " world", "'s", " ", "1", "2", "3", "\n\n", " ", " x"}));
  EXPECT_EQ(qwen.pretokenize("(abc) I'M"), (V{"(abc", ")", " I", "'M"}));
  EXPECT_EQ(qwen.pretokenize("e\xcc\x81"), (V{"\xc3\xa9"}));  // NFC first
}

TEST(TokenizerRoundTrip, InvalidTokenizerFilesGiveClearErrors) {
  mhar::test::TempDir dir;
  auto load_error = [&](const std::string& text) {
    mhar::test::write_bytes(dir / "tokenizer.json", text);
    return mhar::test::error_of([&] { Tokenizer::load(dir / "tokenizer.json"); });
  };
  EXPECT_NE(load_error("{not json").find("not valid JSON"), std::string::npos);
  EXPECT_NE(load_error(R"({"model": {"type": "WordPiece", "vocab": {}}})").find("WordPiece"), std::string::npos);
  const std::string e = load_error(
      R"({"pre_tokenizer": {"type": "Whitespace"}, "model": {"type": "BPE", "vocab": {"a": 0}, "merges": []}})");
  EXPECT_NE(e.find("unsupported pre_tokenizer"), std::string::npos) << e;
  EXPECT_NE(mhar::test::error_of([] { Tokenizer::load("/nonexistent/tokenizer.json"); }).find("no such file"),
            std::string::npos);
}
