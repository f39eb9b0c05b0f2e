// dist_test.cpp: data parallelism on the CPU backend over MPI (issue 16), through the
// real command: `mpirun -np 2 mhar train`. CI has no GPU; this is the same code path the
// NCCL communicator takes (TrainStep, ZeRO-1 shards, bucketed reduce-scatter,
// all-gather, sharded checkpoints), with MPI collectives.
//
// - Equivalence: 2 ranks x 1 micro-batch of b sequences against 1 process with 2
//   micro-batches of accumulation (the same global batch, the same windows), 20 steps,
//   every residual mode. The two differ only in the order of fp32 additions (the
//   gradient of the second micro-batch is added to the first inside the matmul on one
//   process, by the reduce-scatter on two), about 1 ulp (6e-8) of a gradient element;
//   AdamW's update is a smooth function of the gradient away from g ~ eps, so the losses
//   move by the same relative order per step. 1e-6 relative per step (the bound)
//   leaves a factor ~16 for accumulation over 20 steps; the measured worst is printed.
// - `mpirun -np 1` is bit for bit the run without mpirun (every collective is the
//   identity at one rank).
// - Resume at 2 ranks is bit-exact; a 2-rank checkpoint resumed on 1 process and a
//   1-process checkpoint resumed on 2 ranks continue with the same losses within 1e-6
//   (the optimizer state re-sharded; the same argument as the equivalence).
// - Faults: SIGTERM to one rank stops every rank after the step with one checkpoint and
//   exit 0 (also SIGUSR1 to mpirun, which forwards it); a killed rank ends the job with an
//   error naming it within 60 s; a stopped (hung) rank ends it after MHAR_STEP_TIMEOUT_S
//   with an error naming it; a global batch that does not split over the ranks is a
//   clear error.
// Every subprocess runs with OMP_NUM_THREADS=1: two ranks on a 2-core CI machine, and the
// bit-exact comparisons need the same thread count on both sides.
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string>
#include <thread>
#include <vector>

#include <nlohmann/json.hpp>

#include "data/shard.h"
#include "tests/data_test_util.h"
#include "tests/model_test_util.h"
#include "tests/process_test_util.h"
#include "tests/wall_clock.h"

namespace fs = std::filesystem;
using mhar::test::CommandResult;
using mhar::test::markov_tokens;
using mhar::test::read_bytes;
using mhar::test::read_metrics;
using mhar::test::run_command;

namespace {

// Open MPI as root in a container: allowed explicitly, oversubscribed (2 ranks may
// exceed the cores), and no cross-memory-attach single copy (ptrace is often refused in
// containers).
const char* kMpirun =
    "env OMPI_MCA_btl_vader_single_copy_mechanism=none mpirun --allow-run-as-root --oversubscribe";

using Result = CommandResult;

// The child's stdout and stderr together; one thread per rank (OMP_NUM_THREADS=1) on a
// 2-core machine; no job outlives 300 s.
Result run(const std::string& cmd) { return run_command("OMP_NUM_THREADS=1 timeout 300 " + cmd + " 2>&1"); }

std::string mhar_cmd(int ranks, const std::string& args, const char* log_level = "warn") {
  const std::string bin = std::string(MHAR_BINARY) + " --log-level " + log_level + " " + args;
  if (ranks == 0) return bin;  // no mpirun at all
  return std::string(kMpirun) + " -np " + std::to_string(ranks) + " " + bin;
}

class DistTest : public ::testing::Test {
 protected:
  fs::path dir;
  void SetUp() override {
    dir = fs::temp_directory_path() /
          ("mhar_dist_test_" + std::to_string(::getpid()) + "_" +
           ::testing::UnitTest::GetInstance()->current_test_info()->name());
    fs::remove_all(dir);
    fs::create_directories(dir / "data");
    // 2 x 20000 tokens: 2 x 1249 windows of 16, one epoch = 1249 steps of 2 x 2 windows,
    // far more than any run here reads, so the two layouts never meet an epoch boundary.
    mhar::data::write_shard((dir / "data/train_000.bin").string(), markov_tokens(20000, 1), 2);
    mhar::data::write_shard((dir / "data/train_001.bin").string(), markov_tokens(20000, 2), 2);
    mhar::data::write_shard((dir / "data/val_000.bin").string(), markov_tokens(4000, 3), 2);
  }
  void TearDown() override { fs::remove_all(dir); }

  // A tiny model; micro-batch 2 of 16 tokens; the global batch is 2 micro-batches.
  fs::path config(const std::string& name, const std::string& mode, int steps,
                  long long batch_tokens = 64, int every = 4) {
    nlohmann::json j = {
        {"model", {{"vocab_size", 32}, {"d_model", 32}, {"n_layers", 2}, {"n_heads", 4},
                   {"n_kv_heads", 2}, {"head_dim", 8}, {"d_ff", 64}, {"context_length", 16}}},
        {"residual", {{"mode", mode}, {"heads", mode == "mhar" ? 2 : 1}}},
        {"train", {{"micro_batch", 2}, {"seq_len", 16}, {"batch_tokens", batch_tokens},
                   {"steps", steps}, {"lr", 1e-2}, {"warmup_steps", 2}, {"grad_clip", 1.0},
                   {"eval_every", 10}, {"eval_batches", 4}, {"device", "cpu"}, {"seed", 5}}},
        {"data", {{"train", (dir / "data/train_*.bin").string()},
                  {"val", (dir / "data/val_*.bin").string()}}},
        {"checkpoint", {{"every", every}, {"keep", 0}}}};
    if (mode == "standard") j["residual"].erase("heads");
    const fs::path p = dir / (name + ".json");
    std::ofstream(p) << j.dump(2);
    return p;
  }

  static std::vector<double> losses(const fs::path& run) {
    std::vector<double> out;
    for (const auto& j : read_metrics(run, "train")) out.push_back(j["loss"].get<double>());
    return out;
  }
  // Keeps only the checkpoint of step `step` (as if the run had stopped there).
  static void keep_only_checkpoint(const fs::path& run, int step) {
    char name[32];
    std::snprintf(name, sizeof name, "step_%08d", step);
    for (const auto& e : fs::directory_iterator(run / "checkpoints"))
      if (e.path().filename() != name) fs::remove_all(e.path());
    ASSERT_TRUE(fs::exists(run / "checkpoints" / name));
  }
  // Largest relative difference of losses a[from..] and b[from..].
  static double max_rel_diff(const std::vector<double>& a, const std::vector<double>& b,
                             size_t from = 0) {
    double worst = 0;
    for (size_t i = from; i < a.size() && i < b.size(); ++i)
      worst = std::max(worst, std::fabs(a[i] - b[i]) / std::fabs(b[i]));
    return worst;
  }
};

TEST_F(DistTest, TwoRanksMatchOneRankWithAccumulationInEveryMode) {
  for (const std::string mode : {"standard", "attnres", "mhar"}) {
    const fs::path cfg = config("cfg_" + mode, mode, 20, 64, 0);
    const fs::path one = dir / ("one_" + mode), two = dir / ("two_" + mode);
    const Result r1 = run(mhar_cmd(0, "train " + cfg.string() + " --run-dir " + one.string()));
    ASSERT_EQ(r1.rc, 0) << r1.out;
    const Result r2 = run(mhar_cmd(2, "train " + cfg.string() + " --run-dir " + two.string()));
    ASSERT_EQ(r2.rc, 0) << r2.out;
    const auto a = losses(one), b = losses(two);
    ASSERT_EQ(a.size(), 20u);
    ASSERT_EQ(b.size(), 20u);
    for (size_t i = 0; i < a.size(); ++i)
      EXPECT_LT(std::fabs(b[i] - a[i]) / std::fabs(a[i]), 1e-6)
          << mode << " step " << i + 1 << ": 2 ranks " << b[i] << ", 1 rank " << a[i];
    EXPECT_LT(a.back(), 0.8 * a.front()) << mode << ": the run did not learn";
    std::printf("[ dist ] %s: 20 steps, loss %.4f -> %.4f, max rel diff 2 ranks vs 1 rank "
                "with accumulation %.2e (bound 1e-6)\n", mode.c_str(), a.front(), a.back(),
                max_rel_diff(b, a));
    // Only rank 0 writes metrics: one line per step, no duplicates.
    EXPECT_EQ(read_metrics(two, "eval").size(), 3u);  // steps 0, 10, 20
  }
}

TEST_F(DistTest, OneRankUnderMpirunIsBitIdenticalToNoMpirun) {
  const fs::path cfg = config("cfg", "mhar", 10, 64, 0);
  const fs::path plain = dir / "plain", np1 = dir / "np1";
  const Result r0 = run(mhar_cmd(0, "train " + cfg.string() + " --run-dir " + plain.string()));
  ASSERT_EQ(r0.rc, 0) << r0.out;
  const Result r1 = run(mhar_cmd(1, "train " + cfg.string() + " --run-dir " + np1.string()));
  ASSERT_EQ(r1.rc, 0) << r1.out;
  const auto a = read_metrics(plain, "train"), b = read_metrics(np1, "train");
  ASSERT_EQ(a.size(), 10u);
  ASSERT_EQ(b.size(), 10u);
  for (size_t i = 0; i < a.size(); ++i) {
    EXPECT_EQ(a[i]["loss"].get<double>(), b[i]["loss"].get<double>()) << "step " << i + 1;
    EXPECT_EQ(a[i]["grad_norm"].get<double>(), b[i]["grad_norm"].get<double>()) << "step " << i + 1;
  }
  EXPECT_EQ(read_bytes(plain / "checkpoints/step_00000010/model.safetensors"),
            read_bytes(np1 / "checkpoints/step_00000010/model.safetensors"));
}

TEST_F(DistTest, ResumeAtTwoRanksIsBitExact) {
  const fs::path cfg = config("cfg", "mhar", 12);
  const fs::path full = dir / "full", part = dir / "part";
  ASSERT_EQ(run(mhar_cmd(2, "train " + cfg.string() + " --run-dir " + full.string())).rc, 0);
  ASSERT_EQ(run(mhar_cmd(2, "train " + cfg.string() + " --run-dir " + part.string())).rc, 0);
  keep_only_checkpoint(part, 4);
  // Each rank wrote its own optimizer shard.
  EXPECT_TRUE(fs::exists(part / "checkpoints/step_00000004/optimizer.rank0.safetensors"));
  EXPECT_TRUE(fs::exists(part / "checkpoints/step_00000004/optimizer.rank1.safetensors"));
  const Result r = run(mhar_cmd(2, "train --resume " + part.string()));
  ASSERT_EQ(r.rc, 0) << r.out;
  const auto a = losses(full), b = losses(part);
  ASSERT_EQ(a.size(), 12u);
  ASSERT_EQ(b.size(), 12u);
  for (size_t i = 0; i < a.size(); ++i) EXPECT_EQ(a[i], b[i]) << "step " << i + 1;
  EXPECT_EQ(read_bytes(full / "checkpoints/step_00000012/model.safetensors"),
            read_bytes(part / "checkpoints/step_00000012/model.safetensors"));
  for (const char* f : {"optimizer.rank0.safetensors", "optimizer.rank1.safetensors"})
    EXPECT_EQ(read_bytes(full / "checkpoints/step_00000012" / f),
              read_bytes(part / "checkpoints/step_00000012" / f)) << f;
}

TEST_F(DistTest, ResumeOnAnotherNumberOfRanksContinuesTheRun) {
  const fs::path cfg = config("cfg", "mhar", 12);
  // 2 ranks -> 1 process.
  const fs::path two = dir / "two", two_to_one = dir / "two_to_one";
  ASSERT_EQ(run(mhar_cmd(2, "train " + cfg.string() + " --run-dir " + two.string())).rc, 0);
  fs::copy(two, two_to_one, fs::copy_options::recursive);
  keep_only_checkpoint(two_to_one, 4);
  Result r = run(mhar_cmd(0, "train --resume " + two_to_one.string(), "info"));
  ASSERT_EQ(r.rc, 0) << r.out;
  EXPECT_NE(r.out.find("re-sharded"), std::string::npos) << r.out;
  // 1 process -> 2 ranks.
  const fs::path one = dir / "one", one_to_two = dir / "one_to_two";
  ASSERT_EQ(run(mhar_cmd(0, "train " + cfg.string() + " --run-dir " + one.string())).rc, 0);
  fs::copy(one, one_to_two, fs::copy_options::recursive);
  keep_only_checkpoint(one_to_two, 4);
  r = run(mhar_cmd(2, "train --resume " + one_to_two.string()));
  ASSERT_EQ(r.rc, 0) << r.out;
  const auto a = losses(two), a2 = losses(two_to_one), b = losses(one), b2 = losses(one_to_two);
  ASSERT_EQ(a2.size(), 12u);
  ASSERT_EQ(b2.size(), 12u);
  for (size_t i = 4; i < 12; ++i) {
    EXPECT_LT(std::fabs(a2[i] - a[i]) / a[i], 1e-6) << "2 -> 1 ranks, step " << i + 1;
    EXPECT_LT(std::fabs(b2[i] - b[i]) / b[i], 1e-6) << "1 -> 2 ranks, step " << i + 1;
  }
  std::printf("[ dist ] resume 2 -> 1 ranks: max rel diff %.2e; 1 -> 2 ranks: %.2e (bound 1e-6)\n",
              max_rel_diff(a2, a, 4), max_rel_diff(b2, b, 4));
}

// The process ids of the ranks of a running job, by rank: the processes whose command
// line names the job's unique run directory and whose environment holds Open MPI's rank.
std::vector<int> rank_pids(const fs::path& run_dir, int ranks, double timeout_s) {
  const auto t0 = std::chrono::steady_clock::now();
  const std::string marker = run_dir.string();
  std::vector<int> pids(size_t(ranks), 0);
  while (std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() < timeout_s) {
    for (const auto& e : fs::directory_iterator("/proc")) {
      const std::string name = e.path().filename().string();
      if (name.find_first_not_of("0123456789") != std::string::npos) continue;
      std::ifstream cmd(e.path() / "cmdline", std::ios::binary);
      const std::string cmdline((std::istreambuf_iterator<char>(cmd)), {});
      if (cmdline.find(marker) == std::string::npos || cmdline.find("mpirun") != std::string::npos)
        continue;
      std::ifstream env(e.path() / "environ", std::ios::binary);
      const std::string all((std::istreambuf_iterator<char>(env)), {});
      const std::string key = "OMPI_COMM_WORLD_RANK=";
      const size_t at = all.find(key);
      if (at == std::string::npos) continue;
      const int r = std::atoi(all.c_str() + at + key.size());
      if (r >= 0 && r < ranks) pids[size_t(r)] = std::stoi(name);
    }
    if (std::count(pids.begin(), pids.end(), 0) == 0) return pids;
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  return {};
}

// True once `pid` has exited (gone, or a zombie waiting to be reaped) within `timeout_s`.
bool process_gone(int pid, double timeout_s) {
  const auto t0 = std::chrono::steady_clock::now();
  do {
    std::ifstream stat("/proc/" + std::to_string(pid) + "/stat");
    std::string line;
    if (!std::getline(stat, line)) return true;
    const size_t close = line.rfind(')');
    if (close != std::string::npos && close + 2 < line.size() && line[close + 2] == 'Z') return true;
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  } while (std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() < timeout_s);
  return false;
}

// mpirun started in the background with its output in a file; the test signals it or
// its ranks and waits for it.
struct Job {
  pid_t pid = -1;
  fs::path log;
  bool done = false;
  Job() = default;
  Job(const Job&) = delete;
  Job& operator=(const Job&) = delete;
  Job(Job&& o) noexcept : pid(o.pid), log(o.log), done(o.done) { o.pid = -1; }
  // A job a failed assertion left running is killed with its ranks (its process group).
  ~Job() {
    if (pid > 0 && !done) {
      ::kill(-pid, SIGKILL);
      int status = 0;
      waitpid(pid, &status, 0);
    }
  }
  int wait(double timeout_s, double* seconds) {
    const auto t0 = std::chrono::steady_clock::now();
    for (;;) {
      int status = 0;
      const pid_t w = waitpid(pid, &status, WNOHANG);
      *seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      if (w == pid) {
        done = true;
        return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
      }
      if (*seconds > timeout_s) {
        ::kill(-pid, SIGKILL);
        waitpid(pid, &status, 0);
        done = true;
        return -1;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(100));
    }
  }
};

Job start_job(const std::string& args, const fs::path& log, const std::string& env = "") {
  Job j;
  std::fflush(nullptr);
  j.log = log;
  j.pid = fork();
  if (j.pid == 0) {
    setpgid(0, 0);  // mpirun and its ranks in a group of their own (see ~Job)
    const std::string cmd = "exec env OMP_NUM_THREADS=1 " + env + " " + mhar_cmd(2, args) +
                            " >" + log.string() + " 2>&1";
    execl("/bin/sh", "sh", "-c", cmd.c_str(), static_cast<char*>(nullptr));
    _exit(127);
  }
  return j;
}

// Waits until the run has written `n` train lines (the ranks are past start-up).
bool wait_for_steps(const fs::path& run, size_t n, double timeout_s) {
  const auto t0 = std::chrono::steady_clock::now();
  while (std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() < timeout_s) {
    std::ifstream in(run / "metrics.jsonl");
    std::string line;
    size_t count = 0;
    while (std::getline(in, line))
      if (line.find("\"train\"") != std::string::npos) ++count;
    if (count >= n) return true;
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  return false;
}

TEST_F(DistTest, SigtermToOneRankStopsEveryRankWithOneCheckpoint) {
  for (const bool to_mpirun : {false, true}) {
    const fs::path cfg = config(to_mpirun ? "cfg_usr1" : "cfg_term", "standard", 100000, 64, 0);
    const fs::path run_dir = dir / (to_mpirun ? "usr1" : "term");
    Job job = start_job("train " + cfg.string() + " --run-dir " + run_dir.string(), dir / "job.log");
    const auto pids = rank_pids(run_dir, 2, 60);
    ASSERT_EQ(pids.size(), 2u) << read_bytes(job.log);
    ASSERT_TRUE(wait_for_steps(run_dir, 3, 60)) << read_bytes(job.log);
    // Rank 1 alone is told to stop (or mpirun, which forwards SIGUSR1 to every rank).
    ::kill(to_mpirun ? job.pid : pids[1], to_mpirun ? SIGUSR1 : SIGTERM);
    double seconds = 0;
    const int rc = job.wait(60, &seconds);
    const std::string out = read_bytes(job.log);
    EXPECT_EQ(rc, 0) << out;
    std::vector<std::string> ckpts;
    for (const auto& e : fs::directory_iterator(run_dir / "checkpoints")) ckpts.push_back(e.path().string());
    ASSERT_EQ(ckpts.size(), 1u) << out;
    const fs::path ck = ckpts[0];
    for (const char* f : {"model.safetensors", "optimizer.rank0.safetensors",
                          "optimizer.rank1.safetensors", "state.json"})
      EXPECT_TRUE(fs::exists(ck / f)) << f;
    const auto st = nlohmann::json::parse(read_bytes(ck / "state.json"));
    EXPECT_EQ(st["world_size"], 2);
    EXPECT_EQ(st["step"].get<size_t>(), read_metrics(run_dir, "train").size());
    std::printf("[ dist ] %s: every rank stopped at step %zu, exit %d after %.1f s\n",
                to_mpirun ? "SIGUSR1 to mpirun" : "SIGTERM to rank 1", st["step"].get<size_t>(),
                rc, seconds);
  }
}

TEST_F(DistTest, KilledRankEndsTheJobWithAnErrorNamingIt) {
  const fs::path cfg = config("cfg", "standard", 100000, 64, 5);
  const fs::path run_dir = dir / "run";
  Job job = start_job("train " + cfg.string() + " --run-dir " + run_dir.string(), dir / "job.log");
  const auto pids = rank_pids(run_dir, 2, 60);
  ASSERT_EQ(pids.size(), 2u) << read_bytes(job.log);
  ASSERT_TRUE(wait_for_steps(run_dir, 7, 60)) << read_bytes(job.log);
  ::kill(pids[1], SIGKILL);
  double seconds = 0;
  const int rc = job.wait(60, &seconds);
  const std::string out = read_bytes(job.log);
  EXPECT_NE(rc, 0) << out;
  EXPECT_NE(rc, -1) << "the job did not end within 60 s:\n" << out;
  EXPECT_LT(seconds, mhar::test::wall_clock_bound(60));
  EXPECT_NE(out.find("rank 1"), std::string::npos) << out;
  // Rank 0 is gone too (mpirun or its watchdog ended it), and the checkpoints on disk are
  // whole: the newest one validates.
  EXPECT_TRUE(process_gone(pids[0], 10)) << "rank 0 still runs";
  std::printf("%s", out.c_str());
  const Result v = run(mhar_cmd(0, "eval --checkpoint " + run_dir.string() + " --data '" +
                                      (dir / "data/val_*.bin").string() + "' --device cpu"));
  std::printf("[ dist ] killed rank 1: job ended after %.1f s, exit %d; newest checkpoint "
              "evaluates: exit %d\n", seconds, rc, v.rc);
  EXPECT_EQ(v.rc, 0) << v.out;
}

TEST_F(DistTest, StoppedRankEndsTheJobAfterTheStepTimeout) {
  const fs::path cfg = config("cfg", "standard", 100000, 64, 0);
  const fs::path run_dir = dir / "run";
  Job job = start_job("train " + cfg.string() + " --run-dir " + run_dir.string(), dir / "job.log",
                      "MHAR_STEP_TIMEOUT_S=5");
  const auto pids = rank_pids(run_dir, 2, 60);
  ASSERT_EQ(pids.size(), 2u) << read_bytes(job.log);
  ASSERT_TRUE(wait_for_steps(run_dir, 3, 60)) << read_bytes(job.log);
  ::kill(pids[1], SIGSTOP);  // hangs: alive, never reaches the next collective
  double seconds = 0;
  const int rc = job.wait(60, &seconds);
  ::kill(pids[1], SIGKILL);  // in case it outlived mpirun
  const std::string out = read_bytes(job.log);
  EXPECT_NE(rc, 0) << out;
  EXPECT_NE(rc, -1) << "the job did not end within 60 s:\n" << out;
  EXPECT_NE(out.find("rank 1 (pid " + std::to_string(pids[1]) + ") is stopped"), std::string::npos)
      << out;
  std::printf("[ dist ] stopped rank 1 (MHAR_STEP_TIMEOUT_S=5): job ended after %.1f s, exit %d\n",
              seconds, rc);
}

TEST_F(DistTest, GlobalBatchThatDoesNotSplitOverTheRanksIsAClearError) {
  // 3 micro-batches of 32 tokens do not split over 2 ranks.
  const fs::path cfg = config("cfg", "standard", 10, 96);
  const Result r = run(mhar_cmd(2, "train " + cfg.string() + " --run-dir " + (dir / "run").string()));
  EXPECT_NE(r.rc, 0) << r.out;
  EXPECT_NE(r.out.find("train.batch_tokens = 96 is not a multiple of"), std::string::npos) << r.out;
  EXPECT_LT(r.seconds, mhar::test::wall_clock_bound(30)) << r.out;
}

}  // namespace
