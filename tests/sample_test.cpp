// sample_test.cpp: decode mode and sampling (engine/sampler.h), on the fp64 CPU backend.
// - A cached decode (prefill, then chunks of 2 and 1 tokens) gives, at every position,
//   the logits of one full forward over the same prefix, to ~1e-12, in every mode.
// - Greedy generation is deterministic and equals the argmax of full forwards; seeded
//   sampling repeats; top-k and the vocabulary limit are respected.
// - Cost is linear: counted through a Backend decorator, each decoded token runs every
//   matmul on exactly one row, never the full attention op, and attention over exactly
//   the cached positions; the work of a step is a constant plus a term linear in the
//   position (no recomputation of the prefix).
// - A backend without the decode ops fails with a message saying what to do.
// - End to end through the `mhar` binary: a tokenizer and shards made by `mhar data`, a
//   tiny run by `mhar train`, then `mhar sample` (same seed, same text) and `mhar report`.
#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <map>
#include <sstream>

#include "engine/forwarding_backend.h"
#include "engine/sampler.h"
#include "tests/model_test_util.h"

using namespace mhar;
using namespace mhar::test;

namespace {

std::vector<double> full_forward_logits(Model& full, const std::vector<int32_t>& tokens) {
  std::vector<int32_t> targets(tokens.size(), 0);
  full.forward(tokens.data(), targets.data(), 0.0);
  return download(full.backend(), full.logits());
}

double max_abs(const std::vector<double>& v) {
  double m = 0;
  for (double x : v) m = std::max(m, std::fabs(x));
  return m;
}

struct ModeCase {
  const char* label;
  ResidualMode mode;
  int heads;
  int block_size = 0;
};

void PrintTo(const ModeCase& c, std::ostream* os) { *os << c.label; }

class CachedDecode : public ::testing::TestWithParam<ModeCase> {};

TEST_P(CachedDecode, LogitsEqualFullForwardAtEveryPosition) {
  const ModeCase& mc = GetParam();
  Config cfg = tiny_config(mc.mode, mc.heads, true, mc.block_size);
  const int total = cfg.model.context_length;  // 8
  auto be = make_cpu_backend(DType::F64);
  Model full(cfg.model, cfg.residual, *be, 1, total);
  randomize_weights(full, 11);
  std::vector<int32_t> tokens, unused;
  random_tokens(total, cfg.model.vocab_size, 12, tokens, unused);
  const std::vector<double> ref = full_forward_logits(full, tokens);  // [total, V]
  const double scale = max_abs(ref);
  ASSERT_GT(scale, 0.1);  // the comparison below must not be vacuous

  const int V = cfg.model.vocab_size;
  Model dec(cfg.model, cfg.residual, *be, 1, 3);
  copy_weights(full, dec);
  dec.enable_kv_cache(total);
  // Chunks: a prefill of 3, a chunk of 2 (several queries at an offset), then singles.
  const std::vector<int> chunks = {3, 2, 1, 1, 1};
  int pos = 0;
  for (int count : chunks) {
    dec.forward_cached(tokens.data() + pos, count);
    ASSERT_EQ(dec.cached_positions(), pos + count);
    const std::vector<double> got = download(*be, dec.logits());
    ASSERT_EQ(int(got.size()), count * V);
    for (int r = 0; r < count; ++r) {
      double err = 0;
      for (int v = 0; v < V; ++v)
        err = std::max(err, std::fabs(got[size_t(r) * V + v] - ref[size_t(pos + r) * V + v]));
      EXPECT_LE(err / scale, 1e-12) << mc.label << " position " << pos + r;
    }
    pos += count;
  }
  ASSERT_EQ(pos, total);
  // The cache is full: one more position is a clear error, not a silent overrun.
  EXPECT_THROW(dec.forward_cached(tokens.data(), 1), Error);
  // A cleared cache starts a new sequence at position 0.
  dec.clear_kv_cache();
  dec.forward_cached(tokens.data(), total);
  EXPECT_LE(rel_error(download(*be, dec.logits()), ref), 1e-12);
}

INSTANTIATE_TEST_SUITE_P(Modes, CachedDecode,
                         ::testing::Values(ModeCase{"standard", ResidualMode::Standard, 0},
                                           ModeCase{"attnres", ResidualMode::AttnRes, 0},
                                           ModeCase{"mhar", ResidualMode::Mhar, 4},
                                           ModeCase{"mhar_block3", ResidualMode::Mhar, 4, 3},
                                           ModeCase{"hyper", ResidualMode::Hyper, 0},
                                           ModeCase{"delta", ResidualMode::Delta, 2}),
                         [](const auto& info) { return std::string(info.param.label); });

TEST(Sampling, GreedyIsDeterministicAndEqualsArgmaxOfFullForwards) {
  for (ResidualMode mode : {ResidualMode::Standard, ResidualMode::Mhar}) {
    Config cfg = tiny_config(mode, mode == ResidualMode::Mhar ? 2 : 0);
    const int ctx = cfg.model.context_length, V = cfg.model.vocab_size;
    auto be = make_cpu_backend(DType::F64);
    Model dec(cfg.model, cfg.residual, *be, 1, 1);
    randomize_weights(dec, 21);
    dec.enable_kv_cache(ctx);
    const std::vector<int32_t> prompt = {5, 17, 2};
    SamplingOptions opt;
    opt.temperature = 0;
    opt.max_tokens = ctx - int(prompt.size());
    const Generation a = generate(dec, prompt, opt);
    const Generation b = generate(dec, prompt, opt);
    ASSERT_EQ(int(a.tokens.size()), opt.max_tokens);
    EXPECT_EQ(a.tokens, b.tokens);
    // Each greedy token is the argmax of a full forward over everything before it.
    std::vector<int32_t> seq = prompt;
    for (int32_t t : a.tokens) {
      Model full(cfg.model, cfg.residual, *be, 1, int(seq.size()));
      copy_weights(dec, full);
      const auto logits = full_forward_logits(full, seq);
      const double* last = logits.data() + (seq.size() - 1) * size_t(V);
      EXPECT_EQ(t, int32_t(std::max_element(last, last + V) - last));
      seq.push_back(t);
    }
  }
}

TEST(Sampling, SeededSamplingRepeatsAndStopsWhereAsked) {
  Config cfg = tiny_config(ResidualMode::AttnRes);
  const int ctx = cfg.model.context_length;
  auto be = make_cpu_backend(DType::F64);
  Model dec(cfg.model, cfg.residual, *be, 1, 1);
  randomize_weights(dec, 31);
  dec.enable_kv_cache(ctx);
  SamplingOptions opt;
  opt.temperature = 1.0;
  opt.seed = 7;
  opt.max_tokens = 100;  // more than fit: the context ends it
  const std::vector<int32_t> prompt = {1, 2};
  const Generation a = generate(dec, prompt, opt), b = generate(dec, prompt, opt);
  EXPECT_EQ(a.tokens, b.tokens);
  EXPECT_EQ(a.reason, StopReason::ContextFull);
  // Every position of the context is used: the last token is emitted without being fed.
  EXPECT_EQ(int(prompt.size() + a.tokens.size()), ctx + 1);

  // The stop token is not emitted and ends generation.
  opt.stop_token = a.tokens.at(2);
  const Generation c = generate(dec, prompt, opt);
  EXPECT_EQ(c.reason, StopReason::StopToken);
  ASSERT_LE(c.tokens.size(), 2u);
  EXPECT_TRUE(std::equal(c.tokens.begin(), c.tokens.end(), a.tokens.begin()));

  // Streaming sees exactly the returned tokens.
  opt.stop_token = -1;
  std::vector<int32_t> streamed;
  const Generation d = generate(dec, prompt, opt, [&](int32_t t) { streamed.push_back(t); });
  EXPECT_EQ(streamed, d.tokens);

  const std::vector<int32_t> too_long(size_t(ctx) + 1, 1);
  EXPECT_THROW(generate(dec, too_long, opt), Error);
  EXPECT_THROW(generate(dec, {}, opt), Error);
  opt.temperature = -1;
  EXPECT_THROW(generate(dec, prompt, opt), Error);
}

TEST(Sampling, TopKAndVocabularyLimitAreRespected) {
  const std::vector<double> logits = {0.0, 3.0, 2.9, 1.0, 2.8, 10.0};
  SamplingOptions opt;
  opt.temperature = 1.0;
  opt.vocab_limit = 5;  // id 5 is padding: never drawn, however large its logit
  opt.top_k = 3;        // then only ids 1, 2, 4
  uint64_t rng = 99;
  std::map<int32_t, int> seen;
  for (int i = 0; i < 3000; ++i) ++seen[sample_token(logits.data(), 6, opt, rng)];
  EXPECT_EQ(seen.size(), 3u);
  for (int32_t id : {1, 2, 4}) EXPECT_GT(seen[id], 600) << id;  // ~1/3 each
  opt.temperature = 0;  // greedy ignores the padding too
  EXPECT_EQ(sample_token(logits.data(), 6, opt, rng), 1);
  // Greedy breaks ties by the lower id.
  const std::vector<double> tie = {1.0, 4.0, 4.0};
  opt.vocab_limit = 0;
  EXPECT_EQ(sample_token(tie.data(), 3, opt, rng), 1);
  const std::vector<double> bad = {1.0, NAN};
  EXPECT_THROW(sample_token(bad.data(), 2, opt, rng), Error);
}

// Forwards every op to a real backend and records the work of the ops whose cost
// depends on sequence length.
class CountingBackend final : public ForwardingBackend {
 public:
  CountingBackend(Backend& inner, bool decode_ops) : ForwardingBackend(inner), decode_ops_(decode_ops) {}
  struct Counts {
    int64_t matmul_calls = 0, matmul_max_rows = 0, matmul_flops = 0;
    int64_t full_attention_calls = 0, cached_attention_calls = 0;
    std::vector<int64_t> cached_tq, cached_tk;
  } counts;

  std::string name() const override { return "counting(" + in_.name() + ")"; }
  void matmul(Tensor c, Tensor a, Tensor b, bool ta, bool tb, bool acc) override {
    const int64_t M = c.dim(0), N = c.dim(1), K = ta ? a.dim(0) : a.dim(1);
    ++counts.matmul_calls;
    counts.matmul_max_rows = std::max(counts.matmul_max_rows, M);
    counts.matmul_flops += 2 * M * N * K;
    in_.matmul(c, a, b, ta, tb, acc);
  }
  // Without decode_ops the backend is one that has no decoding ops (Backend's defaults).
  void rope_at(Tensor x, double theta, int64_t first) override {
    if (!decode_ops_) return Backend::rope_at(x, theta, first);
    in_.rope_at(x, theta, first);
  }
  void attention_cached(Tensor out, Tensor q, Tensor k, Tensor v) override {
    if (!decode_ops_) return Backend::attention_cached(out, q, k, v);
    ++counts.cached_attention_calls;
    counts.cached_tq.push_back(q.dim(1));
    counts.cached_tk.push_back(k.dim(1));
    in_.attention_cached(out, q, k, v);
  }
  void attention_forward(Tensor out, Tensor lse, Tensor q, Tensor k, Tensor v) override {
    ++counts.full_attention_calls;
    in_.attention_forward(out, lse, q, k, v);
  }

 private:
  bool decode_ops_;
};

TEST(Sampling, DecodeCostIsLinearInLength) {
  Config cfg = tiny_config(ResidualMode::Mhar, 2);
  cfg.model.context_length = 64;
  const int L = cfg.model.n_layers, prompt_len = 5, steps = 40;
  auto cpu = make_cpu_backend(DType::F64);
  CountingBackend be(*cpu, true);
  Model dec(cfg.model, cfg.residual, be, 1, prompt_len);
  randomize_weights(dec, 41);
  dec.enable_kv_cache(cfg.model.context_length);
  std::vector<int32_t> tokens, unused;
  random_tokens(prompt_len + steps, cfg.model.vocab_size, 42, tokens, unused);

  dec.forward_cached(tokens.data(), prompt_len);  // the prefill: one chunk
  EXPECT_EQ(be.counts.matmul_max_rows, prompt_len);
  EXPECT_EQ(be.counts.cached_attention_calls, L);

  int64_t step_flops = -1;
  for (int i = 0; i < steps; ++i) {
    be.counts = {};
    const int pos = prompt_len + i;
    dec.forward_cached(&tokens[size_t(pos)], 1);
    // Everything but attention works on the one new row, the same amount every step...
    EXPECT_EQ(be.counts.matmul_max_rows, 1) << "step " << i;
    if (step_flops < 0) step_flops = be.counts.matmul_flops;
    EXPECT_EQ(be.counts.matmul_flops, step_flops) << "step " << i;
    // ...never the full (quadratic) attention, and cached attention reads each cached
    // position once: one query against pos + 1 keys, per layer.
    EXPECT_EQ(be.counts.full_attention_calls, 0);
    ASSERT_EQ(be.counts.cached_attention_calls, L);
    for (int l = 0; l < L; ++l) {
      EXPECT_EQ(be.counts.cached_tq[size_t(l)], 1);
      EXPECT_EQ(be.counts.cached_tk[size_t(l)], pos + 1);
    }
  }
}

TEST(Sampling, BackendWithoutDecodeOpsSaysSo) {
  Config cfg = tiny_config(ResidualMode::Standard);
  auto cpu = make_cpu_backend(DType::F64);
  CountingBackend be(*cpu, false);
  Model dec(cfg.model, cfg.residual, be, 1, 2);
  dec.enable_kv_cache(cfg.model.context_length);
  const int32_t tokens[2] = {1, 2};
  try {
    dec.forward_cached(tokens, 2);
    FAIL() << "expected an error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("does not implement incremental decoding yet; run "
                                         "sampling on the CPU"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("counting(cpu-fp64)"), std::string::npos) << e.what();
  }
  // A model built for a batch of 2 cannot decode.
  Model batched(cfg.model, cfg.residual, *cpu, 2, 2);
  EXPECT_THROW(batched.enable_kv_cache(8), Error);
}

// Runs the mhar binary with `args`; returns the exit status, stdout and stderr in files.
int run_mhar(const std::filesystem::path& dir, const std::string& args, const char* name) {
  const std::string cmd = std::string(MHAR_BINARY) + " " + args + " >" + (dir / name).string() +
                          ".out 2>" + (dir / name).string() + ".err";
  const int rc = std::system(cmd.c_str());
  return WIFEXITED(rc) ? WEXITSTATUS(rc) : -1;
}

std::string slurp(const std::filesystem::path& p) {
  std::ifstream in(p, std::ios::binary);
  std::stringstream s;
  s << in.rdbuf();
  return s.str();
}

TEST(SampleCli, TinyRunSamplesTheSameTextForTheSameSeedAndReports) {
  namespace fs = std::filesystem;
  const fs::path dir = fs::path(::testing::TempDir()) / ("mhar_sample_cli_" + std::to_string(::getpid()));
  fs::remove_all(dir);
  fs::create_directories(dir);
  {
    std::ofstream docs(dir / "docs.jsonl");
    const char* subjects[] = {"the cat", "a dog", "the bird", "my friend"};
    const char* verbs[] = {"sat on", "looked at", "ran to", "slept near"};
    const char* objects[] = {"the mat.", "the door.", "a tree.", "the house."};
    for (int d = 0; d < 160; ++d) {
      std::string text;
      for (int s = 0; s < 12; ++s)
        text += std::string(subjects[(d + s) % 4]) + " " + verbs[(d * 3 + s) % 4] + " " +
                objects[(d + 2 * s) % 4] + " ";
      docs << nlohmann::json({{"text", text}}).dump() << "\n";
    }
  }
  auto expect_ok = [&](const std::string& args, const char* name) {
    ASSERT_EQ(run_mhar(dir, args, name), 0)
        << "mhar " << args << "\n" << slurp(dir / (std::string(name) + ".err"));
  };
  const std::string d = dir.string();
  expect_ok("data train-tokenizer --vocab 300 --threads 1 --input " + d + "/docs.jsonl --out " + d +
                "/tok.json", "tokenizer");
  expect_ok("data prepare --threads 1 --no-progress --val-docs 16 --tokenizer " + d +
                "/tok.json --input " + d + "/docs.jsonl --out " + d + "/shards", "prepare");
  nlohmann::json cfg = {
      {"model", {{"vocab_size", 320}, {"d_model", 32}, {"n_layers", 2}, {"n_heads", 4},
                 {"n_kv_heads", 2}, {"head_dim", 8}, {"d_ff", 64}, {"context_length", 32}}},
      {"residual", {{"mode", "mhar"}, {"heads", 2}}},
      {"train", {{"micro_batch", 4}, {"seq_len", 32}, {"steps", 30}, {"lr", 1e-2},
                 {"warmup_steps", 3}, {"eval_every", 15}, {"eval_batches", 2}, {"device", "cpu"}}},
      {"data", {{"train", d + "/shards/train_*.bin"}, {"val", d + "/shards/val_*.bin"},
                {"tokenizer", d + "/tok.json"}}},
      {"checkpoint", {{"every", 0}, {"keep", 1}}}};
  std::ofstream(dir / "cfg.json") << cfg.dump(2);
  expect_ok("train " + d + "/cfg.json --run-dir " + d + "/run", "train");

  const std::string sample = "sample --checkpoint " + d + "/run --prompt 'the cat' --max-tokens 40 --seed 4";
  expect_ok(sample, "sample1");
  expect_ok(sample, "sample2");
  const std::string text = slurp(dir / "sample1.out");
  EXPECT_GT(text.size(), 5u);
  EXPECT_EQ(text, slurp(dir / "sample2.out"));
  EXPECT_NE(slurp(dir / "sample1.err").find("stopped:"), std::string::npos);
  // The continuation only: the prompt is not echoed back at the start.
  EXPECT_NE(text.rfind("the cat", 0), 0u) << text;

  // Bad options fail with a message naming the option.
  EXPECT_EQ(run_mhar(dir, "sample --checkpoint " + d + "/run --prompt x --temperature -1", "bad"), 1);
  EXPECT_NE(slurp(dir / "bad.err").find("--temperature"), std::string::npos);
  EXPECT_EQ(run_mhar(dir, "sample --checkpoint " + d + "/nothing --prompt x", "missing"), 1);

  expect_ok("report " + d + "/run", "report");
  EXPECT_TRUE(fs::exists(dir / "run" / "report.html"));
  if (!HasFailure()) fs::remove_all(dir);  // kept for inspection when something failed
}

}  // namespace
