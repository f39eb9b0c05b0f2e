// tokenizer_train_test.cpp: `train-tokenizer` produces a loadable byte-level BPE of the
// requested size, deterministic at any thread count, that compresses its training text
// and round-trips every byte string.
#include "data/bpe_trainer.h"
#include "tests/data_test_util.h"

namespace {

std::string sample_corpus() {
  std::string text;
  const char* lines[] = {"The quick brown fox jumps over the lazy dog. ",
                         "It's a truth universally acknowledged, that a single man in possession of a good fortune ",
                         "must be in want of a wife. 12345 + 67890 = 80235.\n",
                         "def tokenize(text):\n    return [t for t in text.split()]\n",
                         "Unicode: caf\xc3\xa9, na\xc3\xafve, \xe4\xb8\xad\xe6\x96\x87, \xf0\x9f\x98\x80!\n"};
  for (int i = 0; i < 400; ++i) text += lines[i % 5] + std::to_string(i) + "\n";
  return text;
}

}  // namespace

TEST(TokenizerTrain, TrainsLoadsAndIsDeterministic) {
  mhar::test::TempDir dir;
  mhar::test::write_bytes(dir / "corpus.txt", sample_corpus());
  mhar::data::TrainTokenizerOptions opt;
  opt.inputs = {dir / "corpus.txt"};
  opt.vocab_size = 400;
  opt.out = dir / "a.json";
  opt.threads = 1;
  const auto s1 = mhar::data::train_tokenizer(opt);
  opt.out = dir / "b.json";
  opt.threads = 2;
  mhar::data::train_tokenizer(opt);
  EXPECT_EQ(mhar::test::read_bytes(dir / "a.json"), mhar::test::read_bytes(dir / "b.json"));
  EXPECT_EQ(s1.vocab_size, 400);

  const auto tok = mhar::data::Tokenizer::load(dir / "a.json");
  EXPECT_EQ(tok.vocab_size(), 400);
  EXPECT_EQ(tok.eot_id(), 399);
  const std::string text = sample_corpus();
  const auto ids = tok.encode(text);
  EXPECT_EQ(tok.decode(ids), text);
  EXPECT_LT(ids.size() * 2, text.size()) << "a trained vocabulary compresses its own corpus";
  for (int b = 0; b < 256; ++b) {
    const std::string one(1, static_cast<char>(b));
    EXPECT_EQ(tok.decode(tok.encode(one)), one);
  }
}

TEST(TokenizerTrain, StopsEarlyWhenPairsRunOut) {
  mhar::test::TempDir dir;
  mhar::test::write_bytes(dir / "tiny.txt", "ab ab ab cd");
  mhar::data::TrainTokenizerOptions opt;
  opt.inputs = {dir / "tiny.txt"};
  opt.vocab_size = 5000;
  opt.out = dir / "t.json";
  const auto s = mhar::data::train_tokenizer(opt);
  EXPECT_LT(s.vocab_size, 300);
  const auto tok = mhar::data::Tokenizer::load(dir / "t.json");
  EXPECT_EQ(tok.vocab_size(), s.vocab_size);
  EXPECT_EQ(tok.encode(" ab").size(), 1u);
}

TEST(TokenizerTrain, RejectsBadOptions) {
  mhar::data::TrainTokenizerOptions opt;
  opt.inputs = {"/nonexistent/corpus"};
  opt.out = "/tmp/x.json";
  opt.vocab_size = 100;
  EXPECT_NE(mhar::test::error_of([&] { mhar::data::train_tokenizer(opt); }).find("--vocab 100"), std::string::npos);
  opt.vocab_size = 1000;
  EXPECT_NE(mhar::test::error_of([&] { mhar::data::train_tokenizer(opt); }).find("no such file"), std::string::npos);
}
