// bench_test.cpp: `mhar bench` on a tiny config on the CPU (so CI runs it): exit 0, exactly
// one JSON line on stdout with the documented fields and sane values, and a clean error for
// bad arguments.
#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <string>

#include <nlohmann/json.hpp>

#include "tests/process_test_util.h"

namespace fs = std::filesystem;

namespace {

using Result = mhar::test::CommandResult;

// `mhar ARGS`, its stdout alone (the JSON line).
Result run(const std::string& args) {
  return mhar::test::run_command(std::string(MHAR_BINARY) + " --log-level error " + args + " 2>/dev/null");
}

class BenchTest : public ::testing::Test {
 protected:
  fs::path dir, cfg;
  void SetUp() override {
    dir = fs::temp_directory_path() / ("mhar_bench_test_" + std::to_string(::getpid()));
    fs::create_directories(dir);
    cfg = dir / "tiny.json";
    std::ofstream(cfg) << R"({
      "model": {"vocab_size": 64, "d_model": 32, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2,
                "head_dim": 8, "d_ff": 64, "context_length": 32},
      "residual": {"mode": "mhar", "heads": 2},
      "train": {"micro_batch": 2, "seq_len": 16}
    })";
  }
  void TearDown() override { fs::remove_all(dir); }
};

TEST_F(BenchTest, PrintsOneJsonLineOnCpu) {
  const Result r = run("bench " + cfg.string() + " --device cpu --steps 3 --warmup 1");
  ASSERT_EQ(r.rc, 0) << r.out;
  // Exactly one line on stdout.
  ASSERT_FALSE(r.out.empty());
  EXPECT_EQ(r.out.find('\n'), r.out.size() - 1) << r.out;
  const auto j = nlohmann::json::parse(r.out);
  EXPECT_EQ(j.at("mode"), "mhar");
  EXPECT_EQ(j.at("heads"), 2);
  EXPECT_EQ(j.at("device"), "cpu");
  EXPECT_EQ(j.at("micro_batch"), 2);
  EXPECT_EQ(j.at("seq_len"), 16);
  EXPECT_EQ(j.at("steps_timed"), 3);
  EXPECT_EQ(j.at("warmup"), 1);
  // Parameters: embedding 64*32 (tied); per layer 2 norms (32), q 32x32, k and v 16x32 each,
  // o 32x32, q/k norms (8), gate/up 64x32, down 32x64; final norm; 5 sites x (query, gain).
  const long long per_layer = 2 * 32 + 32 * 32 + 2 * 16 * 32 + 32 * 32 + 2 * 8 + 3 * 64 * 32;
  const long long params = 64 * 32 + 2 * per_layer + 32 + 5 * 2 * 32;
  EXPECT_EQ(j.at("params").get<long long>(), params);
  EXPECT_EQ(j.at("params_nonembedding").get<long long>(), params - 64 * 32);
  EXPECT_GT(j.at("tokens_per_s").get<double>(), 0);
  const double ms = j.at("ms_per_step").get<double>();
  EXPECT_GT(ms, 0);
  EXPECT_LE(j.at("ms_per_step_min").get<double>(), ms);
  EXPECT_GE(j.at("ms_per_step_max").get<double>(), ms);
  EXPECT_NEAR(j.at("tokens_per_s").get<double>(), 2 * 16 / (ms / 1e3), 0.01 * 2 * 16 / (ms / 1e3));
  EXPECT_EQ(j.at("peak_mem_method"), "arenas");
  EXPECT_GT(j.at("peak_mem_bytes").get<long long>(), 0);
  EXPECT_EQ(j.at("peak_mem_bytes").get<long long>(), j.at("arena_bytes").get<long long>());
  // flops_per_token: 6 * (2 * (32*(2*32 + 2*16) + 3*32*64) + 32*64) + 6 * 2 * 16 * 32.
  const double fpt = 6.0 * (2 * (32 * (2 * 32 + 2 * 16) + 3 * 32 * 64) + 32 * 64) + 6.0 * 2 * 16 * 32;
  EXPECT_DOUBLE_EQ(j.at("flops_per_token").get<double>(), fpt);
  // mfu is computed from the unrounded tokens/s (the JSON rounds tokens_per_s to 0.1).
  const double mfu = j.at("tokens_per_s").get<double>() * fpt / 989e12;
  EXPECT_NEAR(j.at("mfu").get<double>(), mfu, 1e-3 * mfu);
  const double loss = j.at("loss").get<double>();
  EXPECT_TRUE(std::isfinite(loss));
  EXPECT_GT(loss, 0);
}

TEST_F(BenchTest, SetOverridesAndStandardMode) {
  const Result r = run("bench " + cfg.string() +
                       " --device cpu --steps 1 --warmup 0 --set residual.mode=standard"
                       " --set residual.heads=0 --set train.micro_batch=1");
  ASSERT_EQ(r.rc, 0) << r.out;
  const auto j = nlohmann::json::parse(r.out);
  EXPECT_EQ(j.at("mode"), "standard");
  EXPECT_EQ(j.at("micro_batch"), 1);
}

// --profile's roofline for the memory-bound families: on a GPU the copy rate measured in
// the run (tests/device_cudatest.cpp checks the measurement); on the CPU nothing to
// measure, so the H200's 4.3 TB/s stands in and the JSON says why.
TEST_F(BenchTest, ProfileNamesItsCopyRoofline) {
  const Result r = run("bench " + cfg.string() + " --device cpu --steps 1 --warmup 0 --profile 1");
  ASSERT_EQ(r.rc, 0) << r.out;
  const auto p = nlohmann::json::parse(r.out).at("profile");
  EXPECT_DOUBLE_EQ(p.at("peak_tflops").get<double>(), 989.0);
  EXPECT_DOUBLE_EQ(p.at("peak_tbps").get<double>(), 4.3);
  const std::string method = p.at("copy_rate_method");
  EXPECT_NE(method.find("not measured here"), std::string::npos) << method;
  EXPECT_NE(method.find("cpu"), std::string::npos) << method;
}

TEST_F(BenchTest, RejectsBadArguments) {
  EXPECT_NE(run("bench " + cfg.string() + " --device cpu --steps 0").rc, 0);
  EXPECT_NE(run("bench " + (dir / "missing.json").string() + " --device cpu").rc, 0);
}

}  // namespace
