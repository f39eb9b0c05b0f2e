// rope_cudatest.cpp: CUDA RoPE (in place, forward and inverse) against the CPU reference.
// Covers rope.cu's vector path (BF16, head_dim a multiple of 16: 16, 64, 128, 256) and
// its fallbacks (head_dim/2 not a multiple of 8, FP32, a misaligned tensor), positions far
// from zero (the fp64 angle reduction), and rope_at's position offset.
#include <gtest/gtest.h>

#include "tests/cuda_test_util.h"

namespace mhar::test {
namespace {

class RopeParity : public CudaParity {};

TEST_F(RopeParity, ForwardAndBackward) {
  for (auto [B, T, H, hd] : {std::tuple<int64_t, int64_t, int64_t, int64_t>{2, 37, 3, 64},
                             {1, 300, 2, 128}, {3, 5, 1, 16}, {2, 33, 5, 128}, {1, 17, 3, 256},
                             {2, 9, 16, 128}, {2, 9, 8, 64},  // q and k head counts of GQA
                             {2, 11, 3, 12}, {1, 7, 2, 8}, {1, 7, 2, 2}}) {  // scalar path
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

TEST_F(RopeParity, Fp32ActivationsTakeTheScalarPath) {
  // FP32 storage: no bf16 rounding of the output, so the bound is fp32's: the angle in
  // fp64 and an fp32 sincos of the reduced angle differ from the reference's float(cos)
  // by about an fp32 ulp.
  Pair x = random_pair(DType::F32, {2, 37, 3, 64});
  cpu->rope(x.c, 1e4, false);
  gpu->rope(x.g, 1e4, false);
  expect_close("rope f32 B2 T37 H3 hd64", x.g, x.c, kTolF32Output);
}

TEST_F(RopeParity, MisalignedTensorTakesTheScalarPath) {
  const int64_t B = 1, T = 19, H = 4, hd = 64, n = B * T * H * hd;
  Buffer buf(*gpu, DType::BF16, {n + 1});
  const Tensor xg(static_cast<char*>(buf.t().data) + 2, DType::BF16, {B, T, H, hd});
  const std::vector<double> v = random_normal(rng, n, DType::BF16);
  gpu->upload(xg, v.data());
  Buffer xc(*cpu, DType::F32, {B, T, H, hd});
  xc.set(v);
  cpu->rope(xc, 1e6, false);
  gpu->rope(xg, 1e6, false);
  std::vector<double> got(static_cast<size_t>(n));
  gpu->download(got.data(), xg);
  expect_close("rope misaligned hd64", got, xc.get(), kTolBf16Output);
}

TEST_F(RopeParity, AtPositionOffsetForIncrementalDecoding) {
  for (int64_t first : {int64_t(0), int64_t(1), int64_t(777), int64_t(100000)}) {
    for (int64_t hd : {int64_t(64), int64_t(128), int64_t(12)}) {
      Pair x = random_pair(DType::BF16, {1, 5, 4, hd});
      cpu->rope_at(x.c, 1e6, first);
      gpu->rope_at(x.g, 1e6, first);
      expect_close("rope_at first_position " + std::to_string(first) + " hd" +
                       std::to_string(hd),
                   x.g, x.c, kTolBf16Output);
    }
  }
}

// Long sequences: angles up to T rad for the fastest pair, where an fp32 angle would lose
// ~T * 2^-24 rad; the fp64 angle keeps the output at bf16 rounding. F32 storage so the
// bound sees the angle error, not bf16 rounding.
TEST_F(RopeParity, LongSequenceAngles) {
  Pair x = random_pair(DType::F32, {1, 8192, 1, 64});
  cpu->rope(x.c, 1e4, false);
  gpu->rope(x.g, 1e4, false);
  expect_close("rope f32 T8192 hd64", x.g, x.c, kTolF32Output);
}

}  // namespace
}  // namespace mhar::test
