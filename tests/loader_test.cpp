// loader_test.cpp: the data loader: windows are real T+1 token spans with targets
// shifted by one, batches are deterministic from the seed, epochs reshuffle, ranks get
// disjoint windows, state()/restore() resumes exactly (also across epochs), the
// sequential evaluation mode streams across shards, and misuse gives clear errors.
#include <chrono>
#include <set>
#include <thread>

#include "data/loader.h"
#include "data/shard.h"
#include "tests/data_test_util.h"

using mhar::test::error_of;
using mhar::test::TempDir;
namespace md = mhar::data;

namespace {

constexpr int kVocab = 200000;

// Shard s holds tokens s*10000 + i, so every token says where it came from.
std::vector<std::string> make_shards(const TempDir& dir, const std::vector<int>& sizes) {
  std::vector<std::string> paths;
  for (size_t s = 0; s < sizes.size(); ++s) {
    std::vector<int32_t> t(sizes[s]);
    for (int i = 0; i < sizes[s]; ++i) t[i] = static_cast<int32_t>(s * 10000 + i);
    char name[32];
    std::snprintf(name, sizeof(name), "train_%03zu.bin", s);
    paths.push_back(dir / name);
    md::write_shard(paths.back(), t, 4);
  }
  return paths;
}

struct Batch {
  std::vector<int32_t> in, out;
  bool operator==(const Batch& o) const { return in == o.in && out == o.out; }
};

Batch next(md::DataLoader& l, int B, int T) {
  Batch b{std::vector<int32_t>(B * T), std::vector<int32_t>(B * T)};
  l.next_batch(b.in.data(), b.out.data());
  return b;
}

}  // namespace

TEST(Loader, WindowsAreShiftedSpansOfOneShard) {
  TempDir dir;
  make_shards(dir, {1000, 537, 2048});
  const int B = 4, T = 16;
  md::DataLoader l(dir / "train_*.bin", B, T, 42, 0, 1, kVocab);
  for (int step = 0; step < 50; ++step) {
    const Batch b = next(l, B, T);
    for (int r = 0; r < B; ++r) {
      const int32_t first = b.in[r * T];
      EXPECT_EQ((first % 10000) % T, 0) << "window starts at a multiple of T";
      for (int t = 0; t < T; ++t) {
        EXPECT_EQ(b.in[r * T + t], first + t);
        EXPECT_EQ(b.out[r * T + t], first + t + 1);
      }
    }
  }
}

TEST(Loader, OneEpochVisitsDistinctWindowsAndEpochsReshuffle) {
  TempDir dir;
  make_shards(dir, {1000, 537, 2048});
  const int B = 3, T = 16;
  md::DataLoader l(dir / "train_*.bin", B, T, 7, 0, 1, kVocab);
  const uint64_t windows = (999 / 16) + (536 / 16) + (2047 / 16);
  EXPECT_EQ(l.total_windows(), windows);
  EXPECT_EQ(l.num_batches(), windows / B);
  std::vector<int32_t> epoch0, epoch1;
  std::set<int32_t> seen;
  for (uint64_t s = 0; s < l.num_batches(); ++s) {
    const Batch b = next(l, B, T);
    for (int r = 0; r < B; ++r) {
      EXPECT_TRUE(seen.insert(b.in[r * T]).second) << "window repeated within an epoch";
      epoch0.push_back(b.in[r * T]);
    }
  }
  for (uint64_t s = 0; s < l.num_batches(); ++s) {
    const Batch b = next(l, B, T);
    for (int r = 0; r < B; ++r) epoch1.push_back(b.in[r * T]);
  }
  EXPECT_EQ(l.epoch(), 2u);
  l.reset();
  EXPECT_EQ(next(l, B, T).in[0], epoch0[0]) << "reset goes back to the first batch";
  EXPECT_NE(epoch0, epoch1) << "a new epoch has a new order";
  // Shuffled: not simply in file order.
  EXPECT_FALSE(std::is_sorted(epoch0.begin(), epoch0.end()));
}

TEST(Loader, SameSeedSameBatchesOtherSeedOtherBatches) {
  TempDir dir;
  make_shards(dir, {3000, 3000});
  md::DataLoader a(dir / "train_*.bin", 4, 32, 1234, 0, 1, kVocab);
  md::DataLoader b(dir / "train_*.bin", 4, 32, 1234, 0, 1, kVocab);
  md::DataLoader c(dir / "train_*.bin", 4, 32, 999, 0, 1, kVocab);
  bool any_difference = false;
  for (int i = 0; i < 100; ++i) {
    const Batch x = next(a, 4, 32), y = next(b, 4, 32), z = next(c, 4, 32);
    ASSERT_EQ(x, y) << "batch " << i;
    any_difference |= !(x == z);
  }
  EXPECT_TRUE(any_difference);
}

TEST(Loader, RanksGetDisjointWindows) {
  TempDir dir;
  make_shards(dir, {5000, 3001, 4100});
  const int B = 2, T = 8, W = 3;
  std::vector<std::unique_ptr<md::DataLoader>> ranks;
  for (int r = 0; r < W; ++r) ranks.push_back(std::make_unique<md::DataLoader>(dir / "*.bin", B, T, 5, r, W, kVocab));
  const uint64_t steps = ranks[0]->num_batches();
  EXPECT_EQ(steps, ranks[0]->total_windows() / (B * W));
  std::set<int32_t> seen;
  for (uint64_t s = 0; s < steps; ++s)
    for (int r = 0; r < W; ++r) {
      const Batch b = next(*ranks[r], B, T);
      for (int i = 0; i < B; ++i) EXPECT_TRUE(seen.insert(b.in[i * T]).second) << "rank " << r << " step " << s;
    }
  EXPECT_EQ(seen.size(), steps * B * W);
}

TEST(Loader, ResumeFromStateIsExact) {
  TempDir dir;
  make_shards(dir, {2000, 1500, 999});
  const int B = 4, T = 16;
  md::DataLoader full(dir / "*.bin", B, T, 77, 1, 2, kVocab);
  std::vector<Batch> reference;
  const int total = static_cast<int>(full.num_batches() * 2 + 5);  // crosses two epoch boundaries
  std::vector<nlohmann::json> states;
  for (int i = 0; i < total; ++i) {
    states.push_back(full.state());
    reference.push_back(next(full, B, T));
  }
  EXPECT_LT(states[10].dump().size(), 300u) << "the state is small: " << states[10].dump();
  for (int k : {0, 1, 7, static_cast<int>(full.num_batches()) - 1, static_cast<int>(full.num_batches()) + 3}) {
    // Through JSON text, as a checkpoint would store it.
    const auto saved = nlohmann::json::parse(states[k].dump());
    md::DataLoader resumed(dir / "*.bin", B, T, 77, 1, 2, kVocab);
    next(resumed, B, T);  // it already moved on; restore must rewind its prefetch too
    resumed.restore(saved);
    for (int i = k; i < total; ++i) ASSERT_EQ(next(resumed, B, T), reference[i]) << "resumed at " << k << ", batch " << i;
  }
}

TEST(Loader, RestoreRefusesAStateOfOtherDataOrShape) {
  TempDir dir;
  make_shards(dir, {2000, 1500});
  md::DataLoader a(dir / "*.bin", 4, 16, 1, 0, 1, kVocab);
  md::DataLoader b(dir / "*.bin", 2, 16, 1, 0, 1, kVocab);
  const std::string e = error_of([&] { b.restore(a.state()); });
  EXPECT_NE(e.find("B = 4"), std::string::npos) << e;
  auto s = a.state();
  s["step"] = 1u << 30;
  EXPECT_NE(error_of([&] { a.restore(s); }).find("step"), std::string::npos);
  s = a.state();
  s["fingerprint"] = "0000000000000000";
  EXPECT_NE(error_of([&] { a.restore(s); }).find("fingerprint"), std::string::npos);
}

TEST(Loader, SequentialModeStreamsAcrossShards) {
  TempDir dir;
  make_shards(dir, {100, 50, 70});  // stream of 220 tokens
  const int B = 2, T = 10;
  md::DataLoader l(dir / "*.bin", B, T, 0, 0, 1, kVocab, md::LoaderMode::Sequential);
  EXPECT_EQ(l.total_windows(), 21u);  // (220 - 1) / 10
  EXPECT_EQ(l.num_batches(), 10u);
  std::vector<int32_t> stream;
  for (int s = 0; s < 3; ++s)
    for (int i = 0; i < std::vector<int>{100, 50, 70}[s]; ++i) stream.push_back(s * 10000 + i);
  for (uint64_t g = 0; g < l.num_batches(); ++g) {
    const Batch b = next(l, B, T);
    for (int r = 0; r < B; ++r)
      for (int t = 0; t < T; ++t) {
        const size_t k = (g * B + r) * T + t;
        ASSERT_EQ(b.in[r * T + t], stream[k]);
        ASSERT_EQ(b.out[r * T + t], stream[k + 1]);
      }
  }
  EXPECT_EQ(next(l, B, T).in[0], stream[0]) << "starts over after the last full batch";
  // Two ranks split the batches between them.
  md::DataLoader r1(dir / "*.bin", B, T, 0, 1, 2, kVocab, md::LoaderMode::Sequential);
  EXPECT_EQ(r1.num_batches(), 5u);
  EXPECT_EQ(next(r1, B, T).in[0], stream[1 * B * T]);
  EXPECT_EQ(next(r1, B, T).in[0], stream[3 * B * T]);
}

TEST(Loader, ClearErrors) {
  TempDir dir;
  make_shards(dir, {40});
  std::string e = error_of([&] { md::DataLoader(dir / "*.bin", 4, 16, 0, 0, 1, kVocab); });
  EXPECT_NE(e.find("fewer than one batch"), std::string::npos) << e;
  e = error_of([&] { md::DataLoader(dir / "*.bin", 1, 16, 0, 0, 4, kVocab, md::LoaderMode::Sequential); });
  EXPECT_NE(e.find("fewer than one batch"), std::string::npos) << e;
  e = error_of([&] { md::expand_glob(dir / "nothing_*.bin"); });
  EXPECT_NE(e.find("nothing_*.bin"), std::string::npos) << e;
  e = error_of([&] { md::DataLoader(dir / "*.bin", 1, 8, 0, 0, 1, 20); });
  EXPECT_NE(e.find("outside the vocabulary"), std::string::npos) << e;
  EXPECT_NE(e.find("train_000.bin"), std::string::npos) << e;
  e = error_of([&] { md::DataLoader(dir / "*.bin", 1, 8, 0, 2, 2, kVocab); });
  EXPECT_NE(e.find("rank 2"), std::string::npos) << e;
}

TEST(Loader, PrefetchKeepsUpWithTraining) {
  TempDir dir;
  make_shards(dir, {9000, 9000, 9000});
  const int B = 8, T = 64;
  md::DataLoader l(dir / "*.bin", B, T, 3, 0, 1, kVocab);
  next(l, B, T);
  std::this_thread::sleep_for(std::chrono::milliseconds(50));
  for (int i = 0; i < 40; ++i) {
    next(l, B, T);
    std::this_thread::sleep_for(std::chrono::milliseconds(2));  // a "training step"
  }
  EXPECT_LE(l.stalls(), 2u) << "batches were ready when asked for";
}
