// data_loss_test.cpp: no run loses data (issue 18, section 2), through the real binary.
//
// - Full disk, simulated (MHAR_SIMULATE_DISK_FULL_AFTER_BYTES, always run) for each
//   writer: the metrics rewrite on resume and the metrics appends keep every line that
//   was there; a fresh `train` that fails leaves a directory the same command can run
//   again (no 0-byte config.json); `data prepare` and `train-tokenizer` exit 1 and leave
//   the old output whole.
// - Full disk, real: a small tmpfs (skipped with the reason where it cannot be mounted):
//   train until the disk is full, resume on the full disk, make room, resume to the end;
//   every loss matches an unbroken run bit for bit and every line is there exactly once.
// - The run lock: a second trainer beside a running one is refused naming its pid and
//   host; the lock of a killed trainer is taken over, and what it (and others) left in
//   checkpoints/ is cleaned up under the lock.
#include <fcntl.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/mount.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <sstream>
#include <thread>

#include "data/shard.h"
#include "engine/checkpoint.h"
#include "engine/error.h"
#include "engine/file_io.h"
#include "engine/run_lock.h"
#include "engine/trainer.h"
#include "tests/data_test_util.h"
#include "tests/model_test_util.h"
#include "tests/wall_clock.h"

namespace fs = std::filesystem;
using namespace mhar;
using mhar::test::markov_tokens;
using mhar::test::read_bytes;
using mhar::test::write_bytes;

namespace {

using Env = std::vector<std::pair<std::string, std::string>>;

struct Exit {
  int code = -1;  // exit status; -1: killed by a signal; -2: timed out
  std::string out;
};

// Starts `mhar ARGS` with `env` added, stdout and stderr into `log`. Everything the
// child needs is built before fork (the test process may have threads).
pid_t spawn(const std::vector<std::string>& args, const std::string& log, const Env& env = {}) {
  std::vector<std::string> env_strings;
  for (char** e = environ; *e; ++e) {
    const std::string kv = *e;
    bool replaced = false;
    for (const auto& [k, v] : env) replaced |= kv.rfind(k + "=", 0) == 0;
    if (!replaced) env_strings.push_back(kv);
  }
  for (const auto& [k, v] : env) env_strings.push_back(k + "=" + v);
  std::vector<char*> envp, argv{const_cast<char*>(MHAR_BINARY)};
  for (auto& s : env_strings) envp.push_back(s.data());
  envp.push_back(nullptr);
  for (const auto& a : args) argv.push_back(const_cast<char*>(a.c_str()));
  argv.push_back(nullptr);
  const pid_t pid = fork();
  if (pid == 0) {
    const int fd = ::open(log.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
    if (fd < 0) _exit(126);
    dup2(fd, 1);
    dup2(fd, 2);
    execve(MHAR_BINARY, argv.data(), envp.data());
    _exit(127);
  }
  return pid;
}

Exit wait_for(pid_t pid, const std::string& log, int timeout_s = 120) {
  Exit r;
  int status = 0;
  bool done = false;
  for (int i = 0; i < timeout_s * 100 && !done; ++i) {
    done = waitpid(pid, &status, WNOHANG) == pid;
    if (!done) std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  if (!done) {
    kill(pid, SIGKILL);
    waitpid(pid, &status, 0);
    r.code = -2;
  } else {
    r.code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  }
  r.out = read_bytes(log);
  return r;
}

// A pid that belonged to a process that has exited (and been reaped).
pid_t dead_pid() {
  const pid_t p = fork();
  if (p == 0) _exit(0);
  waitpid(p, nullptr, 0);
  return p;
}

std::vector<nlohmann::json> lines_of(const fs::path& file, const char* kind = nullptr) {
  std::vector<nlohmann::json> out;
  std::ifstream in(file);
  std::string line;
  while (std::getline(in, line)) {
    auto j = nlohmann::json::parse(line);  // every line whole: a torn one fails the test
    if (!kind || j["kind"] == kind) out.push_back(j);
  }
  return out;
}

// The hidden temporary names of interrupted writes in a run directory and its
// checkpoints (file_io's ".F.tmp-PID", the checkpoint's ".tmp-step_*" and ".old-step_*").
std::vector<std::string> leftovers(const fs::path& run) {
  std::vector<std::string> out;
  for (const fs::path& d : {run, run / "checkpoints"}) {
    if (!fs::is_directory(d)) continue;
    for (const auto& e : fs::directory_iterator(d)) {
      const std::string n = e.path().filename().string();
      if (n.find(".tmp") != std::string::npos || n.rfind(".old-", 0) == 0) out.push_back(e.path().string());
    }
  }
  return out;
}

class DataLoss : public ::testing::Test {
 protected:
  fs::path dir;
  void SetUp() override {
    dir = fs::temp_directory_path() /
          ("mhar_data_loss_" + std::to_string(::getpid()) + "_" +
           ::testing::UnitTest::GetInstance()->current_test_info()->name());
    fs::remove_all(dir);
    fs::create_directories(dir / "data");
    data::write_shard((dir / "data/train_000.bin").string(), markov_tokens(20000, 1), 2);
    data::write_shard((dir / "data/val_000.bin").string(), markov_tokens(4000, 3), 2);
  }
  void TearDown() override { fs::remove_all(dir); }

  // A tiny run (the model of train_test.cpp): a step takes milliseconds.
  std::string config_file(int steps, int every, const std::string& name = "cfg.json") {
    nlohmann::json j = {
        {"model", {{"vocab_size", 32}, {"d_model", 32}, {"n_layers", 2}, {"n_heads", 4},
                   {"n_kv_heads", 2}, {"head_dim", 8}, {"d_ff", 64}, {"context_length", 16}}},
        {"residual", {{"mode", "mhar"}}},
        {"train", {{"micro_batch", 4}, {"seq_len", 16}, {"steps", steps}, {"lr", 1e-2},
                   {"warmup_steps", 2}, {"eval_every", 6}, {"eval_batches", 4}, {"device", "cpu"},
                   {"seed", 5}}},
        {"data", {{"train", (dir / "data/train_*.bin").string()},
                  {"val", (dir / "data/val_*.bin").string()}}},
        {"checkpoint", {{"every", every}, {"keep", 0}}}};
    const std::string path = (dir / name).string();
    write_bytes(path, j.dump(2));
    return path;
  }
  Exit mhar(const std::vector<std::string>& args, const Env& env = {}, int timeout_s = 120) {
    const std::string log = (dir / "mhar.log").string();
    return wait_for(spawn(args, log, env), log, timeout_s);
  }
  Exit train(const std::string& cfg, const fs::path& run, const Env& env = {}, int timeout_s = 120) {
    return mhar({"--log-level", "warn", "train", cfg, "--run-dir", run.string()}, env, timeout_s);
  }
  Exit resume(const fs::path& run, const Env& env = {}, int timeout_s = 120) {
    return mhar({"--log-level", "warn", "train", "--resume", run.string()}, env, timeout_s);
  }
};

// Train losses by step; every step once, steps 1..N without a gap.
std::map<long long, double> losses(const fs::path& run) {
  std::map<long long, double> out;
  for (const auto& j : lines_of(run / "metrics.jsonl", "train")) {
    const long long s = j["step"].get<long long>();
    EXPECT_EQ(out.count(s), 0u) << "step " << s << " twice in " << run;
    out[s] = j["loss"].get<double>();
  }
  if (!out.empty()) {
    EXPECT_EQ(out.begin()->first, 1);
    EXPECT_EQ(out.rbegin()->first, (long long)out.size()) << "a gap in the steps of " << run;
  }
  return out;
}

}  // namespace

// The rewrite of metrics.jsonl on resume (dropping the steps after the checkpoint) on a
// full disk fails and leaves the file byte for byte; with room for the rewrite but not
// for one more line, the failed append leaves exactly the rewritten lines; once there is
// room, the run resumes and its losses match the uninterrupted run's.
TEST_F(DataLoss, MetricsRewriteAndAppendsOnAFullDiskKeepEveryLine) {
  const std::string cfg = config_file(8, 4);
  const fs::path run = dir / "run";
  ASSERT_EQ(train(cfg, run).code, 0);
  const auto reference = losses(run);
  ASSERT_EQ(reference.size(), 8u);
  // As if killed after step 8's metrics and before its checkpoint: a resume starts at 4.
  fs::remove_all(run / "checkpoints/step_00000008");
  const std::string before = read_bytes((run / "metrics.jsonl").string());
  std::string kept;  // the lines a resume from step 4 keeps, as they are in the file
  {
    std::istringstream in(before);
    std::string line;
    while (std::getline(in, line)) {
      const auto j = nlohmann::json::parse(line);
      if (!j.contains("step") || j["step"].get<long long>() <= 4) kept += line + "\n";
    }
  }
  ASSERT_LT(kept.size(), before.size());

  for (size_t limit : {size_t(0), size_t(1), kept.size() / 2, kept.size() - 1}) {
    const Exit r = resume(run, {{"MHAR_SIMULATE_DISK_FULL_AFTER_BYTES", std::to_string(limit)}});
    EXPECT_EQ(r.code, 1) << r.out;
    EXPECT_NE(r.out.find("metrics.jsonl"), std::string::npos) << r.out;
    EXPECT_NE(r.out.find("No space left on device"), std::string::npos) << r.out;
    EXPECT_EQ(read_bytes((run / "metrics.jsonl").string()), before) << "limit " << limit;
    EXPECT_TRUE(leftovers(run).empty()) << leftovers(run)[0];
  }
  // Room for the rewrite, none for the first new line: the append fails as an error and
  // the file holds exactly the kept lines (none lost, none torn).
  const Exit r = resume(run, {{"MHAR_SIMULATE_DISK_FULL_AFTER_BYTES", std::to_string(kept.size())}});
  EXPECT_EQ(r.code, 1) << r.out;
  EXPECT_NE(r.out.find("No space left on device"), std::string::npos) << r.out;
  EXPECT_EQ(read_bytes((run / "metrics.jsonl").string()), kept);
  EXPECT_EQ(open_checkpoint(run.string()).step, 4);

  const Exit ok = resume(run);
  ASSERT_EQ(ok.code, 0) << ok.out;
  EXPECT_EQ(losses(run), reference);  // bit for bit, every step once
  EXPECT_TRUE(leftovers(run).empty());
}

// A fresh run that fails on a full disk at any point of its start or its first steps
// leaves no 0-byte config.json and no temporary file, and the same command then runs.
TEST_F(DataLoss, FreshTrainOnAFullDiskLeavesTheDirectoryReRunnable) {
  const std::string cfg = config_file(8, 4);
  ASSERT_EQ(train(cfg, dir / "reference").code, 0);
  const auto reference = losses(dir / "reference");
  const std::string config_json = read_bytes((dir / "reference/config.json").string());
  ASSERT_GT(config_json.size(), 100u);
  // The largest limit is below one checkpoint, so no run here gets as far as one (a run
  // with a checkpoint is continued with --resume, not started again).
  ASSERT_GT(fs::file_size(dir / "reference/checkpoints/step_00000004/model.safetensors"), 60000u);
  for (size_t limit : {size_t(0), size_t(10), config_json.size() - 1, config_json.size() + 50,
                       config_json.size() + 3000, size_t(60000)}) {
    SCOPED_TRACE("limit " + std::to_string(limit));
    const fs::path run = dir / ("run_" + std::to_string(limit));
    const Exit r = train(cfg, run, {{"MHAR_SIMULATE_DISK_FULL_AFTER_BYTES", std::to_string(limit)}});
    EXPECT_EQ(r.code, 1) << r.out;
    EXPECT_NE(r.out.find("No space left on device"), std::string::npos) << r.out;
    if (fs::exists(run / "config.json")) {
      EXPECT_EQ(read_bytes((run / "config.json").string()), config_json);
    }
    EXPECT_TRUE(leftovers(run).empty()) << leftovers(run)[0];
    const Exit again = train(cfg, run);
    ASSERT_EQ(again.code, 0) << again.out;
    EXPECT_EQ(losses(run), reference);
  }
}

// `data prepare` into a folder that holds an earlier output: on a full disk it exits 1
// and the folder is exactly as it was (old shards and old prepare.json), not a 0-byte
// prepare.json over new shards. Staging folders of killed prepares are removed; one whose
// pid is running is not (prepare takes no lock: it may be another prepare at work).
TEST_F(DataLoss, PrepareOnAFullDiskExitsOneAndLeavesTheOldOutput) {
  std::string jsonl;
  for (int i = 0; i < 30; ++i)
    jsonl += nlohmann::json({{"text", "Document " + std::to_string(i) + ": the quick brown fox."}}).dump() + "\n";
  fs::create_directories(dir / "corpus");
  write_bytes((dir / "corpus/a.jsonl").string(), jsonl);
  const std::string tok = mhar::test::fixture_dir() + "/trained_4096.json";
  auto prepare = [&](const std::string& shard_tokens, const Env& env) {
    return mhar({"data", "prepare", "--tokenizer", tok, "--input", (dir / "corpus").string(), "--out",
                 (dir / "out").string(), "--val-docs", "2", "--shard-tokens", shard_tokens, "--no-progress"},
                env);
  };
  ASSERT_EQ(prepare("100", {}).code, 0);
  auto snapshot = [&] {
    std::map<std::string, std::string> files;
    for (const auto& e : fs::directory_iterator(dir / "out"))
      files[e.path().filename().string()] = e.is_regular_file() ? read_bytes(e.path().string()) : "<dir>";
    return files;
  };
  const auto old = snapshot();
  ASSERT_TRUE(old.count("prepare.json"));
  ASSERT_GT(old.size(), 3u);
  for (size_t limit : {size_t(0), size_t(200)}) {
    const Exit r = prepare("150", {{"MHAR_SIMULATE_DISK_FULL_AFTER_BYTES", std::to_string(limit)}});
    EXPECT_EQ(r.code, 1) << r.out;
    EXPECT_NE(r.out.find("prepare.json"), std::string::npos) << r.out;
    EXPECT_NE(r.out.find("No space left on device"), std::string::npos) << r.out;
    EXPECT_EQ(snapshot(), old) << "limit " << limit;
  }
  const pid_t dead = dead_pid();
  fs::create_directories(dir / ("out/.prepare-tmp-" + std::to_string(dead)) / "x");
  fs::create_directories(dir / ("out/.prepare-tmp-" + std::to_string(::getpid())));
  const Exit ok = prepare("150", {});
  ASSERT_EQ(ok.code, 0) << ok.out;
  EXPECT_FALSE(fs::exists(dir / ("out/.prepare-tmp-" + std::to_string(dead))));
  EXPECT_TRUE(fs::exists(dir / ("out/.prepare-tmp-" + std::to_string(::getpid()))));
  const auto meta = nlohmann::json::parse(read_bytes((dir / "out/prepare.json").string()));
  EXPECT_EQ(meta["shard_tokens"].get<int>(), 150);
  for (const auto& name : meta["train_shards"]) EXPECT_TRUE(fs::exists(dir / "out" / name.get<std::string>()));
  EXPECT_EQ(snapshot().count("train_000000.bin"), 1u);
}

// `data train-tokenizer --out` over an existing tokenizer.json on a full disk: exit 1,
// the old file whole.
TEST_F(DataLoss, TrainTokenizerOnAFullDiskLeavesTheOldFile) {
  fs::create_directories(dir / "corpus");
  write_bytes((dir / "corpus/a.txt").string(), "low lower lowest newer newest wider widest\n");
  const std::string out = (dir / "tok.json").string();
  auto run = [&](const Env& env) {
    return mhar({"data", "train-tokenizer", "--vocab", "300", "--threads", "1", "--input",
                 (dir / "corpus").string(), "--out", out}, env);
  };
  ASSERT_EQ(run({}).code, 0);
  const std::string old = read_bytes(out);
  write_bytes((dir / "corpus/b.txt").string(), "another text with other pairs: aaaa bbbb abab\n");
  const Exit r = run({{"MHAR_SIMULATE_DISK_FULL_AFTER_BYTES", "1000"}});
  EXPECT_EQ(r.code, 1) << r.out;
  EXPECT_NE(r.out.find("No space left on device"), std::string::npos) << r.out;
  EXPECT_EQ(read_bytes(out), old);
  for (const auto& e : fs::directory_iterator(dir))
    EXPECT_EQ(e.path().filename().string().find(".tmp"), std::string::npos) << e.path();
  ASSERT_EQ(run({}).code, 0);
  EXPECT_NE(read_bytes(out), old);
}

// Fills the filesystem holding `dir` to the last byte (a file written until ENOSPC, in
// ever smaller pieces).
void fill_disk(const fs::path& dir) {
  const int fd = ::open((dir / "filler").c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
  ASSERT_GE(fd, 0) << std::strerror(errno);
  std::vector<char> buf(1 << 16, 'x');
  for (size_t chunk = buf.size(); chunk >= 1; chunk /= 2)
    while (::write(fd, buf.data(), chunk) == ssize_t(chunk)) {
    }
  EXPECT_EQ(errno, ENOSPC);
  ::close(fd);
}

// A real full disk: a small tmpfs holds the run directory (the data stays outside). The
// run fails when the disk fills; on the disk filled to the last byte, a resume fails
// leaving metrics.jsonl byte for byte, and a fresh start fails leaving no config.json but
// a whole one; after the disk grows, the resume runs to the end and the fresh command
// runs. Every step's loss matches an unbroken run bit for bit (CPU resume is bit-exact),
// each step's line is there once, and every checkpoint left at any point validates.
TEST_F(DataLoss, RealFullDiskTrainResumeLosesNothing) {
  const std::string cfg = config_file(40, 4), cfg_short = config_file(8, 4, "short.json");
  ASSERT_EQ(train(cfg, dir / "reference").code, 0);
  const auto reference = losses(dir / "reference");
  ASSERT_EQ(reference.size(), 40u);
  ASSERT_EQ(train(cfg_short, dir / "reference_short").code, 0);
  const std::string config_json = read_bytes((dir / "reference_short/config.json").string());
  uint64_t ckpt_bytes = 0;
  for (const auto& e : fs::directory_iterator(dir / "reference/checkpoints/step_00000004"))
    ckpt_bytes += fs::file_size(e.path());

  const fs::path mnt = dir / "mnt";
  fs::create_directories(mnt);
  auto size_opt = [](uint64_t bytes) { return "size=" + std::to_string((bytes + 4095) / 4096 * 4096); };
  // Room for config, metrics, report and about three checkpoints of the ten the run writes.
  const uint64_t small = 3 * ckpt_bytes + 256 * 1024;
  if (::mount("tmpfs", mnt.c_str(), "tmpfs", 0, size_opt(small).c_str()) != 0)
    GTEST_SKIP() << "cannot mount a tmpfs here (" << std::strerror(errno)
                 << "; needs root or CAP_SYS_ADMIN); the simulated full-disk tests cover the writers";
  struct Unmount {
    fs::path p;
    ~Unmount() { ::umount2(p.c_str(), MNT_DETACH); }
  } unmount{mnt};
  const fs::path run = mnt / "run", fresh = mnt / "fresh";

  auto check_nothing_lost = [&](const Exit& r, const char* what) {
    SCOPED_TRACE(what);
    EXPECT_TRUE(leftovers(run).empty()) << leftovers(run)[0];
    const auto got = losses(run);
    for (const auto& [step, loss] : got) EXPECT_EQ(loss, reference.at(step)) << "step " << step;
    long long newest = 0;
    for (const auto& c : list_checkpoints(run.string())) newest = open_checkpoint(c).step;  // each validates
    EXPECT_GE((long long)got.size(), newest) << "metrics lost steps the checkpoint holds";
    if (r.code != 0) {
      EXPECT_NE(r.out.find("No space left on device"), std::string::npos) << r.out;
    }
    return newest;
  };
  const Exit first = train(cfg, run);
  EXPECT_EQ(first.code, 1) << "the disk did not fill: " << first.out;
  const long long at = check_nothing_lost(first, "first run");
  EXPECT_GE(at, 4) << "not even one checkpoint fitted; the test needs a larger tmpfs";
  EXPECT_LT(at, 40);

  fill_disk(mnt);
  const std::string metrics_before = read_bytes((run / "metrics.jsonl").string());
  const Exit full = resume(run);
  EXPECT_EQ(full.code, 1) << full.out;
  check_nothing_lost(full, "resume on the full disk");
  EXPECT_EQ(read_bytes((run / "metrics.jsonl").string()), metrics_before);
  const Exit fresh_full = train(cfg_short, fresh);
  EXPECT_EQ(fresh_full.code, 1) << fresh_full.out;
  EXPECT_NE(fresh_full.out.find("No space left on device"), std::string::npos) << fresh_full.out;
  if (fs::exists(fresh / "config.json")) {
    EXPECT_EQ(read_bytes((fresh / "config.json").string()), config_json);
  }
  EXPECT_TRUE(leftovers(fresh).empty()) << leftovers(fresh)[0];

  fs::remove(mnt / "filler");
  ASSERT_EQ(::mount("tmpfs", mnt.c_str(), "tmpfs", MS_REMOUNT, size_opt(24 * ckpt_bytes + (1 << 20)).c_str()), 0)
      << std::strerror(errno);
  const Exit ok = resume(run);
  ASSERT_EQ(ok.code, 0) << ok.out;
  check_nothing_lost(ok, "resume with room");
  EXPECT_EQ(losses(run), reference);
  const Exit fresh_ok = train(cfg_short, fresh);
  EXPECT_EQ(fresh_ok.code, 0) << fresh_ok.out;
}

// Two trainers in one run directory: the second (a resume, or the same fresh command) is
// refused naming the holder's pid and host, and the first goes on untouched. After the
// holder is killed (its flock dies with it, its record stays) a resume takes the stale
// lock over, saying whose it was, and first removes what killed writers left: every
// checkpoints/.tmp-step_* (the lock proves no live trainer owns one, whatever process its
// pid names now), an .old-step_* whose step exists, the temporary files of config.json,
// metrics.jsonl and a rank's timed choices; a report.html temporary file of a running pid stays
// (`mhar report` takes no lock).
TEST_F(DataLoss, SecondTrainerIsRefusedAndAKilledTrainersLockAndLeftoversAreTakenOver) {
  const std::string cfg = config_file(1000000, 5);
  const fs::path run = dir / "run";
  const std::string log_a = (dir / "a.log").string();
  const pid_t a = spawn({"--log-level", "warn", "train", cfg, "--run-dir", run.string()}, log_a);
  auto train_lines = [&] { return fs::exists(run / "metrics.jsonl") ? lines_of(run / "metrics.jsonl", "train").size() : 0; };
  for (int i = 0; i < 1200 && train_lines() < 12; ++i) std::this_thread::sleep_for(std::chrono::milliseconds(50));
  if (train_lines() < 12) {
    kill(a, SIGKILL);
    waitpid(a, nullptr, 0);
    FAIL() << "training did not start: " << read_bytes(log_a);
  }
  char host[256] = {0};
  gethostname(host, sizeof host - 1);
  const std::string holder = "pid " + std::to_string(a) + " on host " + host;
  // Refused at once (a run that was not refused would be killed after 30 s).
  for (int second = 0; second < 2; ++second) {
    const auto t0 = std::chrono::steady_clock::now();
    const Exit r = second ? train(cfg, run, {}, 30) : resume(run, {}, 30);
    EXPECT_LT(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count(),
              mhar::test::wall_clock_bound(5.0));
    EXPECT_EQ(r.code, 1) << r.out;
    EXPECT_NE(r.out.find("another trainer is using this run directory: " + holder), std::string::npos) << r.out;
  }
  // The first run goes on appending to the same metrics.jsonl.
  const size_t seen = train_lines();
  for (int i = 0; i < 600 && train_lines() < seen + 5; ++i) std::this_thread::sleep_for(std::chrono::milliseconds(50));
  EXPECT_GE(train_lines(), seen + 5);
  kill(a, SIGKILL);
  waitpid(a, nullptr, 0);
  EXPECT_NE(read_bytes((run / ".lock").string()).find("\"pid\":" + std::to_string(a)), std::string::npos);

  const std::string dead = std::to_string(dead_pid()), live = std::to_string(::getpid());
  const fs::path ck = run / "checkpoints";
  fs::create_directories(ck / (".tmp-step_00000099-" + dead));
  write_bytes((ck / (".tmp-step_00000099-" + dead) / "model.safetensors").string(), "partial");
  fs::create_directories(ck / (".tmp-step_00000098-" + live));
  fs::create_directories(ck / (".old-step_00000005-" + dead));  // step_00000005 exists
  ASSERT_TRUE(fs::exists(ck / "step_00000005"));
  write_bytes((run / (".metrics.jsonl.tmp-" + dead)).string(), "{}");
  write_bytes((run / (".config.json.tmp-" + live)).string(), "{}");
  write_bytes((run / (".timed_choices.rank1.txt.tmp-" + dead)).string(), "mhar");
  write_bytes((run / (".report.html.tmp-" + dead)).string(), "<html>");
  write_bytes((run / (".report.html.tmp-" + live)).string(), "<html>");

  const size_t before = train_lines();
  const std::string log_d = (dir / "d.log").string();
  const pid_t d = spawn({"--log-level", "warn", "train", "--resume", run.string()}, log_d);
  for (int i = 0; i < 1200 && train_lines() < before + 3; ++i) std::this_thread::sleep_for(std::chrono::milliseconds(50));
  kill(d, SIGINT);
  const Exit r = wait_for(d, log_d);
  ASSERT_EQ(r.code, 0) << r.out;
  EXPECT_NE(r.out.find("taking over the stale lock of pid " + std::to_string(a) + " on host " + host),
            std::string::npos) << r.out;
  EXPECT_NE(r.out.find("that process is gone"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find(".tmp-step_00000099-" + dead), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("pid " + live + ", a running process that does not hold this run's lock"), std::string::npos)
      << r.out;
  for (const std::string& gone : {".tmp-step_00000099-" + dead, ".tmp-step_00000098-" + live, ".old-step_00000005-" + dead})
    EXPECT_FALSE(fs::exists(ck / gone)) << gone;
  for (const std::string& gone :
       {".metrics.jsonl.tmp-" + dead, ".config.json.tmp-" + live, ".report.html.tmp-" + dead,
        ".timed_choices.rank1.txt.tmp-" + dead})
    EXPECT_FALSE(fs::exists(run / gone)) << gone;
  EXPECT_TRUE(fs::exists(run / (".report.html.tmp-" + live)));
  fs::remove(run / (".report.html.tmp-" + live));
  EXPECT_TRUE(leftovers(run).empty()) << leftovers(run)[0];
  // The resumed run continued the killed one: steps once each, no gap, and its last
  // checkpoint is its last step.
  const auto got = losses(run);
  EXPECT_GT(got.size(), before);
  EXPECT_EQ(open_checkpoint(run.string()).step, got.rbegin()->first);
  EXPECT_EQ(read_bytes((run / ".lock").string()), "") << "a holder that ends normally clears its record";
}

// In one process too: a second lock on the directory is refused naming this pid; a
// released lock is taken without a stale-lock warning; a record of a dead pid on a free
// lock is taken over.
TEST_F(DataLoss, RunLockInProcess) {
  const std::string run = (dir / "run").string();
  fs::create_directories(run);
  {
    RunLock first(run);
    const std::string msg = mhar::test::error_of([&] { RunLock second(run); });
    EXPECT_NE(msg.find("pid " + std::to_string(::getpid()) + " on host " + this_host_name()), std::string::npos) << msg;
    EXPECT_NE(msg.find(run + "/.lock"), std::string::npos) << msg;
  }
  EXPECT_EQ(read_bytes(run + "/.lock"), "");
  write_bytes(run + "/.lock", nlohmann::json({{"pid", dead_pid()}, {"host", this_host_name()},
                                               {"started", "2020-01-01T00:00:00Z"}}).dump());
  {
    RunLock taken(run);
    const auto rec = nlohmann::json::parse(read_bytes(run + "/.lock"));
    EXPECT_EQ(rec["pid"].get<long long>(), ::getpid());
  }
  // Not a regular file: refused with a message, never followed or waited on.
  fs::remove(run + "/.lock");
  fs::create_symlink("/dev/null", run + "/.lock");
  const std::string msg = mhar::test::error_of([&] { RunLock l(run); });
  EXPECT_NE(msg.find("symbolic link"), std::string::npos) << msg;
}

// A kill between the two renames that replace a same-step checkpoint leaves the whole old
// checkpoint as .old-step_N (and step_N missing): the next start puts it back, so the
// resume finds it.
TEST_F(DataLoss, ASetAsideCheckpointIsPutBack) {
  const std::string cfg = config_file(8, 4);
  const fs::path run = dir / "run";
  ASSERT_EQ(train(cfg, run).code, 0);
  const auto reference = losses(run);
  const fs::path ck = run / "checkpoints";
  const std::string dead = std::to_string(dead_pid());
  fs::rename(ck / "step_00000008", ck / (".old-step_00000008-" + dead));
  fs::create_directories(ck / (".tmp-step_00000008-" + dead));  // the replacement, incomplete
  const Exit r = resume(run);
  ASSERT_EQ(r.code, 0) << r.out;
  EXPECT_NE(r.out.find("put back as"), std::string::npos) << r.out;
  EXPECT_TRUE(leftovers(run).empty()) << leftovers(run)[0];
  EXPECT_EQ(open_checkpoint(run.string()).step, 8);
  EXPECT_EQ(losses(run), reference);
}
