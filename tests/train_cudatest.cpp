// train_cudatest.cpp: training on the GPU is bitwise reproducible. Two runs of one config
// that multiply with the same matmul algorithms give the same bits at every step, and a run
// stopped and resumed gives the bits of the run that never stopped: no op adds with
// atomics (the embedding and norm weight gradients were the last), and the run directory
// keeps the timed matmul choices of its first process for the later ones
// (engine/trainer.cpp, TimedChoices). Each "process" here starts from
// cuda::matmul_forget_plans(), as a new process would; the second run is handed the first
// run's choices file, as `cp` would, so that both multiply alike.
#include <gtest/gtest.h>
#include <unistd.h>

#include <filesystem>

#include "cuda/device.h"
#include "cuda/kernels.h"
#include "data/shard.h"
#include "engine/config.h"
#include "engine/trainer.h"
#include "tests/data_test_util.h"
#include "tests/model_test_util.h"
#include "tests/process_test_util.h"

namespace fs = std::filesystem;

namespace mhar::test {
namespace {

class GpuReproducible : public ::testing::TestWithParam<const char*> {
 protected:
  fs::path dir;
  void SetUp() override {
    if (cuda::device_count() == 0) GTEST_SKIP() << "no CUDA device";
    dir = fs::temp_directory_path() /
          ("mhar_train_cudatest_" + std::to_string(::getpid()) + "_" + std::string(GetParam()));
    fs::remove_all(dir);
    fs::create_directories(dir / "data");
    data::write_shard((dir / "data/train_000.bin").string(), markov_tokens(40000, 1), 2);
    data::write_shard((dir / "data/val_000.bin").string(), markov_tokens(8000, 3), 2);
  }
  void TearDown() override {
    if (!dir.empty()) fs::remove_all(dir);
  }
  // The tiny GPU model of model_cudatest.cpp (model_test_util.h; mhar with 2 routing heads
  // of 64 features), two micro-batches a step, checkpoints every 3 steps.
  Config config(int steps) {
    nlohmann::json j = {
        {"model", tiny_gpu_model_json(32, 64)},
        {"residual", {{"mode", GetParam()}, {"heads", std::string(GetParam()) == "mhar" ? 2 : 0}}},
        {"train",
         {{"micro_batch", 8},
          {"seq_len", 64},
          {"batch_tokens", 2 * 8 * 64},
          {"steps", steps},
          {"lr", 3e-3},
          {"warmup_steps", 2},
          {"eval_every", 100},
          {"eval_batches", 4},
          {"device", "cuda"},
          {"seed", 7}}},
        {"data",
         {{"train", (dir / "data/train_*.bin").string()},
          {"val", (dir / "data/val_*.bin").string()}}},
        {"checkpoint", {{"every", 3}, {"keep", 0}}}};
    return config_from_json(j, "train_cudatest");
  }
  TrainOptions options(const std::string& run) {
    TrainOptions o;
    o.run_dir = (dir / run).string();
    o.quiet = true;
    return o;
  }
};

TEST_P(GpuReproducible, StoppedAndResumedRunHasTheBitsOfOneRun) {
  const std::string mode = GetParam();
  constexpr int kSteps = 6;
  cuda::matmul_forget_plans();
  const TrainResult full = train(config(kSteps), options("full"));
  ASSERT_EQ(full.step, kSteps);
  const fs::path choices = dir / "full" / "timed_choices.rank0.txt";
  ASSERT_TRUE(fs::exists(choices)) << mode << ": the first run kept no timed choices";
  const int timed = cuda::matmul_timed_shapes();

  fs::create_directories(dir / "split");
  fs::copy_file(choices, dir / "split" / "timed_choices.rank0.txt");
  cuda::matmul_forget_plans();
  TrainOptions first = options("split");
  first.stop_after_steps = 3;
  const TrainResult part = train(config(kSteps), first);
  ASSERT_TRUE(part.interrupted) << mode;
  ASSERT_EQ(part.step, 3) << mode;
  cuda::matmul_forget_plans();
  TrainOptions rest = options("split");
  rest.resume = true;
  const TrainResult resumed = train(Config(), rest);
  ASSERT_EQ(resumed.step, kSteps) << mode;
  // Both processes of the split run took every choice from the file.
  EXPECT_EQ(cuda::matmul_timed_shapes(), timed) << mode << ": the split run timed shapes";

  const auto a = read_metrics(dir / "full", "train"), b = read_metrics(dir / "split", "train");
  ASSERT_EQ(a.size(), size_t(kSteps));
  ASSERT_EQ(b.size(), size_t(kSteps));
  for (size_t i = 0; i < a.size(); ++i) {
    EXPECT_EQ(a[i]["loss"].get<double>(), b[i]["loss"].get<double>()) << mode << " step " << i + 1;
    EXPECT_EQ(a[i]["grad_norm"].get<double>(), b[i]["grad_norm"].get<double>())
        << mode << " step " << i + 1;
  }
  EXPECT_EQ(read_bytes((fs::path(full.last_checkpoint) / "model.safetensors").string()),
            read_bytes((fs::path(resumed.last_checkpoint) / "model.safetensors").string()))
      << mode << ": the weights differ";
}

INSTANTIATE_TEST_SUITE_P(Modes, GpuReproducible, ::testing::Values("standard", "mhar"),
                         [](const ::testing::TestParamInfo<const char*>& p) {
                           return std::string(p.param);
                         });

}  // namespace
}  // namespace mhar::test
