// sample_cudatest.cpp: decode mode (Model::enable_kv_cache / forward_cached) and greedy
// generation (engine/sampler.h) on the CUDA backend against the CPU fp32 reference, on a
// tiny model with the same weights on both sides, in each residual mode (standard,
// attnres, mhar). `mhar sample --device cuda` runs exactly this path. Only the public
// Model and sampler API is used: the backend ops behind it are tested one by one in the
// other *_cudatest.cpp files.
// - Cached decode: one sequence fed in chunks of 13, 3 and then 1 token (so the GPU
//   re-plans its activations and attends with Tq < Tk), the same chunks on both sides;
//   every row of logits of every chunk must match the CPU's: ||gpu - cpu|| / ||cpu|| <
//   the row's bound (below).
// - Greedy generation: generate() on the GPU, then the CPU's logits along the GPU's own
//   continuation (teacher forcing, so every step is compared at the same prefix, however
//   early a near-tie made the two backends' texts differ). Where the CPU's top-2 gap is
//   wider than 2 * (the row's bound) * ||cpu row||, the parity bound (checked on the same rows)
//   puts every GPU logit within half the gap of the CPU's, so the GPU must have chosen the
//   CPU's argmax; where it is narrower, bf16 rounding may legitimately pick the other
//   token and nothing is claimed. The check cannot flake: it is implied by the bound.
// Tolerance: the logits sit behind the forward chain of bf16 stores only (per layer about
// a dozen: normed input, q/k/v before and after QK-norm and RoPE, the cached keys and
// values, attention output, sublayer output, routed input; gate, up, h), about 25 in all
// with the final norm and the logits, each off by at most 2^-9 relative (RMS 1.1e-3):
// sqrt(25) * 1.1e-3 = 5.5e-3 if independent. kTolLogits = 2e-2, the whole-model bound of
// tests/model_cudatest.cpp (which also covers the backward chain), leaves room for
// partial cancellation in the routing and attention mixes while a wrong position in RoPE
// or a wrong causal window moves the logits by O(1) relative. Per row, the noise measured
// on the CPU as in tests/model_cudatest.cpp: the CPU model run 32 more times on weights
// perturbed by one bf16 rounding (perturb_parameters), s_p the RMS relative change of row
// p (the expected deviation of a bf16 engine there; 32 draws, see kNoiseDraws), and the
// bound max(kTolLogits, 4 s_p); rows whose logits are sensitive (sharp routing softmaxes) get a proportionally
// wider bound, computed without the GPU.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "cuda/cuda_backend.h"
#include "cuda/device.h"
#include "engine/backend.h"
#include "engine/config.h"
#include "engine/model.h"
#include "engine/sampler.h"
#include "tests/model_pair_util.h"
#include "tests/model_test_util.h"

namespace mhar::test {
namespace {

constexpr double kTolLogits = 2e-2;
constexpr double kSigmas = 4;  // bound = kSigmas x the measured bf16 noise (header)
// One row is a small sample: the noise s_p is estimated from this many draws. With 8 the
// estimate itself varied by ~25% (chi-square, 8 degrees of freedom), enough for a row to
// land at 1.02 of its bound after an fp32-level change of the routing logits (the
// cuBLAS logits, 2026-11-30); 32 draws halve that spread, at ~1 s of CPU time.
constexpr int kNoiseDraws = 32;

// The shapes the GPU kernels need (head_dim 64: attention supports 64 and 128), GQA 2,
// routing H = 2 in mhar. A small vocabulary keeps the top-2 gaps wide relative to the
// row norm, so the greedy check has clear choices to compare.
Config tiny_decode_config(const std::string& mode, int heads, int vocab) {
  nlohmann::json j = {
      {"model", {{"vocab_size", vocab}, {"d_model", 128}, {"n_layers", 2}, {"n_heads", 4},
                 {"n_kv_heads", 2}, {"head_dim", 64}, {"d_ff", 256}, {"context_length", 64},
                 {"rope_theta", 10000.0}, {"tie_embeddings", true}}},
      {"residual", {{"mode", mode}, {"heads", heads}}},
      {"train", {{"micro_batch", 1}, {"seq_len", 13}, {"warmup_steps", 0}}}};
  return config_from_json(j, "sample_cudatest");
}

std::vector<int32_t> random_tokens(int n, int vocab, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::vector<int32_t> t(static_cast<size_t>(n));
  for (auto& x : t) x = int32_t(rng() % uint64_t(vocab));
  return t;
}

// Feeds `tokens` in `chunks` (sizes summing to tokens.size()) from an empty cache;
// returns every row of logits of every chunk, [tokens.size()][V] in order.
std::vector<std::vector<double>> cached_logits(Model& m, const std::vector<int32_t>& tokens,
                                               const std::vector<int>& chunks) {
  const int V = m.config().vocab_size;
  std::vector<std::vector<double>> rows;
  m.clear_kv_cache();
  size_t at = 0;
  for (int c : chunks) {
    m.forward_cached(tokens.data() + at, c);
    const auto all = download(m.backend(), m.logits());
    EXPECT_EQ(all.size(), size_t(c) * V);
    for (int r = 0; r < c; ++r)
      rows.emplace_back(all.begin() + size_t(r) * V, all.begin() + size_t(r + 1) * V);
    at += size_t(c);
  }
  EXPECT_EQ(at, tokens.size());
  EXPECT_EQ(m.cached_positions(), int(tokens.size()));
  return rows;
}

// Per-row bounds (header): the CPU model `ref_model` (a copy of it, twice) on weights
// perturbed by one bf16 rounding, fed the same tokens in the same chunks.
std::vector<double> row_tolerances(const Config& cfg, Model& ref_model, Backend& cpu,
                                   const std::vector<int32_t>& tokens,
                                   const std::vector<int>& chunks,
                                   const std::vector<std::vector<double>>& ref) {
  std::vector<double> s2(ref.size(), 0.0);
  for (int draw = 0; draw < kNoiseDraws; ++draw) {
    Model mp(cfg.model, cfg.residual, cpu, 1, ref_model.seq_len());
    copy_weights(ref_model, mp);
    perturb_parameters(mp, 2000 + draw);
    mp.enable_kv_cache(cfg.model.context_length);
    const auto rows = cached_logits(mp, tokens, chunks);
    for (size_t p = 0; p < ref.size(); ++p) {
      const double e = rel_err(rows[p], ref[p]);
      s2[p] += e * e / kNoiseDraws;
    }
  }
  std::vector<double> tol(ref.size());
  for (size_t p = 0; p < ref.size(); ++p)
    tol[p] = std::max(kTolLogits, kSigmas * std::sqrt(s2[p]));
  return tol;
}

struct ModeCase {
  const char* mode;
  int heads;
};

class CudaDecode : public ::testing::TestWithParam<ModeCase> {};

TEST_P(CudaDecode, CachedLogitsMatchTheCpuAtEveryPosition) {
  if (cuda::device_count() == 0) GTEST_SKIP() << "no CUDA device";
  const ModeCase mc = GetParam();
  const Config cfg = tiny_decode_config(mc.mode, mc.heads, 256);
  const int prefill = cfg.train.seq_len, ctx = cfg.model.context_length;
  auto cpu = make_cpu_backend(DType::F32);
  auto gpu = make_cuda_backend(0);
  Model mg(cfg.model, cfg.residual, *gpu, 1, prefill), mcpu(cfg.model, cfg.residual, *cpu, 1, prefill);
  same_weights(mg, mcpu, 17, 0.3);
  mg.enable_kv_cache(ctx);
  mcpu.enable_kv_cache(ctx);
  std::vector<int> chunks = {prefill, 3};
  int total = prefill + 3;
  for (; total < 40; ++total) chunks.push_back(1);
  const auto tokens = random_tokens(total, cfg.model.vocab_size, 5);

  const auto got = cached_logits(mg, tokens, chunks), ref = cached_logits(mcpu, tokens, chunks);
  ASSERT_EQ(got.size(), ref.size());
  const auto tol = row_tolerances(cfg, mcpu, *cpu, tokens, chunks, ref);
  double worst = 0;
  int worst_pos = -1;
  for (size_t pos = 0; pos < ref.size(); ++pos) {
    const double e = rel_err(got[pos], ref[pos]);
    EXPECT_LT(e, tol[pos]) << mc.mode << ": logits at position " << pos;
    if (!(e / tol[pos] <= worst)) worst = e / tol[pos], worst_pos = int(pos);
  }
  std::printf("DECODE_PARITY %-8s %d positions (chunks %d, 3, then 1): worst logits rel_err "
              "%.3e at position %d, tol there %.2e (%.2f of it)\n", mc.mode, total, prefill,
              worst_pos >= 0 ? rel_err(got[size_t(worst_pos)], ref[size_t(worst_pos)]) : 0.0,
              worst_pos, worst_pos >= 0 ? tol[size_t(worst_pos)] : kTolLogits, worst);
}

TEST_P(CudaDecode, GreedyTokensMatchTheCpuWhereTheChoiceIsClear) {
  if (cuda::device_count() == 0) GTEST_SKIP() << "no CUDA device";
  const ModeCase mc = GetParam();
  const Config cfg = tiny_decode_config(mc.mode, mc.heads, 32);
  const int prompt_len = cfg.train.seq_len, ctx = cfg.model.context_length;
  const int V = cfg.model.vocab_size;
  auto cpu = make_cpu_backend(DType::F32);
  auto gpu = make_cuda_backend(0);
  // Built for the prompt's length, as `mhar sample` builds its model.
  Model mg(cfg.model, cfg.residual, *gpu, 1, prompt_len), mcpu(cfg.model, cfg.residual, *cpu, 1, prompt_len);
  same_weights(mg, mcpu, 23, 0.3);
  mg.enable_kv_cache(ctx);
  mcpu.enable_kv_cache(ctx);
  const auto prompt = random_tokens(prompt_len, V, 9);

  SamplingOptions opt;
  opt.temperature = 0;  // greedy
  opt.max_tokens = 16;
  std::vector<int32_t> streamed;
  const Generation g = generate(mg, prompt, opt, [&](int32_t t) { streamed.push_back(t); });
  ASSERT_EQ(g.reason, StopReason::MaxTokens);
  ASSERT_EQ(int(g.tokens.size()), opt.max_tokens);
  EXPECT_EQ(streamed, g.tokens);

  // Both backends' logits along the GPU's continuation: the prompt in one chunk, then
  // one token at a time, as generate() ran it. Row prompt_len - 1 + i predicts token i.
  std::vector<int32_t> seq = prompt;
  seq.insert(seq.end(), g.tokens.begin(), g.tokens.end() - 1);
  std::vector<int> chunks(size_t(opt.max_tokens), 1);  // the prompt, then max_tokens - 1 ones
  chunks[0] = prompt_len;
  const auto got = cached_logits(mg, seq, chunks), ref = cached_logits(mcpu, seq, chunks);
  ASSERT_EQ(ref.size(), seq.size());
  const auto tol = row_tolerances(cfg, mcpu, *cpu, seq, chunks, ref);

  int compared = 0, same_as_cpu = 0;
  for (int i = 0; i < opt.max_tokens; ++i) {
    const auto& r = ref[size_t(prompt_len - 1 + i)];
    const auto& gr = got[size_t(prompt_len - 1 + i)];
    const double e = rel_err(gr, r), row_tol = tol[size_t(prompt_len - 1 + i)];
    ASSERT_LT(e, row_tol) << mc.mode << ": logits for token " << i
                          << " (the greedy check below relies on this bound)";
    int best = 0, second = -1;
    for (int v = 1; v < V; ++v) {
      if (r[size_t(v)] > r[size_t(best)]) second = best, best = v;
      else if (second < 0 || r[size_t(v)] > r[size_t(second)]) second = v;
    }
    const double gap = r[size_t(best)] - r[size_t(second)];
    if (g.tokens[size_t(i)] == best) ++same_as_cpu;
    if (gap > 2 * row_tol * norm(r)) {
      ++compared;
      EXPECT_EQ(g.tokens[size_t(i)], best)
          << mc.mode << ": token " << i << ": the CPU's choice is clear (top-2 gap " << gap
          << " > " << 2 * row_tol * norm(r) << ") but the GPU chose another";
    }
  }
  std::printf("DECODE_GREEDY %-8s %d tokens: %d equal to the CPU's argmax, %d of them where "
              "the CPU's choice is clear (checked)\n", mc.mode, opt.max_tokens, same_as_cpu,
              compared);
}

INSTANTIATE_TEST_SUITE_P(Modes, CudaDecode,
                         ::testing::Values(ModeCase{"standard", 0}, ModeCase{"attnres", 1},
                                           ModeCase{"mhar", 2}),
                         [](const ::testing::TestParamInfo<ModeCase>& i) {
                           return std::string(i.param.mode);
                         });

}  // namespace
}  // namespace mhar::test
