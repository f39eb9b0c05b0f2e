// sample_device_test.cpp: `mhar sample --device cpu|cuda|auto` through the binary, on a
// tiny run trained here: --device cpu decodes on the fp32 CPU backend; without --device
// the checkpoint's train.device ("cpu" here) is used, with the same text for the same
// seed; auto takes the CPU when no GPU is present; cuda without a GPU (or in a build
// without CUDA) fails with a message saying to use --device cpu, and with one decodes on
// it; an unknown device is refused naming --device. (The GPU decode's numbers are checked
// against the CPU in tests/sample_cudatest.cpp.)
#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>

#include "cuda/device.h"
#include "data/shard.h"
#include "engine/trainer.h"
#include "tests/model_test_util.h"

namespace fs = std::filesystem;
using namespace mhar;

namespace {

class SampleDevice : public ::testing::Test {
 protected:
  fs::path dir;
  std::string run;
  void SetUp() override {
    dir = fs::temp_directory_path() / ("mhar_sample_device_" + std::to_string(::getpid()));
    fs::remove_all(dir);
    fs::create_directories(dir / "data");
    {
      std::ofstream docs(dir / "docs.jsonl");
      for (int d = 0; d < 40; ++d)
        docs << nlohmann::json({{"text", "the cat sat on the mat and the dog ran to the door " +
                                             std::to_string(d)}}).dump() << "\n";
    }
    ASSERT_EQ(mhar("data train-tokenizer --vocab 300 --threads 1 --input " + p("docs.jsonl") +
                       " --out " + p("tok.json"), "tok"), 0) << err("tok");
    data::write_shard(p("data/train_000.bin"), test::markov_tokens(4000, 1), 2);
    data::write_shard(p("data/val_000.bin"), test::markov_tokens(1000, 2), 2);
    // head_dim 64, which the CUDA attention supports, so --device cuda can decode on a GPU.
    nlohmann::json j = {
        {"model", {{"vocab_size", 320}, {"d_model", 64}, {"n_layers", 1}, {"n_heads", 2},
                   {"n_kv_heads", 1}, {"head_dim", 64}, {"d_ff", 128}, {"context_length", 16}}},
        {"residual", {{"mode", "mhar"}, {"heads", 2}}},
        {"train", {{"micro_batch", 2}, {"seq_len", 16}, {"steps", 2}, {"warmup_steps", 1}, {"eval_every", 2},
                   {"eval_batches", 1}, {"device", "cpu"}}},
        {"data", {{"train", p("data/train_*.bin")}, {"val", p("data/val_*.bin")},
                  {"tokenizer", p("tok.json")}}},
        {"checkpoint", {{"every", 0}, {"keep", 1}}}};
    TrainOptions o;
    o.run_dir = p("run");
    o.quiet = true;
    run = train(config_from_json(j, "sample_device_test"), o).last_checkpoint;
    ASSERT_FALSE(run.empty());
  }
  void TearDown() override {
    if (!HasFailure()) fs::remove_all(dir);  // kept for inspection when something failed
  }
  std::string p(const std::string& rel) const { return (dir / rel).string(); }
  // Runs the mhar binary; stdout and stderr go to NAME.out and NAME.err.
  int mhar(const std::string& args, const std::string& name) const {
    const std::string cmd = std::string(MHAR_BINARY) + " --log-level error " + args + " >" +
                            p(name + ".out") + " 2>" + p(name + ".err");
    const int rc = std::system(cmd.c_str());
    return WIFEXITED(rc) ? WEXITSTATUS(rc) : -1;
  }
  std::string slurp(const std::string& name) const {
    std::ifstream in(dir / name, std::ios::binary);
    std::stringstream s;
    s << in.rdbuf();
    return s.str();
  }
  std::string out(const std::string& name) const { return slurp(name + ".out"); }
  std::string err(const std::string& name) const { return slurp(name + ".err"); }
  std::string sample(const std::string& extra) const {
    return "sample --checkpoint " + run + " --prompt 'the cat' --max-tokens 8 --seed 3 " + extra;
  }
};

TEST_F(SampleDevice, DeviceOptionChoosesTheBackend) {
  ASSERT_EQ(mhar(sample("--device cpu"), "cpu"), 0) << err("cpu");
  EXPECT_NE(err("cpu").find("cpu-fp32"), std::string::npos) << err("cpu");
  EXPECT_FALSE(out("cpu").empty());

  // Default: the checkpoint's train.device ("cpu"): the same backend, the same text.
  ASSERT_EQ(mhar(sample(""), "default"), 0) << err("default");
  EXPECT_NE(err("default").find("cpu-fp32"), std::string::npos) << err("default");
  EXPECT_EQ(out("default"), out("cpu"));

  const bool gpu = cuda::device_count() > 0;
  ASSERT_EQ(mhar(sample("--device auto"), "auto"), 0) << err("auto");
  EXPECT_NE(err("auto").find(gpu ? "cuda:0" : "cpu-fp32"), std::string::npos) << err("auto");

  if (gpu) {
    ASSERT_EQ(mhar(sample("--device cuda"), "cuda"), 0) << err("cuda");
    EXPECT_NE(err("cuda").find("cuda:0"), std::string::npos) << err("cuda");
  } else {
    EXPECT_EQ(mhar(sample("--device cuda"), "cuda"), 1);
    EXPECT_NE(err("cuda").find("--device cpu"), std::string::npos) << err("cuda");
  }

  EXPECT_NE(mhar(sample("--device tpu"), "tpu"), 0);
  EXPECT_NE(err("tpu").find("--device"), std::string::npos) << err("tpu");
}

}  // namespace
