// shard_test.cpp: llm.c shard writing and reading: round trips in both widths, a shard
// written byte by byte from llm.c's documented format, and corrupt files (empty,
// truncated, wrong magic/version/count, out-of-range ids, random byte flips over many
// trials) that must all end in a clear mhar::Error, never a crash or a hang.
#include <cstring>
#include <random>

#include "data/loader.h"
#include "data/shard.h"
#include "tests/data_test_util.h"

using mhar::test::error_of;
using mhar::test::read_bytes;
using mhar::test::TempDir;
using mhar::test::write_bytes;
namespace md = mhar::data;

namespace {

std::string le32(int32_t v) {
  std::string s(4, '\0');
  std::memcpy(s.data(), &v, 4);
  return s;
}

std::vector<int32_t> sample_tokens(size_t n, int32_t vocab, uint32_t seed) {
  std::mt19937 rng(seed);
  std::vector<int32_t> t(n);
  for (auto& x : t) x = static_cast<int32_t>(rng() % vocab);
  return t;
}

}  // namespace

TEST(Shard, RoundTripUint16AndUint32) {
  TempDir dir;
  const auto small = sample_tokens(10000, 50257, 1);
  md::write_shard(dir / "a.bin", small, 2);
  EXPECT_EQ(md::read_shard(dir / "a.bin", 50257), small);
  const auto info = md::read_shard_header(dir / "a.bin");
  EXPECT_EQ(info.magic, 20240520);
  EXPECT_EQ(info.version, 1);
  EXPECT_EQ(info.tokens, 10000u);
  EXPECT_EQ(info.file_bytes, 1024u + 20000u);

  const auto big = sample_tokens(5000, 151669, 2);
  md::write_shard(dir / "b.bin", big, md::shard_token_bytes(151669));
  EXPECT_EQ(md::read_shard(dir / "b.bin", 151669), big);
  EXPECT_EQ(md::read_shard_header(dir / "b.bin").magic, 20240801);
  EXPECT_EQ(md::read_shard_header(dir / "b.bin").version, 7);

  md::write_shard(dir / "empty.bin", std::vector<int32_t>{}, 2);
  EXPECT_TRUE(md::read_shard(dir / "empty.bin").empty());
  EXPECT_EQ(md::shard_token_bytes(65536), 2);
  EXPECT_EQ(md::shard_token_bytes(65537), 4);
}

TEST(Shard, WritesNothingPartialAndRejectsIdsThatDoNotFit) {
  TempDir dir;
  const std::string e = error_of([&] { md::write_shard(dir / "x.bin", std::vector<int32_t>{1, 70000}, 2); });
  EXPECT_NE(e.find("token 1 has id 70000"), std::string::npos) << e;
  EXPECT_FALSE(std::filesystem::exists(dir / "x.bin"));
  for (const auto& entry : std::filesystem::directory_iterator(dir.str()))
    ADD_FAILURE() << "left behind: " << entry.path();
}

TEST(Shard, ReadsAShardWrittenByteByByteInLlmcFormat) {
  // llm.c dev/data/data_common.py: header = np.zeros(256, int32); header[0] = 20240520;
  // header[1] = 1; header[2] = len(toks); then the tokens as little-endian uint16.
  TempDir dir;
  std::string bytes = le32(20240520) + le32(1) + le32(5);
  bytes += std::string(253 * 4, '\0');
  for (uint16_t t : {50256, 15496, 995, 0, 65535}) {
    bytes.push_back(static_cast<char>(t & 0xFF));
    bytes.push_back(static_cast<char>(t >> 8));
  }
  write_bytes(dir / "llmc.bin", bytes);
  EXPECT_EQ(md::read_shard(dir / "llmc.bin"), (std::vector<int32_t>{50256, 15496, 995, 0, 65535}));
  // Our writer produces exactly those bytes.
  md::write_shard(dir / "ours.bin", std::vector<int32_t>{50256, 15496, 995, 0, 65535}, 2);
  EXPECT_EQ(read_bytes(dir / "ours.bin"), bytes);

  // Version 7: uint32 tokens (llm.c's Llama 3 shards).
  std::string v7 = le32(20240801) + le32(7) + le32(2) + std::string(253 * 4, '\0') + le32(128000) + le32(9906);
  write_bytes(dir / "v7.bin", v7);
  EXPECT_EQ(md::read_shard(dir / "v7.bin"), (std::vector<int32_t>{128000, 9906}));
}

TEST(Shard, CorruptFilesGiveClearErrors) {
  TempDir dir;
  md::write_shard(dir / "good.bin", sample_tokens(100, 1000, 3), 2);
  const std::string good = read_bytes(dir / "good.bin");
  auto error_for = [&](const std::string& bytes, int vocab = 1000) {
    write_bytes(dir / "bad.bin", bytes);
    return error_of([&] { md::read_shard(dir / "bad.bin", vocab); });
  };
  auto expect_contains = [](const std::string& e, const std::string& what) {
    EXPECT_NE(e.find(what), std::string::npos) << "error: '" << e << "' should mention '" << what << "'";
    EXPECT_NE(e.find("bad.bin"), std::string::npos) << "error names the file: " << e;
  };
  expect_contains(error_for(""), "empty file");
  expect_contains(error_for(good.substr(0, 100)), "shorter than the 1024-byte shard header");
  expect_contains(error_for(good.substr(0, good.size() - 1)), "truncated");
  expect_contains(error_for(good + "xx"), "trailing data");
  std::string wrong_magic = good;
  wrong_magic[0] ^= 1;
  expect_contains(error_for(wrong_magic), "magic");
  std::string wrong_version = good;
  wrong_version[4] = 7;
  expect_contains(error_for(wrong_version), "version 7");
  std::string wrong_count = good;
  wrong_count[8] = 99;
  expect_contains(error_for(wrong_count), "header says 99 tokens");
  std::string negative = good;
  negative[11] = static_cast<char>(0x80);
  expect_contains(error_for(negative), "negative token count");
  std::string bad_id = good;
  bad_id[1024 + 2 * 42] = static_cast<char>(0xFF);
  bad_id[1024 + 2 * 42 + 1] = static_cast<char>(0xFF);
  expect_contains(error_for(bad_id), "token 42 has id 65535");
  write_bytes(dir / "bad.bin", good);
  EXPECT_EQ(error_of([&] { md::read_shard(dir / "bad.bin", 1000); }), "");
  std::filesystem::create_directory(dir / "folder.bin");
  EXPECT_NE(error_of([&] { md::read_shard(dir / "folder.bin"); }).find("is a directory, but a shard must be a regular file"),
            std::string::npos);
  EXPECT_NE(error_of([&] { md::read_shard(dir / "missing.bin"); }).find("cannot open"), std::string::npos);
}

TEST(Shard, RandomByteFlipsNeverCrashOrHang) {
  TempDir dir;
  const int vocab = 1000;
  md::write_shard(dir / "good.bin", sample_tokens(3000, vocab, 4), 2);
  const std::string good = read_bytes(dir / "good.bin");
  std::mt19937 rng(5);
  int errors = 0, loaded = 0;
  for (int trial = 0; trial < 2000; ++trial) {
    std::string bytes = good;
    const int flips = 1 + rng() % 8;
    for (int f = 0; f < flips; ++f) {
      // Half the flips hit the 12 meaningful header bytes, the rest anywhere.
      const size_t at = rng() % 2 ? rng() % 12 : rng() % bytes.size();
      bytes[at] = static_cast<char>(bytes[at] ^ (1 << (rng() % 8)));
    }
    if (rng() % 4 == 0) bytes.resize(rng() % bytes.size());
    write_bytes(dir / "flip.bin", bytes);
    try {
      md::DataLoader loader(dir / "flip.bin", 2, 16, 1, 0, 1, vocab);
      std::vector<int32_t> in(32), out(32);
      loader.next_batch(in.data(), out.data());
      for (int32_t t : in) ASSERT_TRUE(t >= 0 && t < vocab);
      ++loaded;
    } catch (const mhar::Error& e) {
      ASSERT_NE(std::string(e.what()).find("flip.bin"), std::string::npos) << e.what();
      ++errors;
    }
  }
  std::printf("  2000 corrupted shards: %d clear errors, %d still valid (flips in unused header ints or ids)\n",
              errors, loaded);
  EXPECT_GT(errors, 1000);
}
