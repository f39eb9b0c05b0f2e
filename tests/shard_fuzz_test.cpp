// shard_fuzz_test.cpp: shards that are damaged, not files, or changed on disk while a
// run reads them. Generated mutations (header fields, sizes, truncation, out-of-vocabulary
// ids) are each refused with an mhar::Error or read safely; a FIFO or device is refused at
// once; a shard truncated or rewritten in place after it was opened gives a clear error
// naming it (never SIGBUS, never its changed data); and a trainer whose shard changes
// checkpoints its last completed step before it stops, so that resuming (with the shard
// put back) continues exactly like an unbroken run.
#include <fcntl.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <random>
#include <thread>

#include "data/loader.h"
#include "data/shard.h"
#include "engine/config.h"
#include "engine/trainer.h"
#include "tests/data_test_util.h"
#include "tests/model_test_util.h"
#include "tests/wall_clock.h"

using mhar::test::error_of;
using mhar::test::read_bytes;
using mhar::test::TempDir;
using mhar::test::write_bytes;
namespace md = mhar::data;
namespace fs = std::filesystem;

namespace {

std::vector<int32_t> tokens_of(size_t n, int32_t vocab, uint32_t seed) {
  std::mt19937 rng(seed);
  std::vector<int32_t> t(n);
  for (auto& x : t) x = static_cast<int32_t>(rng() % vocab);
  return t;
}

void put32(std::string& bytes, size_t at, int32_t v) {
  if (at + 4 <= bytes.size()) std::memcpy(&bytes[at], &v, 4);
}

// A filesystem without fine-grained timestamps stamps times in clock ticks (up to 10 ms);
// a real rewrite comes long after the shard was written, so the tests wait that long.
void let_the_clock_tick() { std::this_thread::sleep_for(std::chrono::milliseconds(25)); }

// Rewrites `path` in place (same inode, truncated first), as `cp x path` or a careless
// script would, not by rename.
void overwrite_in_place(const std::string& path, const std::string& bytes) {
  let_the_clock_tick();
  const int fd = ::open(path.c_str(), O_WRONLY | O_TRUNC);
  ASSERT_GE(fd, 0);
  ASSERT_EQ(::write(fd, bytes.data(), bytes.size()), static_cast<ssize_t>(bytes.size()));
  ::close(fd);
}

double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

}  // namespace

TEST(ShardFuzz, MutatedShardsAreRefusedOrReadSafely) {
  TempDir dir;
  const int vocab = 1000;
  md::write_shard(dir / "u16.bin", tokens_of(600, vocab, 1), 2);
  md::write_shard(dir / "u32.bin", tokens_of(600, vocab, 2), 4);
  const std::string bases[2] = {read_bytes(dir / "u16.bin"), read_bytes(dir / "u32.bin")};
  std::mt19937 rng(77);
  const int32_t header_values[] = {0, 1, -1, 7, 20240520, 20240801, 599, 600, 601, INT32_MAX, INT32_MIN, 300};
  int refused = 0, read_ok = 0, loader_ok = 0;
  const auto t0 = std::chrono::steady_clock::now();
  const int kMutations = 1200;
  for (int c = 0; c < kMutations; ++c) {
    const int which = static_cast<int>(rng() % 2);
    std::string bytes = bases[which];
    const int width = which == 0 ? 2 : 4;
    switch (rng() % 6) {
      case 0:  // a header field (magic, version, count, or a reserved slot)
        put32(bytes, 4 * (rng() % 4), header_values[rng() % 12]);
        break;
      case 1:  // truncated anywhere, the header included
        bytes.resize(rng() % bytes.size());
        break;
      case 2:  // trailing bytes
        bytes.append(1 + rng() % 9, static_cast<char>(rng()));
        break;
      case 3:  // ids out of the vocabulary (and, for uint32, past INT32_MAX)
        for (int k = 0, n = 1 + static_cast<int>(rng() % 3); k < n; ++k) {
          const size_t at = 1024 + width * (rng() % 600);
          const uint32_t id = rng() % 2 ? vocab + rng() % 100 : 0xFFFFFFFFu - rng() % 3;
          std::memcpy(&bytes[at], &id, width);
        }
        break;
      case 4:  // the count and the size changed together, consistently
      {
        const int32_t n = static_cast<int32_t>(rng() % 700);
        put32(bytes, 8, n);
        bytes.resize(1024 + static_cast<size_t>(n) * width, '\0');
        break;
      }
      default:  // random bytes anywhere
        for (int k = 0, n = 1 + static_cast<int>(rng() % 8); k < n; ++k)
          bytes[rng() % bytes.size()] = static_cast<char>(rng());
        break;
    }
    const std::string path = dir / "m.bin";
    write_bytes(path, bytes);
    try {
      const auto t = md::read_shard(path, vocab);
      ++read_ok;
      // Read safely: what came back is the file's content, every id in range.
      ASSERT_EQ(bytes.size(), 1024 + t.size() * md::read_shard_header(path).token_bytes) << "case " << c;
      for (int32_t id : t) ASSERT_TRUE(id >= 0 && id < vocab) << "case " << c;
    } catch (const mhar::Error& e) {
      ++refused;
      EXPECT_NE(std::string(e.what()).find("m.bin"), std::string::npos) << "case " << c << ": " << e.what();
    }
    // The loader over the same file: refused up front, or batches of in-range ids.
    try {
      md::DataLoader l(path, 2, 8, 1, 0, 1, vocab);
      std::vector<int32_t> in(16), out(16);
      for (int b = 0; b < 3; ++b) {
        l.next_batch(in.data(), out.data());
        for (int i = 0; i < 16; ++i) ASSERT_TRUE(in[i] >= 0 && in[i] < vocab && out[i] >= 0 && out[i] < vocab);
      }
      ++loader_ok;
    } catch (const mhar::Error& e) {
      EXPECT_NE(std::string(e.what()).find("m.bin"), std::string::npos) << "case " << c << ": " << e.what();
    }
  }
  std::printf("[ fuzz ] %d shard mutations: %d read, %d refused (loader served %d), %.2f s\n",
              kMutations, read_ok, refused, loader_ok, seconds_since(t0));
  EXPECT_GT(read_ok, 100);
  EXPECT_GT(refused, 600);
}

TEST(ShardFuzz, FifosDevicesAndFoldersAreRefusedAtOnce) {
  TempDir dir;
  ASSERT_EQ(::mkfifo((dir / "fifo.bin").c_str(), 0644), 0);
  fs::create_symlink("/dev/zero", dir / "zero.bin");
  fs::create_directory(dir / "folder.bin");
  const auto t0 = std::chrono::steady_clock::now();
  // No writer ever opens the FIFO: a blocking open would wait forever.
  std::string e = error_of([&] { md::read_shard(dir / "fifo.bin"); });
  EXPECT_NE(e.find("fifo.bin: is a FIFO (named pipe), but a shard must be a regular file"), std::string::npos) << e;
  e = error_of([&] { md::read_shard_header(dir / "fifo.bin"); });
  EXPECT_NE(e.find("FIFO"), std::string::npos) << e;
  e = error_of([&] { md::DataLoader(dir / "fifo.bin", 1, 4, 0, 0, 1, 100); });
  EXPECT_NE(e.find("fifo.bin"), std::string::npos) << e;
  EXPECT_NE(e.find("FIFO"), std::string::npos) << e;
  e = error_of([&] { md::DataLoader(dir / "*.bin", 1, 4, 0, 0, 1, 100); });  // the glob finds it too
  EXPECT_NE(e.find("must be a regular file"), std::string::npos) << e;
  e = error_of([&] { md::read_shard(dir / "zero.bin"); });
  EXPECT_NE(e.find("zero.bin: is a character device"), std::string::npos) << e;
  e = error_of([&] { md::read_shard(dir / "folder.bin"); });
  EXPECT_NE(e.find("folder.bin: is a directory"), std::string::npos) << e;
  // data.val=/tmp: a folder where a shard (or glob) belongs says so, not "no such file".
  e = error_of([&] { md::DataLoader(dir.str(), 1, 4, 0, 0, 1, 100); });
  EXPECT_NE(e.find("is a directory"), std::string::npos) << e;
  EXPECT_NE(e.find("train_*.bin"), std::string::npos) << e;
  EXPECT_LT(seconds_since(t0), mhar::test::wall_clock_bound(5.0));
}

TEST(ShardChangedOnDisk, TruncatedAfterOpenIsAClearErrorNotSigbus) {
  TempDir dir;
  const auto tokens = tokens_of(50000, 1000, 3);
  md::write_shard(dir / "s.bin", tokens, 2);
  md::ShardReader reader(dir / "s.bin");
  std::vector<int32_t> out(100);
  reader.copy(49000, 100, out.data());
  EXPECT_EQ(out, std::vector<int32_t>(tokens.begin() + 49000, tokens.begin() + 49100));
  // Truncated in place to half: reading the lost tail through a memory map was SIGBUS.
  let_the_clock_tick();
  ASSERT_EQ(::truncate((dir / "s.bin").c_str(), 1024 + 2 * 25000), 0);
  std::string e = error_of([&] { reader.copy(49000, 100, out.data()); });
  EXPECT_NE(e.find("shard " + (dir / "s.bin") + " changed on disk"), std::string::npos) << e;
  EXPECT_NE(e.find("(size 101024 -> 51024 bytes)"), std::string::npos) << e;
  // The part still there is refused too: the file is no longer the one validated.
  e = error_of([&] { reader.copy(0, 100, out.data()); });
  EXPECT_NE(e.find("changed on disk"), std::string::npos) << e;
  // Grown back to its size by appending: the same size, but written since.
  std::ofstream((dir / "s.bin"), std::ios::app | std::ios::binary) << std::string(50000, 'x');
  e = error_of([&] { reader.copy(0, 100, out.data()); });
  EXPECT_NE(e.find("modified again after it was opened"), std::string::npos) << e;
}

TEST(ShardChangedOnDisk, RewrittenInPlaceIsAnErrorReplacedByRenameIsNot) {
  TempDir dir;
  const auto a = tokens_of(4000, 1000, 4), b = tokens_of(4000, 1000, 5);
  md::write_shard(dir / "s.bin", a, 2);
  md::write_shard(dir / "other.bin", b, 2);
  {
    md::ShardReader reader(dir / "s.bin");
    // Replaced the way write_shard publishes (rename): the open reader keeps reading the
    // file it validated, which is still whole.
    fs::rename(dir / "other.bin", dir / "s.bin");
    std::vector<int32_t> out(4000);
    reader.copy(0, 4000, out.data());
    EXPECT_EQ(out, a);
  }
  {
    md::ShardReader reader(dir / "s.bin");
    std::vector<int32_t> out(10);
    reader.copy(0, 10, out.data());
    // Same bytes count, new content, written in place: the size alone cannot tell.
    md::write_shard(dir / "third.bin", a, 2);
    overwrite_in_place(dir / "s.bin", read_bytes(dir / "third.bin"));
    const std::string e = error_of([&] { reader.copy(0, 10, out.data()); });
    EXPECT_NE(e.find("changed on disk"), std::string::npos) << e;
    EXPECT_NE(e.find("s.bin"), std::string::npos) << e;
  }
}

TEST(ShardChangedOnDisk, TheLoaderStopsWithTheShardNamedAndNeverServesChangedData) {
  TempDir dir;
  const int vocab = 5000;
  std::vector<int32_t> t(40000);
  for (size_t i = 0; i < t.size(); ++i) t[i] = static_cast<int32_t>(i % vocab);  // consecutive ids
  md::write_shard(dir / "train_000.bin", t, 2);
  const int B = 4, T = 32;
  md::DataLoader l(dir / "train_*.bin", B, T, 9, 0, 1, vocab);
  std::vector<int32_t> in(B * T), out(B * T);
  l.next_batch(in.data(), out.data());
  // Overwritten in place with ids a run would never have read: every later batch either
  // was prepared before (then it holds the old, consecutive ids) or is an error.
  std::vector<int32_t> other(40000, 7);
  md::write_shard(dir / "x.bin", other, 2);
  overwrite_in_place(dir / "train_000.bin", read_bytes(dir / "x.bin"));
  std::string e;
  int served = 0;
  for (int k = 0; k < 20 && e.empty(); ++k) {
    e = error_of([&] { l.next_batch(in.data(), out.data()); });
    if (!e.empty()) break;
    ++served;
    for (int r = 0; r < B; ++r)
      for (int i = 1; i < T; ++i) ASSERT_EQ((in[r * T + i - 1] + 1) % vocab, in[r * T + i]) << "changed data served";
  }
  // At most the 4 prefetched batches and the one the prefetch thread held, waiting for
  // room, when the shard changed.
  EXPECT_LE(served, 5) << "only the batches prepared before the change";
  EXPECT_NE(e.find("shard " + (dir / "train_000.bin") + " changed on disk"), std::string::npos) << e;
}

TEST(ShardChangedOnDisk, OutOfVocabularyIdsNeverReachABatchEvenIfTheMtimeIsRestored) {
  TempDir dir;
  const int vocab = 100;
  md::write_shard(dir / "train_000.bin", tokens_of(20000, vocab, 6), 2);
  struct stat before {};
  ASSERT_EQ(::stat((dir / "train_000.bin").c_str(), &before), 0);
  md::DataLoader l(dir / "train_000.bin", 2, 16, 1, 0, 1, vocab);
  // The same size, ids past the vocabulary, and the old mtime set back (rsync --inplace
  // -t does this): the size and mtime check cannot see it, the per-batch id check does.
  std::string bytes = read_bytes(dir / "train_000.bin");
  for (size_t at = 1024; at < bytes.size(); at += 2) bytes[at] = static_cast<char>(200);
  overwrite_in_place(dir / "train_000.bin", bytes);
  const struct timespec times[2] = {before.st_atim, before.st_mtim};
  ASSERT_EQ(::utimensat(AT_FDCWD, (dir / "train_000.bin").c_str(), times, 0), 0);
  std::vector<int32_t> in(32), out(32);
  std::string e;
  for (int k = 0; k < 20 && e.empty(); ++k) {
    e = error_of([&] { l.next_batch(in.data(), out.data()); });
    if (e.empty()) {
      for (int i = 0; i < 32; ++i) ASSERT_TRUE(in[i] < vocab && out[i] < vocab) << "an id past the vocabulary";
    }
  }
  EXPECT_NE(e.find("train_000.bin changed on disk"), std::string::npos) << e;
  EXPECT_NE(e.find("outside the vocabulary (0..99)"), std::string::npos) << e;
}

// The trainer: a shard overwritten in place mid-run stops it with the shard named, after
// a checkpoint of the last completed step; resuming with the shard as it was continues
// bit for bit like a run that was never interrupted.
TEST(ShardChangedOnDisk, TheTrainerCheckpointsItsLastStepThenStops) {
  TempDir dir;
  fs::create_directories(dir / "data");
  const std::string train_shard = dir / "data/train_000.bin";
  md::write_shard(train_shard, mhar::test::markov_tokens(40000, 1), 2);
  md::write_shard(dir / "data/val_000.bin", mhar::test::markov_tokens(4000, 3), 2);
  const std::string original = read_bytes(train_shard);
  nlohmann::json j = {
      {"model", {{"vocab_size", 32}, {"d_model", 32}, {"n_layers", 2}, {"n_heads", 4}, {"n_kv_heads", 2},
                 {"head_dim", 8}, {"d_ff", 64}, {"context_length", 16}}},
      {"residual", {{"mode", "mhar"}}},
      {"train", {{"micro_batch", 4}, {"seq_len", 16}, {"batch_tokens", 2 * 4 * 16}, {"steps", 5000}, {"lr", 1e-2},
                 {"warmup_steps", 2}, {"eval_every", 1000}, {"eval_batches", 2}, {"device", "cpu"}, {"seed", 5}}},
      {"data", {{"train", dir / "data/train_*.bin"}, {"val", dir / "data/val_*.bin"}}},
      {"checkpoint", {{"every", 1000}, {"keep", 0}}}};
  const mhar::Config cfg = mhar::config_from_json(j, "shard_fuzz_test");
  mhar::TrainOptions broken;
  broken.run_dir = dir / "broken";
  broken.quiet = true;

  // Once a few steps are logged, the shard is overwritten in place (same content: the
  // reader cannot know that, and must stop anyway).
  std::thread vandal([&] {
    const auto t0 = std::chrono::steady_clock::now();
    for (;;) {
      std::ifstream in(dir / "broken/metrics.jsonl");
      std::string line;
      int train_lines = 0;
      while (std::getline(in, line)) train_lines += line.find("\"kind\":\"train\"") != std::string::npos;
      if (train_lines >= 3 || seconds_since(t0) > 60) break;
      std::this_thread::sleep_for(std::chrono::milliseconds(2));
    }
    overwrite_in_place(train_shard, original);
  });
  const std::string e = error_of([&] { mhar::train(cfg, broken); });
  vandal.join();
  ASSERT_NE(e.find("shard " + train_shard + " changed on disk"), std::string::npos) << e;

  // The checkpoint of the last completed step is there (none was due before step 1000).
  std::vector<std::string> steps;
  for (const auto& entry : fs::directory_iterator(dir / "broken/checkpoints"))
    if (entry.path().filename().string().rfind("step_", 0) == 0) steps.push_back(entry.path().filename().string());
  ASSERT_EQ(steps.size(), 1u) << "one checkpoint, written on the way out";
  const auto state = nlohmann::json::parse(read_bytes(dir / ("broken/checkpoints/" + steps[0] + "/state.json")));
  const long long stopped_at = state["step"].get<long long>();
  EXPECT_GE(stopped_at, 3);
  std::printf("[ shard ] overwritten after step >= 3; stopped with a checkpoint at step %lld\n", stopped_at);

  // Resume (the shard is whole again, as rewritten) for 4 more steps, against a fresh run
  // to the same step: every logged loss matches.
  mhar::TrainOptions resume = broken;
  resume.resume = true;
  resume.stop_after_steps = 4;
  mhar::train(mhar::Config(), resume);
  mhar::TrainOptions fresh;
  fresh.run_dir = dir / "fresh";
  fresh.quiet = true;
  fresh.stop_after_steps = stopped_at + 4;
  mhar::train(cfg, fresh);
  auto losses = [](const std::string& metrics) {
    std::map<long long, double> out;
    std::ifstream in(metrics);
    std::string line;
    while (std::getline(in, line)) {
      const auto m = nlohmann::json::parse(line);
      if (m["kind"] == "train") out[m["step"].get<long long>()] = m["loss"].get<double>();
    }
    return out;
  };
  const auto a = losses(dir / "broken/metrics.jsonl"), b = losses(dir / "fresh/metrics.jsonl");
  ASSERT_EQ(a.size(), static_cast<size_t>(stopped_at + 4));
  ASSERT_EQ(b.size(), a.size());
  for (const auto& [step, loss] : b) EXPECT_EQ(a.at(step), loss) << "step " << step;
}

// A reader keeps its shard open: a dataset of more shards than the soft descriptor limit
// (1024 by default on many systems) still opens, the limit raised to the hard one; past
// the hard limit the error says what to do. In a child process, whose limits can change.
TEST(ShardFuzz, MoreShardsThanTheSoftDescriptorLimit) {
  TempDir dir;
  for (int i = 0; i < 80; ++i) md::write_shard(dir / ("train_" + std::to_string(100 + i) + ".bin"), tokens_of(64, 50, i), 2);
  const std::string glob = dir / "train_*.bin";
  auto run_child = [&](rlim_t soft, rlim_t hard) {
    const pid_t pid = ::fork();
    if (pid == 0) {
      struct rlimit rl {soft, hard};
      if (::setrlimit(RLIMIT_NOFILE, &rl) != 0) ::_exit(90);
      try {
        md::DataLoader l(glob, 1, 8, 0, 0, 1, 50);
        ::_exit(0);
      } catch (const mhar::Error& e) {
        const bool clear = std::string(e.what()).find("too many open files") != std::string::npos &&
                           std::string(e.what()).find("ulimit -n") != std::string::npos;
        ::_exit(clear ? 1 : 2);
      }
    }
    int status = 0;
    ::waitpid(pid, &status, 0);
    return WIFEXITED(status) ? WEXITSTATUS(status) : 100 + WTERMSIG(status);
  };
  EXPECT_EQ(run_child(48, 4096), 0) << "80 shards open with a soft limit of 48 (raised)";
  EXPECT_EQ(run_child(48, 48), 1) << "a hard limit of 48: a clear error";
}
