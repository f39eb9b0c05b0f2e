// delta_convert_test.cpp: `mhar convert --mode delta` end to end on the CPU, on real text
// (the repo's own DESIGN.md and README.md through the bundled 4096-token tokenizer):
// - a trained standard checkpoint converts into a run directory whose weights are the
//   original ones bit for bit, whose delta parameters are at their init, whose config is
//   mode delta and whose checkpoint is step 0 with no data position (a new run);
// - the converted model's logits equal the original's exactly (max |diff| = 0, fp32);
// - continued training (`train --init-from`) starts where the standard model is: its
//   first loss equals a standard run's from the same weights, bit for bit; the loss
//   falls; and a stop/resume of that run reproduces every loss and the final weights;
// - refusals: a non-standard checkpoint, an existing --out, --block-layers and --heads
//   out of range, each naming what is wrong; `mhar export` of a delta model (not built:
//   refused naming the mode); the CLI's --help and exit codes.
#include <gtest/gtest.h>
#include <unistd.h>

#include <cmath>
#include <cstdio>
#include <filesystem>

#include "data/shard.h"
#include "data/tokenizer.h"
#include "engine/checkpoint.h"
#include "engine/delta_convert.h"
#include "engine/error.h"
#include "engine/hf_export.h"
#include "engine/safetensors.h"
#include "engine/trainer.h"
#include "tests/data_test_util.h"
#include "tests/model_test_util.h"
#include "tests/process_test_util.h"

namespace fs = std::filesystem;
using namespace mhar;
using mhar::test::download;
using mhar::test::read_bytes;
using mhar::test::read_metrics;
using mhar::test::run_command;

namespace {

class DeltaConvert : public ::testing::Test {
 protected:
  fs::path dir;
  std::vector<int32_t> text;  // the real text, tokenized

  void SetUp() override {
    dir = fs::temp_directory_path() /
          ("mhar_delta_convert_" + std::to_string(::getpid()) + "_" +
           ::testing::UnitTest::GetInstance()->current_test_info()->name());
    fs::remove_all(dir);
    fs::create_directories(dir / "data");
    const std::string src = MHAR_SOURCE_DIR;
    const auto tok = data::Tokenizer::load(src + "/tests/fixtures/tokenizer/trained_4096.json");
    for (const char* doc : {"/DESIGN.md", "/README.md"}) {
      const auto bytes = read_bytes(src + doc);
      const auto ids = tok.encode(std::string(bytes.begin(), bytes.end()));
      text.insert(text.end(), ids.begin(), ids.end());
    }
    ASSERT_GT(text.size(), 8000u);
    const size_t cut = text.size() * 9 / 10;
    data::write_shard((dir / "data/train_000.bin").string(),
                      std::vector<int32_t>(text.begin(), text.begin() + long(cut)), 2);
    data::write_shard((dir / "data/val_000.bin").string(),
                      std::vector<int32_t>(text.begin() + long(cut), text.end()), 2);
  }
  void TearDown() override { fs::remove_all(dir); }

  Config config(const char* mode, int steps) {
    nlohmann::json j = {
        {"model", {{"vocab_size", 4096}, {"d_model", 32}, {"n_layers", 2}, {"n_heads", 4},
                   {"n_kv_heads", 2}, {"head_dim", 8}, {"d_ff", 64}, {"context_length", 32}}},
        {"residual", {{"mode", mode}}},
        {"train", {{"micro_batch", 4}, {"seq_len", 32}, {"steps", steps}, {"lr", 1e-2},
                   {"warmup_steps", 2}, {"eval_every", 100}, {"eval_batches", 2},
                   {"device", "cpu"}, {"seed", 7}}},
        {"data", {{"train", (dir / "data/train_*.bin").string()},
                  {"val", (dir / "data/val_*.bin").string()}}},
        {"checkpoint", {{"every", 100}, {"keep", 0}}}};
    if (std::string(mode) == "delta") j["residual"]["block_layers"] = 1;
    return config_from_json(j, "delta_convert_test");
  }
  TrainOptions options(const std::string& run) {
    TrainOptions o;
    o.run_dir = (dir / run).string();
    o.quiet = true;
    return o;
  }
  // A trained standard checkpoint (12 steps on the text).
  std::string trained_standard() {
    const TrainResult r = train(config("standard", 12), options("standard"));
    EXPECT_EQ(r.step, 12);
    return r.last_checkpoint;
  }
  DeltaConvertResult convert(const std::string& ckpt, const std::string& out, int block_layers = 1,
                             int heads = 0) {
    DeltaConvertOptions o;
    o.checkpoint = ckpt;
    o.out_dir = (dir / out).string();
    o.block_layers = block_layers;
    o.heads = heads;
    return convert_to_delta(o);
  }
};

void expect_error(const std::function<void()>& f, const std::vector<std::string>& needles) {
  try {
    f();
    ADD_FAILURE() << "no error";
  } catch (const Error& e) {
    const std::string what = e.what();
    for (const auto& n : needles) EXPECT_NE(what.find(n), std::string::npos) << what;
  }
}

TEST_F(DeltaConvert, WeightsAreKeptBitForBitAndLogitsAreEqualOnRealText) {
  const std::string ckpt = trained_standard();
  const DeltaConvertResult r = convert(ckpt, "converted");
  EXPECT_EQ(r.heads, 2);  // n_kv_heads
  EXPECT_EQ(r.block_layers, 1);
  const CheckpointInfo a = open_checkpoint(ckpt), b = open_checkpoint(r.run_dir);
  EXPECT_EQ(b.step, 0);
  EXPECT_TRUE(b.loader.empty());  // a new run: no data position to resume
  EXPECT_EQ(b.config.residual.mode, ResidualMode::Delta);
  EXPECT_EQ(b.config.residual.block_layers, 1);
  EXPECT_EQ(b.config.residual.heads, 2);
  EXPECT_EQ(b.config.to_json()["model"], a.config.to_json()["model"]);

  // The original tensors bit for bit (F32 both), the added ones at their init.
  const SafetensorsFile fa = SafetensorsFile::load(a.dir + "/model.safetensors");
  const SafetensorsFile fb = SafetensorsFile::load(b.dir + "/model.safetensors");
  size_t added = 0;
  for (const std::string& name : fb.names()) {
    ASSERT_EQ(fb.entry(name).dtype, "F32") << name;
    const auto vb = fb.to_f64(name);
    if (name.rfind("model.delta.", 0) == 0) {
      ++added;
      const bool gain = name.size() > 5 && name.compare(name.size() - 5, 5, ".gain") == 0;
      for (double x : vb) ASSERT_EQ(x, gain ? 1.0 : 0.0) << name;
      continue;
    }
    const auto va = fa.to_f64(name);
    ASSERT_EQ(va.size(), vb.size()) << name;
    for (size_t i = 0; i < va.size(); ++i)
      ASSERT_TRUE(va[i] == vb[i] && std::signbit(va[i]) == std::signbit(vb[i])) << name << " " << i;
  }
  EXPECT_EQ(fb.names().size(), fa.names().size() + added);
  EXPECT_EQ(added, 3u * 5 + 1);  // alpha, query, gain per site (2L + 1 = 5) and the null

  // Logits on real text (the validation part, unseen in training), fp32 CPU.
  auto be = make_cpu_backend(DType::F32);
  const int B = 2, T = 32;
  Model ms(a.config.model, a.config.residual, *be, B, T), md(b.config.model, b.config.residual, *be, B, T);
  load_model_weights(a, ms);
  load_model_weights(b, md);
  double worst = 0;
  size_t compared = 0;
  for (size_t start = text.size() * 9 / 10; start + B * T + 1 <= text.size() && compared < 8;
       start += B * T, ++compared) {
    std::vector<int32_t> tok(text.begin() + long(start), text.begin() + long(start + B * T));
    std::vector<int32_t> tgt(text.begin() + long(start + 1), text.begin() + long(start + B * T + 1));
    const double ls = ms.forward(tok.data(), tgt.data(), 0.0);
    const double ld = md.forward(tok.data(), tgt.data(), 0.0);
    EXPECT_EQ(ls, ld);
    const auto xs = download(*be, ms.logits()), xd = download(*be, md.logits());
    ASSERT_EQ(xs.size(), xd.size());
    for (size_t i = 0; i < xs.size(); ++i) worst = std::max(worst, std::abs(xs[i] - xd[i]));
  }
  EXPECT_EQ(compared, 8u);
  EXPECT_EQ(worst, 0.0);
  std::printf("[ convert ] max |logit difference| over %zu batches of %d x %d real-text tokens: %g\n",
              compared, B, T, worst);
}

TEST_F(DeltaConvert, ContinuedTrainingStartsWhereStandardIsAndResumesBitExactly) {
  const std::string ckpt = trained_standard();
  const DeltaConvertResult conv = convert(ckpt, "converted");
  Config dcfg = config("delta", 10);
  Config scfg = config("standard", 10);

  // The same weights, the same data order: step 1's loss is the standard model's, exactly.
  TrainOptions s = options("cont_standard");
  s.init_from = ckpt;
  s.stop_after_steps = 1;
  train(scfg, s);
  TrainOptions o = options("cont_full");
  o.init_from = conv.run_dir;
  const TrainResult full = train(dcfg, o);
  ASSERT_EQ(full.step, 10);
  const auto first_std = read_metrics(dir / "cont_standard", "train");
  auto a = read_metrics(dir / "cont_full", "train");
  ASSERT_GE(first_std.size(), 1u);
  ASSERT_EQ(a.size(), 10u);
  EXPECT_EQ(a[0]["loss"].get<double>(), first_std[0]["loss"].get<double>());
  // Training lowers the held-out loss: the same validation batches at steps 0 and 10. (Step
  // 1's and step 10's training losses are different batches of the text; their order says
  // more about which text each holds, and changed when the repo's docs, the text, did.)
  const auto ev = read_metrics(dir / "cont_full", "eval");
  ASSERT_GE(ev.size(), 2u);
  EXPECT_EQ(ev.front()["step"].get<long long>(), 0);
  EXPECT_EQ(ev.back()["step"].get<long long>(), 10);
  EXPECT_LT(ev.back()["val_loss"].get<double>(), ev.front()["val_loss"].get<double>());
  std::printf("[ convert ] continued delta training: val loss %.4f -> %.4f in 10 steps (train "
              "loss %.4f -> %.4f; standard's step 1: %.4f)\n",
              ev.front()["val_loss"].get<double>(), ev.back()["val_loss"].get<double>(),
              a[0]["loss"].get<double>(), a.back()["loss"].get<double>(),
              first_std[0]["loss"].get<double>());

  // Stopped after step 4 (between checkpoints) and resumed: the same run, bit for bit.
  TrainOptions p = options("cont_split");
  p.init_from = conv.run_dir;
  p.stop_after_steps = 4;
  const TrainResult part = train(dcfg, p);
  EXPECT_TRUE(part.interrupted);
  TrainOptions r = options("cont_split");
  r.resume = true;
  const TrainResult rest = train(Config(), r);
  EXPECT_EQ(rest.step, 10);
  auto b = read_metrics(dir / "cont_split", "train");
  ASSERT_EQ(b.size(), 10u);
  for (size_t i = 0; i < a.size(); ++i) {
    EXPECT_EQ(a[i]["loss"].get<double>(), b[i]["loss"].get<double>()) << "step " << i + 1;
    EXPECT_EQ(a[i]["grad_norm"].get<double>(), b[i]["grad_norm"].get<double>()) << "step " << i + 1;
  }
  EXPECT_EQ(read_bytes(fs::path(full.last_checkpoint) / "model.safetensors"),
            read_bytes(fs::path(rest.last_checkpoint) / "model.safetensors"));
  // The gates moved: the routed term is being learned.
  const CheckpointInfo last = open_checkpoint(rest.last_checkpoint);
  const SafetensorsFile f = SafetensorsFile::load(last.dir + "/model.safetensors");
  double gates = 0;
  for (int j = 0; j < 5; ++j) gates += std::abs(f.to_f64("model.delta." + std::to_string(j) + ".alpha")[0]);
  EXPECT_GT(gates, 0);
}

TEST_F(DeltaConvert, RefusalsNameWhatIsWrong) {
  const std::string ckpt = trained_standard();
  const DeltaConvertResult conv = convert(ckpt, "converted");
  // A delta checkpoint is not standard.
  expect_error([&] { convert(conv.run_dir, "again"); },
               {"step_00000000", "residual.mode is \"delta\"", "\"standard\" model only"});
  EXPECT_FALSE(fs::exists(dir / "again"));
  // --out exists: never replaced silently, and left as it was.
  const auto before = read_bytes(fs::path(conv.checkpoint_dir) / "model.safetensors");
  expect_error([&] { convert(ckpt, "converted"); }, {"converted", "already exists", "--overwrite"});
  EXPECT_EQ(read_bytes(fs::path(conv.checkpoint_dir) / "model.safetensors"), before);
  expect_error([&] { convert(ckpt, "b3", 3); }, {"--block-layers 3", "model.n_layers = 2", "1..2"});
  expect_error([&] { convert(ckpt, "b0", 0); }, {"--block-layers 0", "1..2"});
  expect_error([&] { convert(ckpt, "h3", 1, 3); }, {"--heads 3", "model.d_model = 32"});
  expect_error([&] { convert(ckpt, "standard"); }, {"overlaps"});
  for (const char* d : {"b3", "b0", "h3"}) EXPECT_FALSE(fs::exists(dir / d)) << d;
  // A converted model exports to Hugging Face like any delta model (tests/hf_export_test.cpp).
  const CheckpointInfo converted = open_checkpoint(conv.run_dir);
  EXPECT_NO_THROW(require_exportable(converted.config.residual, converted.dir));

  // The command line: --help, success and a refusal with exit code 1.
  const std::string bin = MHAR_BINARY;
  auto help = run_command(bin + " convert --help 2>&1");
  EXPECT_EQ(help.rc, 0);
  for (const char* s : {"--checkpoint", "--out", "--mode", "--block-layers", "--heads", "--init-from"})
    EXPECT_NE(help.out.find(s), std::string::npos) << s << "\n" << help.out;
  auto ok = run_command(bin + " --log-level error convert --checkpoint " + ckpt + " --out " +
                        (dir / "cli").string() + " --mode delta --block-layers 2 --heads 4 2>&1");
  EXPECT_EQ(ok.rc, 0) << ok.out;
  EXPECT_EQ(open_checkpoint((dir / "cli").string()).config.residual.block_layers, 2);
  EXPECT_EQ(open_checkpoint((dir / "cli").string()).config.residual.heads, 4);
  // The documented next step: a new run from the converted directory's own config.
  auto cont = run_command(bin + " --log-level error train " + (dir / "cli" / "config.json").string() +
                          " --init-from " + (dir / "cli").string() + " --run-dir " +
                          (dir / "cli_run").string() + " --steps 2 --device cpu 2>&1");
  EXPECT_EQ(cont.rc, 0) << cont.out;
  EXPECT_EQ(read_metrics(dir / "cli_run", "train").size(), 2u) << cont.out;
  // --resume of the converted directory itself is refused (a new run: no data position).
  auto resume = run_command(bin + " --log-level error train --resume " + (dir / "cli").string() + " 2>&1");
  EXPECT_EQ(resume.rc, 1) << resume.out;
  EXPECT_NE(resume.out.find("no data position (an `mhar convert`"), std::string::npos) << resume.out;
  EXPECT_NE(resume.out.find("--init-from"), std::string::npos) << resume.out;
  auto bad = run_command(bin + " --log-level error convert --checkpoint " + ckpt + " --out " +
                         (dir / "cli2").string() + " --mode hyper 2>&1");
  EXPECT_NE(bad.rc, 0);
  EXPECT_NE(bad.out.find("delta"), std::string::npos) << bad.out;
  auto exists = run_command(bin + " --log-level error convert --checkpoint " + ckpt + " --out " +
                            (dir / "cli").string() + " --mode delta --block-layers 1 2>&1");
  EXPECT_EQ(exists.rc, 1) << exists.out;
  EXPECT_NE(exists.out.find("already exists"), std::string::npos) << exists.out;
}

}  // namespace
