// classifier_cudatest.cpp: CUDA fused softmax cross-entropy (losses and the in-place
// logit gradient) against the CPU reference, small, GPT-2-sized and Qwen3-sized
// vocabularies, bf16 and fp32 logits. The kernel reads rows in 16-byte vectors after a
// scalar prologue up to the first 16-byte boundary, with a scalar tail: V = 1001, 50257
// and 12 give rows at every misalignment (prologue, vectors and tail all in use), V a
// multiple of 8 rows that start aligned (vectors only), V = 7 and 3 rows shorter than
// one vector.
#include <gtest/gtest.h>

#include "tests/cuda_test_util.h"

namespace mhar::test {
namespace {

class CrossEntropyParity : public CudaParity {};

TEST_F(CrossEntropyParity, LossesAndLogitGradient) {
  const std::pair<int64_t, int64_t> shapes[] = {{13, 1001}, {4, 50257}, {1, 7},    {6, 12},
                                                {5, 3},     {9, 4096},  {3, 151936}};
  for (auto [N, V] : shapes) {
    for (DType dt : {DType::BF16, DType::F32}) {
      for (bool grad : {false, true}) {
        const std::string tag = "N" + std::to_string(N) + " V" + std::to_string(V) +
                                (dt == DType::F32 ? " f32" : "") + (grad ? " grad" : "");
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
        cpu->cross_entropy(losses.c, logits.c, targets.c, scale, grad);
        gpu->cross_entropy(losses.g, logits.g, targets.g, scale, grad);
        expect_close("cross_entropy losses " + tag, losses.g, losses.c, kTolF32Output);
        // The gradient is stored in the logits' dtype: one rounding to bf16, or fp32.
        if (grad)
          expect_close("cross_entropy dlogits " + tag, logits.g, logits.c,
                       dt == DType::F32 ? kTolF32Output : kTolBf16Output);
      }
    }
  }
}

}  // namespace
}  // namespace mhar::test
