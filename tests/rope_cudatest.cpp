// rope_cudatest.cpp: CUDA RoPE (in place, forward and inverse) against the CPU reference.
#include <gtest/gtest.h>

#include "tests/cuda_test_util.h"

namespace mhar::test {
namespace {

class RopeParity : public CudaParity {};

TEST_F(RopeParity, ForwardAndBackward) {
  for (auto [B, T, H, hd] : {std::tuple<int64_t, int64_t, int64_t, int64_t>{2, 37, 3, 64},
                             {1, 300, 2, 128}, {3, 5, 1, 16}}) {
    for (bool backward : {false, true}) {
      const std::string tag = "B" + std::to_string(B) + " T" + std::to_string(T) + " H" +
                              std::to_string(H) + " hd" + std::to_string(hd) +
                              (backward ? " inverse" : "");
      Pair x = random_pair(DType::BF16, {B, T, H, hd});
      cpu->rope(x.c, 1e6, backward);
      gpu->rope(x.g, 1e6, backward);
      expect_close("rope " + tag, x.g, x.c, kTolBf16Output);
    }
  }
}

TEST_F(RopeParity, AtPositionOffsetForIncrementalDecoding) {
  for (int64_t first : {int64_t(0), int64_t(1), int64_t(777)}) {
    Pair x = random_pair(DType::BF16, {1, 5, 4, 64});
    cpu->rope_at(x.c, 1e6, first);
    gpu->rope_at(x.g, 1e6, first);
    expect_close("rope_at first_position " + std::to_string(first), x.g, x.c, kTolBf16Output);
  }
}

}  // namespace
}  // namespace mhar::test
