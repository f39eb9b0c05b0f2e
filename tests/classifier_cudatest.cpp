// classifier_cudatest.cpp: CUDA fused softmax cross-entropy (losses and the in-place
// logit gradient) against the CPU reference, small and GPT-2-sized vocabularies.
#include <gtest/gtest.h>

#include "tests/cuda_test_util.h"

namespace mhar::test {
namespace {

class CrossEntropyParity : public CudaParity {};

TEST_F(CrossEntropyParity, LossesAndLogitGradient) {
  for (auto [N, V] : {std::pair<int64_t, int64_t>{13, 1001}, {4, 50257}, {1, 7}}) {
    for (bool grad : {false, true}) {
      const std::string tag = "N" + std::to_string(N) + " V" + std::to_string(V) +
                              (grad ? " grad" : "");
      std::uniform_int_distribution<int32_t> pick(0, int32_t(V) - 1);
      std::vector<int32_t> ids(static_cast<size_t>(N));
      for (auto& t : ids) t = pick(rng);
      Pair targets = pair(DType::I32, {N});
      cpu->upload_tokens(targets.c, ids.data());
      gpu->upload_tokens(targets.g, ids.data());
      // Logits spread like a trained model's (std 3) so the softmax is far from uniform.
      Pair logits = random_pair(DType::BF16, {N, V}, 3.0);
      Pair losses = pair(DType::F32, {N});
      losses.g.poison();
      const double scale = 1.0 / double(N);
      cpu->cross_entropy(losses.c, logits.c, targets.c, scale, grad);
      gpu->cross_entropy(losses.g, logits.g, targets.g, scale, grad);
      expect_close("cross_entropy losses " + tag, losses.g, losses.c, kTolF32Output);
      if (grad) expect_close("cross_entropy dlogits " + tag, logits.g, logits.c, kTolBf16Output);
    }
  }
}

}  // namespace
}  // namespace mhar::test
