// classifier_cudatest.cpp: CUDA fused softmax cross-entropy (losses and the in-place
// logit gradient) against the CPU reference, small, GPT-2-sized and Qwen3-sized
// vocabularies, bf16 and fp32 logits, every kernel-lab version (cuda/classifier.cu). The
// kernels read rows in 16-byte vectors after a scalar prologue up to the first 16-byte
// boundary, with a scalar tail: V = 1001, 50257 and 12 give rows at every misalignment
// (prologue, vectors and tail all in use), V a multiple of 8 rows that start aligned
// (vectors only), V = 7 and 3 rows shorter than one vector. Version 2's clusters: one
// block a row up to 4096 (bf16: one whole piece of 8 KB; fp32: two), 4 blocks at 50257
// bf16 and 8 in fp32 (4 pieces a block, the last partial), 8 at 151936 (bf16: 5 pieces a
// block; fp32: 10) and at 82005 (misaligned rows of 8 blocks of 3 and 6 pieces).
// Version 3 (bf16 rows; fp32 rows take version 2) stores pass 1's exps in fp16: its
// gradient is off by at most the bf16 rounding (2^-9) plus the fp16 one (2^-11) relative
// per element, so in norm, inside kTolBf16Output's 2^-8 as the other versions' are; exps
// below fp16's normal range (2^-14) lose relative precision, but their absolute error
// (under 2^-25 of the row's largest probability) is nothing in the norm. Version 4 is
// version 3 in fewer instructions: its losses are version 2's bits and its gradient
// version 3's (they could differ only where a probability's factor exp(m - lse) is below
// 2^-126, which version 4 flushes to zero; these logits have none). Version 5 is version 4
// with pass 1's exponents as one FFMA and its sums in another order: its losses are
// checked against the CPU and, row by row, against version 4's within a bound derived
// from both versions' roundings (about 2e-5 at these logits); its gradient against the CPU.
// Versions 6-7 change only the schedule (6 the blocks' exchange, 7 a persistent grid with
// two rows a block in flight): their losses and gradients are version 5's bits, here and,
// for version 7 with many rows a cluster, in PersistentClustersManyRowsACluster. Version
// 8 is version 7 with blocks of 512 threads, so each thread folds half the vectors: its
// sums run in another order and its kept maxima differ, so its losses are checked as
// version 5's are (against the CPU and, row by row, within the rounding bound of version
// 5's), its gradient against the CPU. Version 9 is version 6 with its maxima on bf16's
// grid (rounded up, so kept exactly in 2 bytes): checked as version 8 is, its bound taken
// at maxima up to 2^-7 above the row's largest logit. Its gradient against the CPU also
// checks that the kept maxima are exact: a kept m off by a bf16 rounding (2^-5 at a logit
// of 10) scales its vector's probabilities by ~3%, eight times the bf16 bound. Version 10
// is version 9's kernel on clusters of up to 16 blocks (half the segments): checked as 9.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>

#include "cuda/kernels.h"
#include "tests/cuda_test_util.h"

namespace mhar::test {
namespace {

class CrossEntropyParity : public CudaParity {};

TEST_F(CrossEntropyParity, LossesAndLogitGradient) {
  const std::pair<int64_t, int64_t> shapes[] = {{13, 1001}, {4, 50257}, {1, 7},      {6, 12},
                                                {5, 3},     {9, 4096},  {3, 151936}, {7, 82005}};
  // classifier.cu's versions
  constexpr int kClusters = 2, kKeptExps = 3, kLean = 4, kFma = 5, kSync = 6, kStream = 7,
                kStreamWide = 8, kCoarse = 9, kCoarseWide = 10;
  const int versions = cuda::cross_entropy_versions();
  for (int version = 1; version <= versions; ++version) {
    cuda::cross_entropy_set_version(version);
    for (auto [N, V] : shapes) {
      for (DType dt : {DType::BF16, DType::F32}) {
        for (bool grad : {false, true}) {
          const std::string tag = "v" + std::to_string(version) + " N" + std::to_string(N) + " V" +
                                  std::to_string(V) + (dt == DType::F32 ? " f32" : "") +
                                  (grad ? " grad" : "");
          std::uniform_int_distribution<int32_t> pick(0, int32_t(V) - 1);
          std::vector<int32_t> ids(static_cast<size_t>(N));
          for (auto& t : ids) t = pick(rng);
          Pair targets = pair(DType::I32, {N});
          cpu->upload_tokens(targets.c, ids.data());
          gpu->upload_tokens(targets.g, ids.data());
          // Logits spread like a trained model's (std 3) so the softmax is far from uniform.
          Pair logits = random_pair(dt, {N, V}, 3.0);
          Pair losses = pair(DType::F32, {N});
          losses.g.poison();
          const double scale = 1.0 / double(N);
          // Versions 3-4 change only the gradient's pass: their losses are version 2's
          // bits; version 4's gradient is version 3's.
          std::vector<double> v2_losses, v3_grad;
          if (version >= kKeptExps && version < kFma) {
            Buffer rows(*gpu, dt, {N, V});
            rows.set(logits.g.get());
            cuda::cross_entropy_set_version(kClusters);
            gpu->cross_entropy(losses.g, rows, targets.g, scale, grad);
            v2_losses = losses.g.get();
            losses.g.poison();
            if (version == kLean && grad) {
              rows.set(logits.g.get());
              cuda::cross_entropy_set_version(kKeptExps);
              gpu->cross_entropy(losses.g, rows, targets.g, scale, grad);
              v3_grad = rows.get();
              losses.g.poison();
            }
            cuda::cross_entropy_set_version(version);
          }
          // Version 5 against version 4 (and 8-10 against 5), row by row, within what their
          // roundings allow (u = 2^-24; M the row's largest |logit|, versions 9-10's maxima
          // up to a bf16 ulp, 2^-7 M, above it: M (1 + 2^-7) there): each one's sum of exps
          // is off by at most 64 additions' u (a thread's vectors, the tree, the warp, block
          // and cluster merges: at most ~45 at these shapes, with 512 threads or 16 blocks)
          // and each exp by u(2M) from its exponent's rounding (version 5: u M more from m
          // log2 e's) plus ex2.approx's 2u; then logf's 2u |lse| each and the subtraction's
          // u |loss|, |lse| <= M + log V, |loss| <= 2M + log V.
          std::vector<double> ref_losses, row_bound;
          const bool coarse = version == kCoarse || version == kCoarseWide;
          const int ref_version = version == kFma                    ? kLean
                                  : version == kStreamWide || coarse ? kFma
                                                                     : 0;
          if (ref_version != 0) {
            Buffer rows(*gpu, dt, {N, V});
            const std::vector<double> x = logits.g.get();
            rows.set(x);
            cuda::cross_entropy_set_version(ref_version);
            gpu->cross_entropy(losses.g, rows, targets.g, scale, grad);
            ref_losses = losses.g.get();
            losses.g.poison();
            cuda::cross_entropy_set_version(version);
            for (int64_t n = 0; n < N; ++n) {
              double M = 0;
              for (int64_t v = 0; v < V; ++v) M = std::max(M, std::abs(x[size_t(n * V + v)]));
              if (coarse) M *= 1 + std::ldexp(1.0, -7);
              const double log_v = std::log(double(V));
              const double fma_versions = ref_version == kLean ? 1 : 2;
              row_bound.push_back(std::ldexp(1.0, -24) *
                                  (2 * 64 + 2 * 2 * M + fma_versions * M + 2 * 2 +
                                   2 * 2 * (M + log_v) + 2 * (2 * M + log_v)));
            }
          }
          // Versions 6-7 change only the schedule: version 5's losses and gradient.
          std::vector<double> v5_losses, v5_grad;
          if (version == kSync || version == kStream) {
            Buffer rows(*gpu, dt, {N, V});
            rows.set(logits.g.get());
            cuda::cross_entropy_set_version(kFma);
            gpu->cross_entropy(losses.g, rows, targets.g, scale, grad);
            v5_losses = losses.g.get();
            v5_grad = rows.get();
            losses.g.poison();
            cuda::cross_entropy_set_version(version);
          }
          cpu->cross_entropy(losses.c, logits.c, targets.c, scale, grad);
          gpu->cross_entropy(losses.g, logits.g, targets.g, scale, grad);
          if (!v5_losses.empty()) {
            EXPECT_TRUE(losses.g.get() == v5_losses) << tag << ": losses differ from version 5";
            EXPECT_TRUE(logits.g.get() == v5_grad) << tag << ": rows differ from version 5";
          }
          expect_close("cross_entropy losses " + tag, losses.g, losses.c, kTolF32Output);
          if (!v2_losses.empty()) {
            EXPECT_TRUE(losses.g.get() == v2_losses) << tag << ": losses differ from version 2";
          }
          if (!ref_losses.empty()) {
            const std::vector<double> got = losses.g.get();
            for (size_t n = 0; n < got.size(); ++n)
              EXPECT_LE(std::abs(got[n] - ref_losses[n]), row_bound[n])
                  << tag << ": row " << n << " against version " << ref_version;
          }
          if (!v3_grad.empty()) {
            EXPECT_TRUE(logits.g.get() == v3_grad) << tag << ": gradient differs from version 3";
          }
          // The gradient is stored in the logits' dtype: one rounding to bf16, or fp32.
          if (grad)
            expect_close("cross_entropy dlogits " + tag, logits.g, logits.c,
                         dt == DType::F32 ? kTolF32Output : kTolBf16Output);
        }
      }
    }
  }
  cuda::cross_entropy_set_version(0);
}

// Versions 7-8's grid holds as many clusters as are resident at once (on an H200 at most
// 33 of 8 blocks at Qwen3's rows, 99 of 4 at GPT-2's, 1,056 of 1 at 4,096 bf16 logits), each
// taking every G-th row with two in flight: rows enough for several a cluster, so that
// both buffers, both state slots and the barriers' later phases are used, and row counts
// that leave some clusters one row more than others. Version 7's losses and gradients are
// version 6's bits (which the test above checks against the CPU and version 5); version
// 8's, folded in another order, are checked against the CPU by the bounds the test above
// uses.
TEST_F(CrossEntropyParity, PersistentClustersManyRowsACluster) {
  constexpr int kSync = 6, kStream = 7, kStreamWide = 8;  // classifier.cu's
  ASSERT_GE(cuda::cross_entropy_versions(), kStreamWide);
  const std::pair<int64_t, int64_t> shapes[] = {
      {101, 151936}, {301, 50257}, {203, 82005}, {2503, 4096}, {3, 151936}};
  for (auto [N, V] : shapes) {
    for (bool grad : {false, true}) {
      const std::string tag =
          "N" + std::to_string(N) + " V" + std::to_string(V) + (grad ? " grad" : "");
      std::uniform_int_distribution<int32_t> pick(0, int32_t(V) - 1);
      std::vector<int32_t> ids(static_cast<size_t>(N));
      for (auto& t : ids) t = pick(rng);
      Pair targets = pair(DType::I32, {N});
      cpu->upload_tokens(targets.c, ids.data());
      gpu->upload_tokens(targets.g, ids.data());
      Pair logits = pair(DType::BF16, {N, V});
      const std::vector<double> x = random_normal(rng, N * V, DType::BF16, 3.0);
      Pair losses = pair(DType::F32, {N});
      logits.c.set(x);
      cpu->cross_entropy(losses.c, logits.c, targets.c, 1.0 / double(N), grad);
      std::vector<double> want_losses, want_rows;
      for (int version : {kSync, kStream, kStreamWide}) {
        cuda::cross_entropy_set_version(version);
        logits.g.set(x);
        losses.g.poison();
        gpu->cross_entropy(losses.g, logits.g, targets.g, 1.0 / double(N), grad);
        const std::string vtag = tag + " v" + std::to_string(version);
        if (version == kSync) {
          want_losses = losses.g.get(), want_rows = logits.g.get();
        } else if (version == kStream) {
          EXPECT_TRUE(losses.g.get() == want_losses) << vtag << ": losses differ from version 6";
          EXPECT_TRUE(logits.g.get() == want_rows) << vtag << ": rows differ from version 6";
          continue;
        }
        expect_close("cross_entropy many rows losses " + vtag, losses.g, losses.c, kTolF32Output);
        if (grad)
          expect_close("cross_entropy many rows dlogits " + vtag, logits.g, logits.c,
                       kTolBf16Output);
      }
    }
  }
  cuda::cross_entropy_set_version(0);
}

}  // namespace
}  // namespace mhar::test
