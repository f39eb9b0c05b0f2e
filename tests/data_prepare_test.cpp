// data_prepare_test.cpp: `mhar data prepare` end to end through the real binary:
// documents become <|endoftext|>-separated tokens, whole documents are held out for
// validation, shards are cut at exactly --shard-tokens, output is byte-identical for
// any thread count, and `mhar data inspect` reads the result. Bad options and paths
// (thread counts, validation sizes, FIFOs, folders where files belong, an unreadable
// sub-folder, a broken tokenizer) exit 1 with a message naming them, in under 5 s.
#include <grp.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>

#include "data/corpus.h"
#include "data/shard.h"
#include "tests/data_test_util.h"
#include "tests/process_test_util.h"
#include "tests/wall_clock.h"

using mhar::test::read_bytes;
using mhar::test::TempDir;
using mhar::test::write_bytes;
namespace md = mhar::data;

namespace {

// `mhar ARGS`, stdout and stderr together.
std::string run(const std::string& args, int* status = nullptr) {
  const auto r = mhar::test::run_command(std::string(MHAR_BINARY) + " " + args + " 2>&1");
  if (status) *status = r.rc;
  return r.out;
}

std::string trained_tokenizer() { return mhar::test::fixture_dir() + "/trained_4096.json"; }

void make_corpus(const TempDir& dir) {
  std::string jsonl;
  for (int i = 0; i < 40; ++i) {
    nlohmann::json doc = {{"id", "doc" + std::to_string(i)}, {"text", ""}};
    std::string text;
    for (int k = 0; k <= i % 7; ++k)
      text += "Document " + std::to_string(i) + " paragraph " + std::to_string(k) +
              ": the quick brown fox jumps over the lazy dog, caf\xc3\xa9 \xe4\xb8\xad\xe6\x96\x87.\n";
    doc["text"] = text;
    jsonl += doc.dump() + "\n";
  }
  std::filesystem::create_directories(dir / "corpus/sub");
  write_bytes(dir / "corpus/a.jsonl", jsonl);
  write_bytes(dir / "corpus/sub/b.txt", "A plain text file is one document.\n");
}

std::vector<std::string> files_in(const std::string& dir) {
  std::vector<std::string> out;
  for (const auto& e : std::filesystem::directory_iterator(dir)) out.push_back(e.path().filename().string());
  std::sort(out.begin(), out.end());
  return out;
}

}  // namespace

TEST(DataPrepare, ShardsDocumentsValidationAndDeterminism) {
  TempDir dir;
  make_corpus(dir);
  const std::string common = "data prepare --tokenizer " + trained_tokenizer() + " --input " + (dir / "corpus") +
                             " --val-docs 3 --shard-tokens 500 --no-progress";
  int status = 0;
  const std::string out1 = run(common + " --threads 1 --out " + (dir / "out1"), &status);
  ASSERT_EQ(status, 0) << out1;
  EXPECT_NE(out1.find("documents      41 (train 38, val 3)"), std::string::npos) << out1;
  run(common + " --threads 2 --out " + (dir / "out2"), &status);
  ASSERT_EQ(status, 0);
  const auto names = files_in(dir / "out1");
  EXPECT_EQ(names, files_in(dir / "out2"));
  for (const auto& n : names) EXPECT_EQ(read_bytes(dir / ("out1/" + n)), read_bytes(dir / ("out2/" + n))) << n;

  // Token stream = for each document in input order: eot, encode(text).
  const auto tok = md::Tokenizer::load(trained_tokenizer());
  std::vector<int32_t> expected_train, expected_val;
  md::DocumentReader reader({dir / "corpus"});
  md::Document d;
  for (uint64_t i = 0; reader.next(d); ++i) {
    const bool val = (i + 1) * 3 / 41 > i * 3 / 41;
    auto& target = val ? expected_val : expected_train;
    target.push_back(tok.eot_id());
    const auto ids = tok.encode(d.text);
    target.insert(target.end(), ids.begin(), ids.end());
  }
  std::vector<int32_t> train, val;
  std::vector<size_t> train_sizes;
  for (const auto& n : names) {
    if (n.size() < 4 || n.substr(n.size() - 4) != ".bin") continue;
    const auto t = md::read_shard(dir / ("out1/" + n), tok.vocab_size());
    const bool is_train = n.rfind("train_", 0) == 0;
    auto& target = is_train ? train : val;
    target.insert(target.end(), t.begin(), t.end());
    if (is_train) train_sizes.push_back(t.size());
  }
  ASSERT_GE(train_sizes.size(), 2u);
  for (size_t i = 0; i + 1 < train_sizes.size(); ++i) EXPECT_EQ(train_sizes[i], 500u) << "cut at --shard-tokens";
  EXPECT_LE(train_sizes.back(), 500u);
  EXPECT_EQ(train, expected_train);
  EXPECT_EQ(val, expected_val);
  EXPECT_GT(train.size(), 1000u);

  const auto meta = nlohmann::json::parse(read_bytes(dir / "out1/prepare.json"));
  EXPECT_EQ(meta["val_document_ids"].size(), 3u);
  EXPECT_EQ(meta["tokens"]["train"].get<size_t>(), train.size());

  const std::string inspect = run("data inspect " + (dir / "out1/train_000000.bin"), &status);
  EXPECT_EQ(status, 0) << inspect;
  EXPECT_NE(inspect.find("magic 20240520, version 1 (uint16 tokens), 500 tokens"), std::string::npos) << inspect;
  EXPECT_NE(inspect.find("Document 0 paragraph 0"), std::string::npos) << inspect;
}

TEST(DataPrepare, Uint32ShardsForLargeVocabularies) {
  MHAR_LOAD_TOKENIZER_OR_SKIP(qwen, "qwen3");
  TempDir dir;
  make_corpus(dir);
  int status = 0;
  const std::string out = run("data prepare --tokenizer qwen3 --input " + (dir / "corpus/a.jsonl") +
                                  " --val-fraction 0.1 --no-progress --out " + (dir / "q"),
                              &status);
  ASSERT_EQ(status, 0) << out;
  const auto info = md::read_shard_header(dir / "q/train_000000.bin");
  EXPECT_EQ(info.magic, 20240801);
  EXPECT_EQ(info.version, 7);
  const auto tokens = md::read_shard(dir / "q/train_000000.bin", qwen.vocab_size());
  EXPECT_EQ(tokens.front(), qwen.eot_id());
}

TEST(DataPrepare, ClearErrors) {
  TempDir dir;
  int status = 0;
  std::string out = run("data prepare --tokenizer " + trained_tokenizer() + " --input " + (dir / "missing") +
                            " --out " + (dir / "o"),
                        &status);
  EXPECT_EQ(status, 1);
  EXPECT_NE(out.find("missing: no such file or folder"), std::string::npos) << out;
  write_bytes(dir / "bad.jsonl", "{\"text\": \"ok\"}\n{\"txt\": 1}\n");
  out = run("data prepare --tokenizer " + trained_tokenizer() + " --input " + (dir / "bad.jsonl") + " --out " +
                (dir / "o") + " --val-docs 0 --no-progress",
            &status);
  EXPECT_EQ(status, 1);
  EXPECT_NE(out.find("bad.jsonl:2"), std::string::npos) << out;
  out = run("data inspect " + (dir / "bad.jsonl"), &status);
  EXPECT_EQ(status, 1);
  EXPECT_NE(out.find("bad.jsonl"), std::string::npos) << out;
}

namespace {

// run() with its wall time.
std::string timed_run(const std::string& args, int* status, double* seconds) {
  const auto t0 = std::chrono::steady_clock::now();
  std::string out = run(args, status);
  *seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return out;
}

// Exit code 1, the message, in under 5 seconds.
void expect_refused(const std::string& args, std::initializer_list<std::string> parts) {
  int status = 0;
  double seconds = 0;
  const std::string out = timed_run(args, &status, &seconds);
  EXPECT_EQ(status, 1) << args << "\n" << out;
  EXPECT_LT(seconds, mhar::test::wall_clock_bound(5.0)) << args;
  for (const auto& p : parts) EXPECT_NE(out.find(p), std::string::npos) << "'" << p << "' missing:\n" << out;
  EXPECT_EQ(out.find("internal error"), std::string::npos) << out;
}

}  // namespace

TEST(DataPrepare, OutOfRangeOptionsAreRefused) {
  TempDir dir;
  make_corpus(dir);
  const std::string prep = "data prepare --tokenizer " + trained_tokenizer() + " --input " + (dir / "corpus") +
                           " --no-progress --out " + (dir / "o");
  const std::string range = "is out of range; valid: 0 (all cores) or 1 to 256";
  expect_refused(prep + " --threads 100000", {"data prepare: --threads 100000 " + range});
  expect_refused(prep + " --threads -3", {"--threads -3 " + range});
  expect_refused("data train-tokenizer --vocab 300 --input " + (dir / "corpus") + " --out " + (dir / "t.json") +
                     " --threads 100000",
                 {"data train-tokenizer: --threads 100000 " + range});
  expect_refused("data bench-tokenizer --tokenizer " + trained_tokenizer() + " --input " + (dir / "corpus") +
                     " --threads 1 100000",
                 {"data bench-tokenizer: --threads 100000 " + range});
  // Given values that prepare() would read as "not given" (and silently hold out 1%).
  expect_refused(prep + " --val-docs -5", {"--val-docs -5 is negative"});
  for (const char* f : {"nan", "inf", "-0.5", "1.5"})
    expect_refused(prep + " --val-fraction " + f, {std::string("--val-fraction ") + f + " is not a number within 0..1"});
  EXPECT_FALSE(std::filesystem::exists(dir / "o/prepare.json"));
}

TEST(DataPrepare, PathsOfTheWrongKindAreNamed) {
  TempDir dir;
  make_corpus(dir);
  ASSERT_EQ(::mkfifo((dir / "fifo").c_str(), 0644), 0);
  write_bytes(dir / "file", "x");
  const std::string tok = " --tokenizer " + trained_tokenizer();
  // --out at an existing file, or a folder where a file is written.
  expect_refused("data prepare" + tok + " --input " + (dir / "corpus") + " --no-progress --out " + (dir / "file"),
                 {"--out " + (dir / "file") + " exists and is not a folder"});
  expect_refused("data train-tokenizer --vocab 300 --input " + (dir / "corpus") + " --out " + (dir / "corpus"),
                 {"--out " + (dir / "corpus") + " is a folder"});
  // A FIFO given as input, shard, or text: refused at once, never waited on.
  expect_refused("data prepare" + tok + " --input " + (dir / "fifo") + " --no-progress --out " + (dir / "o"),
                 {(dir / "fifo") + ": is a FIFO"});
  expect_refused("data inspect " + (dir / "fifo"), {(dir / "fifo") + ": is a FIFO"});
  expect_refused("data encode" + tok + " --file " + (dir / "fifo"), {(dir / "fifo") + ": is a FIFO"});
  expect_refused("data encode --tokenizer " + (dir / "fifo"), {(dir / "fifo") + ": is a FIFO"});
  // A folder where a file is expected.
  expect_refused("data inspect " + (dir / "corpus"), {(dir / "corpus") + ": is a directory, but a shard must be"});
  expect_refused("data encode" + tok + " --file " + (dir / "corpus"), {(dir / "corpus") + ": is a directory"});
  expect_refused("data encode --text hi --tokenizer " + (dir / "corpus"), {(dir / "corpus/tokenizer.json")});
  // A damaged prepare.json beside a shard is an error, not a silent decode with gpt2.
  int status = 0;
  run("data prepare" + tok + " --input " + (dir / "corpus") + " --val-docs 1 --no-progress --out " + (dir / "s"),
      &status);
  ASSERT_EQ(status, 0);
  write_bytes(dir / "s/prepare.json", "");
  expect_refused("data inspect " + (dir / "s/train_000000.bin"), {"prepare.json", "give --tokenizer"});
  run("data inspect " + (dir / "s/train_000000.bin") + tok, &status);
  EXPECT_EQ(status, 0);
}

TEST(DataPrepare, ABadTokenizerFileIsRefusedNotLoopedOn) {
  TempDir dir;
  auto j = nlohmann::json::parse(read_bytes(trained_tokenizer()));
  j["added_tokens"][0]["content"] = "";  // made `encode --special` loop with memory growing
  write_bytes(dir / "empty.json", j.dump());
  expect_refused("data encode --special --text hello --tokenizer " + (dir / "empty.json"),
                 {(dir / "empty.json") + ": added_tokens[0].content"});
  j = nlohmann::json::parse(read_bytes(trained_tokenizer()));
  j["added_tokens"][0]["id"] = -5;  // was "double free or corruption"
  write_bytes(dir / "neg.json", j.dump());
  expect_refused("data encode --text hello --tokenizer " + (dir / "neg.json"),
                 {(dir / "neg.json") + ": added_tokens[0].id = -5 is out of range"});
}

// A corpus folder with a sub-folder that cannot be read: `prepare` must not make shards of
// the rest without a word. Root reads any folder, so as root the command runs as nobody.
TEST(DataPrepare, AnUnreadableSubFolderIsAnError) {
  TempDir dir;
  make_corpus(dir);
  std::filesystem::create_directories(dir / "corpus/locked");
  write_bytes(dir / "corpus/locked/c.jsonl", "{\"text\": \"held back\"}\n");
  ::chmod((dir / "corpus/locked").c_str(), 0);
  ::chmod(dir.str().c_str(), 0777);  // the output folder is made by whoever runs it
  const std::string in = dir / "corpus", out_dir = dir / "o", tok = trained_tokenizer();
  int fds[2];
  ASSERT_EQ(::pipe(fds), 0);
  const pid_t pid = ::fork();
  ASSERT_GE(pid, 0);
  if (pid == 0) {
    ::dup2(fds[1], 1);
    ::dup2(fds[1], 2);
    ::close(fds[0]);
    if (::geteuid() == 0 && (::setgroups(0, nullptr) != 0 || ::setgid(65534) != 0 || ::setuid(65534) != 0)) {
      std::perror("cannot become nobody");
      ::_exit(99);
    }
    ::execl(MHAR_BINARY, MHAR_BINARY, "data", "prepare", "--tokenizer", tok.c_str(), "--input", in.c_str(),
            "--no-progress", "--out", out_dir.c_str(), static_cast<char*>(nullptr));
    ::_exit(98);
  }
  ::close(fds[1]);
  std::string out;
  char buf[4096];
  for (ssize_t n; (n = ::read(fds[0], buf, sizeof buf)) > 0;) out.append(buf, static_cast<size_t>(n));
  ::close(fds[0]);
  int wstatus = 0;
  ::waitpid(pid, &wstatus, 0);
  ::chmod((dir / "corpus/locked").c_str(), 0755);
  ASSERT_TRUE(WIFEXITED(wstatus)) << out;
  EXPECT_EQ(WEXITSTATUS(wstatus), 1) << out;
  EXPECT_NE(out.find((dir / "corpus/locked") + ": cannot read the folder (Permission denied)"), std::string::npos)
      << out;
  EXPECT_FALSE(std::filesystem::exists(dir / "o/train_000000.bin")) << "no shards of a partial corpus";
}
