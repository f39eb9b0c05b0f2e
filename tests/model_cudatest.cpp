// model_cudatest.cpp: the whole model on the CUDA backend against the CPU fp32 reference
// (issue 5): the loss and every parameter gradient of one forward/backward for standard,
// attnres and mhar (and both with block routing), hyper (n = 4, static and dynamic
// Hyper-Connections, issue 11) and delta (blocks of 1 layer, gates, null and queries non-zero) on a
// tiny config with the same weights on both sides, and a short training run on each backend that
// must reach the same loss within noise. SideWork: the backward's side work on a second stream
// gives issue order's bits.
//
// Tolerances (on ||gpu - cpu|| / ||cpu|| per tensor; the GPU stores every activation and
// weight in bf16, the CPU nothing):
// - Each bf16 store rounds an element by at most 2^-9 relative (RMS about 2^-9/sqrt(3),
//   1.1e-3), independently from store to store. One parameter gradient here sits behind
//   the stores of the forward and backward chain that reaches it: per layer about a dozen
//   on each side (normed input, q/k/v before and after QK-norm and RoPE, attention
//   output, the sublayer output in the depth history, the routed input; gate, up, h; and
//   the same gradients back), two layers, the logits and their gradient: about 50
//   roundings. Independent errors add in quadrature: sqrt(50) * 1.1e-3 = 8e-3. A factor
//   about 2.5 covers the sums whose terms partly cancel (norm-weight and routing
//   query/gain gradients are sums over tokens of products of two perturbed factors), so
//   kTolGrad = 2e-2. This is a whole-model bound, not an op bound: the per-op parity
//   tests hold each kernel to 2^-8 (tests/cuda_test_util.h).
// - Per tensor, the size of that noise measured on the CPU instead of assumed: the CPU
//   fp32 model runs 4 more times with the same weights and every activation it stores
//   given a bf16 rounding error, drawn afresh per run, where the GPU stores bf16
//   (tests/bf16_storage_backend.h), and s_t is the RMS relative change of gradient t: the
//   expected deviation of a bf16 engine on that tensor. (Until 2026-11-30 these runs
//   perturbed the weights by one bf16 rounding instead, with fp32 activations: about the
//   same noise where gradients are well conditioned, none where a gradient is a sum that
//   cancels exactly in fp32: Hyper-Connections' mixing-coefficient gradients at equal
//   streams, |ref| 1e-9..1e-5, deviated 0.2-3x on the GPU against a bound of 2e-2.)
//   Measured on the H200 (2026-11-30, seven modes): s_t = 5e-3 to 3e-2 on the
//   well-conditioned and the routing tensors, up to ~10 (relative!) on the hyper mixing
//   coefficients, whose reference gradient is below bf16's resolution of it; the GPU's
//   deviation / s_t = 0.84-1.04 over every standard tensor and 0.14-2.77 over all of
//   them, so this noise is the GPU's. Bound: max(kTolGrad, 4 s_t), a 4-sigma bound on a
//   deviation of that size.
// - The loss is the mean over N tokens of logsumexp(logits) - logit[target]; each term
//   moves by at most about the logits' error (~1e-2 relative of logits of magnitude
//   ~|logit| << ln V), and the mean of N independent errors is smaller again, so
//   2e-3 relative to a loss of ~ln V = 5.5 is a wide margin for a correct engine while
//   a wrong op (a missing term, a wrong mask) moves it by far more.
// - Gradients that are exactly zero in the reference (routing site 0 mixes one source with
//   weight 1, so its query and gain get none) must be below 1e-5 in norm on the GPU: fp32
//   rounding of a difference of two equal dot products.
// Chunked head (`_chunk48`): the GPU model runs its LM head in chunks of 48 of the 160
// tokens (the last chunk 16), the CPU reference in one, under the same bounds: chunking
// changes only the order in which the head's weight gradient sums its token terms (fp32
// additions of chunk partials) and the GEMM shapes cuBLAS picks algorithms for, both far
// below the bf16 storage noise the bounds are made of.
// Training: the GPU and CPU runs start from the same bf16 weights and read the same
// batches; the mean loss of the last 10 steps must agree within 3% (step-to-step noise
// of the loss on these batches is about that size; a broken backward does not converge),
// and both runs must have learned (tail below 0.6 x the first loss).
// Except hyper_dynamic, whose training is chaotic at this configuration: same_weights
// sets s_a, s_b ~ 1 and w ~ 0.1 N(0, 1) (not the model's init 0.01 and 0), so each
// token's coefficients move by s tanh(z) ~ ±0.8 (z ~ 0.1 sqrt(d) = 1.1), and any
// perturbation of a step changes the trajectory. Measured on the CPU (2026-11-30, the
// CPU engine with this test's config, data and optimizer, 60 steps;
// tests/experiments/hyper_dynamic_training_noise.cpp):
// - fp32: the tail is 0.7857 with OpenBLAS's Haswell kernels, 0.7906 with its
//   Sandybridge ones (0.7908 on the H200 host): summation order alone moves it 0.6%.
// - The GPU's storage modelled (tests/bf16_storage_backend.h's rounding on every
//   activation, bf16 weights from fp32 master weights): 16 draws of the rounding end
//   +0.1% to +5.9% above the fp32 tail (median 2.0%; 2 of 16 above the H200's +5.0%).
//   Rounded activations with fp32 weights: 5 draws, +0.9% to +10.2%. Deterministic
//   round-to-nearest activations and bf16 weights: +2.6%.
// - Controls under the same noise: static hyper within 0.03% (4 draws; H200 0.01%),
//   standard within 0.1% (3 draws): the spread is the dynamic coefficients'.
// The H200 run's +5.0% (2026-11-30) is inside that spread. kTolTrainDynamic = 0.15 is
// 1.5x the largest draw (10.2%). It is no check of the dynamic gradients (a planted bug
// that gives w, s_a, s_b no gradient ends +1.6%, inside the noise): ModelParity
// hyper_dynamic checks those; here only that GPU training in this mode converges and does
// not drift far from the CPU's.
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
#include "cuda/kernels.h"
#include "engine/backend.h"
#include "engine/communicator.h"
#include "engine/config.h"
#include "engine/model.h"
#include "engine/optimizer.h"
#include "engine/train_step.h"
#include "tests/bf16_storage_backend.h"
#include "tests/model_pair_util.h"
#include "tests/model_test_util.h"

namespace mhar::test {
namespace {

constexpr double kTolGrad = 2e-2;
constexpr double kSigmas = 4;  // bound = kSigmas x the measured bf16 noise (header)
constexpr int kNoiseDraws = 4;
constexpr double kTolLoss = 2e-3;
constexpr double kZeroGradNorm = 1e-5;
constexpr double kTolTrain = 0.03;         // relative, mean loss of the last 10 steps (header)
constexpr double kTolTrainDynamic = 0.15;  // hyper_dynamic: its measured bf16 spread (header)

// tiny_gpu_model_json (model_test_util.h) at T 80, not a multiple of the attention tiles
// (64); routing H = 2.
Config tiny_gpu_config(const std::string& mode, int heads, int vocab = 256, int block_size = 0,
                       bool hyper_dynamic = false) {
  nlohmann::json j = {{"model", tiny_gpu_model_json(vocab, 128)},
                      {"residual", {{"mode", mode}, {"heads", heads}, {"block_size", block_size}}},
                      {"train", {{"micro_batch", 2}, {"seq_len", 80}, {"warmup_steps", 0}}}};
  if (hyper_dynamic) j["residual"]["hyper_dynamic"] = true;  // mode hyper only
  if (mode == "delta") {  // block_size names residual.block_layers (1..2) in mode delta
    j["residual"]["block_size"] = 0;
    j["residual"]["block_layers"] = block_size;
  }
  return config_from_json(j, "model_cudatest");
}

struct ModeCase {
  const char* mode;
  int heads;
  int block_size = 0;  // residual.block_size: 2 layers have 4 sublayers
  bool hyper_dynamic = false;  // residual.hyper_dynamic (mode hyper)
  int logits_chunk = 0;        // the GPU model's LM head chunk (0: one chunk at this size)
  std::string label() const {
    return std::string(mode) + (block_size ? "_block" + std::to_string(block_size) : "") +
           (hyper_dynamic ? "_dynamic" : "") +
           (logits_chunk ? "_chunk" + std::to_string(logits_chunk) : "");
  }
};

class ModelParity : public ::testing::TestWithParam<ModeCase> {};

TEST_P(ModelParity, LossAndEveryGradient) {
  if (cuda::device_count() == 0) GTEST_SKIP() << "no CUDA device";
  const ModeCase mc = GetParam();
  const Config cfg = tiny_gpu_config(mc.mode, mc.heads, 256, mc.block_size, mc.hyper_dynamic);
  const int B = cfg.train.micro_batch, T = cfg.train.seq_len;
  auto cpu = make_cpu_backend(DType::F32);
  auto gpu = make_cuda_backend(0);
  Model mg(cfg.model, cfg.residual, *gpu, B, T, 1, mc.logits_chunk),
      mcpu(cfg.model, cfg.residual, *cpu, B, T);
  same_weights(mg, mcpu, 42, 0.1);
  std::vector<int32_t> x, y;
  random_tokens(B * T, cfg.model.vocab_size, 7, x, y);

  mg.zero_grads();
  mcpu.zero_grads();
  const double loss_g = mg.forward(x.data(), y.data(), 1.0);
  mg.backward();
  const double loss_c = mcpu.forward(x.data(), y.data(), 1.0);
  mcpu.backward();

  // Sensitivity of every gradient to bf16 storage: the same weights (bf16 on both
  // sides), every activation stored with a bf16 rounding error, as the GPU stores it
  // (header).
  std::vector<double> sens(mcpu.parameters().size(), 0.0);
  for (int draw = 0; draw < kNoiseDraws; ++draw) {
    Bf16Storage bf16_cpu(*cpu, 1000 + draw);
    Model mp(cfg.model, cfg.residual, bf16_cpu, B, T);
    copy_weights(mcpu, mp);
    mp.zero_grads();
    mp.forward(x.data(), y.data(), 1.0);
    mp.backward();
    for (size_t i = 0; i < sens.size(); ++i) {
      const auto ref = download(*cpu, mcpu.parameters()[i].grad);
      if (norm(ref) == 0) continue;
      const double e = rel_err(download(*cpu, mp.parameters()[i].grad), ref);
      sens[i] += e * e / kNoiseDraws;
    }
  }

  const double loss_err = std::fabs(loss_g - loss_c) / std::fabs(loss_c);
  std::printf("MODEL_PARITY %-8s %-48s rel_err %.3e  (gpu %.6f cpu %.6f)  tol %.1e\n", mc.label().c_str(),
              "loss", loss_err, loss_g, loss_c, kTolLoss);
  EXPECT_TRUE(std::isfinite(loss_g));
  EXPECT_LT(loss_err, kTolLoss) << mc.label() << " loss gpu " << loss_g << " cpu " << loss_c;

  double worst = 0;
  std::string worst_name;
  for (size_t i = 0; i < mg.parameters().size(); ++i) {
    const Parameter& pg = mg.parameters()[i];
    const auto got = download(*gpu, pg.grad), ref = download(*cpu, mcpu.parameters()[i].grad);
    const double ref_norm = norm(ref);
    if (ref_norm == 0) {
      const double n = norm(got);
      std::printf("MODEL_PARITY %-8s %-48s norm %.3e (reference exactly 0)  tol %.1e\n",
                  mc.label().c_str(), pg.name.c_str(), n, kZeroGradNorm);
      EXPECT_LT(n, kZeroGradNorm) << mc.label() << " " << pg.name;
      continue;
    }
    const double e = rel_err(got, ref);
    const double s = std::sqrt(sens[i]), tol = std::max(kTolGrad, kSigmas * s);
    std::printf("MODEL_PARITY %-8s %-48s rel_err %.3e  |ref| %.3e  bf16 noise %.2e  tol %.1e\n",
                mc.label().c_str(), pg.name.c_str(), e, ref_norm, s, tol);
    EXPECT_LT(e, tol) << mc.label() << " gradient of " << pg.name;
    if (e > worst) worst = e, worst_name = pg.name;
  }
  std::printf("MODEL_PARITY %-8s worst gradient %s rel_err %.3e over %zu tensors\n", mc.label().c_str(),
              worst_name.c_str(), worst, mg.parameters().size());
}

INSTANTIATE_TEST_SUITE_P(Modes, ModelParity,
                         ::testing::Values(ModeCase{"standard", 0}, ModeCase{"attnres", 1},
                                           ModeCase{"mhar", 2}, ModeCase{"attnres", 1, 2},
                                           ModeCase{"mhar", 2, 3}, ModeCase{"hyper", 0},
                                           ModeCase{"hyper", 0, 0, true},
                                           ModeCase{"delta", 2, 1},
                                           ModeCase{"standard", 0, 0, false, 48},
                                           ModeCase{"mhar", 2, 0, false, 48}),
                         [](const ::testing::TestParamInfo<ModeCase>& i) {
                           return i.param.label();
                         });

class GpuTraining : public ::testing::TestWithParam<ModeCase> {};

// The quickstart-like tiny model trained for a few dozen AdamW steps on each backend from
// the same weights on the same batches.
TEST_P(GpuTraining, ReachesTheCpuLoss) {
  if (cuda::device_count() == 0) GTEST_SKIP() << "no CUDA device";
  const ModeCase mc = GetParam();
  Config cfg = tiny_gpu_config(mc.mode, mc.heads, 32, mc.block_size, mc.hyper_dynamic);
  cfg.train.micro_batch = 4;
  cfg.train.seq_len = 64;
  cfg.train.steps = 60;
  cfg.train.lr = 3e-3;
  cfg.train.warmup_steps = 5;
  const int B = cfg.train.micro_batch, T = cfg.train.seq_len, steps = cfg.train.steps;
  const std::vector<int32_t> corpus = markov_tokens(size_t(steps) * B * (T + 1) + 1, 11);

  auto cpu = make_cpu_backend(DType::F32);
  auto gpu = make_cuda_backend(0);
  Model mg(cfg.model, cfg.residual, *gpu, B, T), mcpu(cfg.model, cfg.residual, *cpu, B, T);
  same_weights(mg, mcpu, 3, 0.1);
  AdamWOptimizer og(mg, cfg.train), oc(mcpu, cfg.train);
  og.sync_master_from_params();
  oc.sync_master_from_params();
  auto single = make_single_communicator();
  TrainStep step_g(mg, og, *single, cfg.train, 1), step_c(mcpu, oc, *single, cfg.train, 1);

  // The training step `mhar train` runs (engine/train_step.h), one micro-batch.
  auto run_step = [&](TrainStep& ts, int step, const std::vector<int32_t>& x,
                      const std::vector<int32_t>& y) {
    return ts.run(step, [&](int32_t* xs, int32_t* ys) {
      std::copy(x.begin(), x.end(), xs);
      std::copy(y.begin(), y.end(), ys);
    }).loss;
  };
  double tail_g = 0, tail_c = 0, first_g = 0, first_c = 0;
  std::vector<int32_t> x(size_t(B) * T), y(size_t(B) * T);
  for (int s = 0; s < steps; ++s) {
    markov_batch(corpus, size_t(s), B, T, x.data(), y.data());
    const double lg = run_step(step_g, s, x, y);
    const double lc = run_step(step_c, s, x, y);
    if (s == 0) first_g = lg, first_c = lc;
    if (s >= steps - 10) tail_g += lg / 10, tail_c += lc / 10;
    if (s % 10 == 0 || s == steps - 1)
      std::printf("TRAIN %-8s step %2d  gpu %.4f  cpu %.4f\n", mc.label().c_str(), s + 1, lg, lc);
  }
  const double rel = std::fabs(tail_g - tail_c) / tail_c;
  const double tol = mc.hyper_dynamic ? kTolTrainDynamic : kTolTrain;
  std::printf("TRAIN %-8s first loss gpu %.4f cpu %.4f; mean of last 10: gpu %.4f cpu %.4f "
              "(rel diff %.3f, tol %.2f)\n", mc.label().c_str(), first_g, first_c, tail_g, tail_c, rel,
              tol);
  EXPECT_LT(tail_c, 0.6 * first_c) << "the CPU run did not learn: the check would be vacuous";
  EXPECT_LT(tail_g, 0.6 * first_g) << mc.label() << ": the GPU run did not learn";
  EXPECT_LT(rel, tol) << mc.label() << ": GPU training diverges from the CPU's";
}

INSTANTIATE_TEST_SUITE_P(Modes, GpuTraining,
                         ::testing::Values(ModeCase{"standard", 0}, ModeCase{"mhar", 2},
                                           ModeCase{"mhar", 2, 3}, ModeCase{"hyper", 0},
                                           ModeCase{"hyper", 0, 0, true}),
                         [](const ::testing::TestParamInfo<ModeCase>& i) {
                           return i.param.label();
                         });

// Side work (Backend::side_work_begin): the backward's weight gradients on a second stream
// (cuda_backend.cu's side_stream version 2), beside the norm and routing backwards, and
// with them the routing's key gradients (version 3), give the losses and every gradient
// bit for bit as in issue order (version 1): the same ops on the same buffers, only their
// order against the site's backward changed. Two micro-batches accumulate, so the weight
// gradients run both as "=" and "+="; a model larger than the parity tests' gives the
// kernels time to run side by side.
class SideWork : public ::testing::TestWithParam<ModeCase> {};

TEST_P(SideWork, SameBitsAsIssueOrder) {
  if (cuda::device_count() == 0) GTEST_SKIP() << "no CUDA device";
  const ModeCase mc = GetParam();
  Config cfg = tiny_gpu_config(mc.mode, mc.heads, 256, mc.block_size);
  const int B = 8, T = 128;  // T: the tiny model's context length
  auto gpu = make_cuda_backend(0);
  Model m(cfg.model, cfg.residual, *gpu, B, T);
  randomize_weights(m, 42);
  std::vector<int32_t> x[2], y[2];
  for (int k = 0; k < 2; ++k) random_tokens(B * T, cfg.model.vocab_size, 7 + k, x[k], y[k]);

  struct Result {
    double loss[2];
    std::vector<std::vector<double>> grads;
  };
  auto run = [&](int version) {
    const int before = cuda::side_stream_set_version(version);
    Result r;
    m.zero_grads();
    for (int k = 0; k < 2; ++k) {
      r.loss[k] = m.forward(x[k].data(), y[k].data(), 0.5);
      m.backward();
    }
    for (const Parameter& p : m.parameters()) r.grads.push_back(download(*gpu, p.grad));
    cuda::side_stream_set_version(before);
    return r;
  };
  const Result in_order = run(1), again = run(1);
  size_t nonzero = 0;
  for (int k = 0; k < 2; ++k)
    EXPECT_EQ(in_order.loss[k], again.loss[k]) << "issue order is not reproducible: vacuous";
  for (size_t i = 0; i < m.parameters().size(); ++i) {
    ASSERT_EQ(in_order.grads[i], again.grads[i])
        << "issue order is not reproducible: " << m.parameters()[i].name;
    nonzero += norm(in_order.grads[i]) > 0;
  }
  // Every layer's weight gradients are non-zero (only routing site 0's query and gain
  // may be exactly zero: header), so the comparison is not of zeros.
  EXPECT_GT(nonzero, m.parameters().size() / 2);
  // Every version that puts side work on a second stream (2, the default; 3).
  for (int version = 2; version <= cuda::side_stream_versions(); ++version) {
    const Result beside = run(version);
    size_t differing = 0;
    for (int k = 0; k < 2; ++k)
      EXPECT_EQ(beside.loss[k], in_order.loss[k])
          << mc.label() << " micro-batch " << k << ", side_stream " << version;
    for (size_t i = 0; i < m.parameters().size(); ++i) {
      if (beside.grads[i] != in_order.grads[i]) {
        ++differing;
        ADD_FAILURE() << mc.label() << ": " << m.parameters()[i].name
                      << " differs with side work at side_stream " << version;
      }
    }
    std::printf("SIDE_WORK %-8s side_stream %d: %zu tensors (%zu non-zero), %zu differ\n",
                mc.label().c_str(), version, m.parameters().size(), nonzero, differing);
  }
}

INSTANTIATE_TEST_SUITE_P(Modes, SideWork,
                         ::testing::Values(ModeCase{"standard", 0}, ModeCase{"mhar", 2},
                                           ModeCase{"mhar", 2, 3}, ModeCase{"hyper", 0},
                                           ModeCase{"delta", 2, 1}),
                         [](const ::testing::TestParamInfo<ModeCase>& i) {
                           return i.param.label();
                         });

}  // namespace
}  // namespace mhar::test
