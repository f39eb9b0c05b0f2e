// reductions_cudatest.cpp: CUDA add, add_inplace, sum_squares, zero and copy against the
// CPU reference.
#include <gtest/gtest.h>

#include "tests/cuda_test_util.h"

namespace mhar::test {
namespace {

class ReductionsParity : public CudaParity {};

TEST_F(ReductionsParity, AddAndAddInplace) {
  for (int64_t n : {int64_t(1), int64_t(1000003)}) {
    const std::string tag = "n" + std::to_string(n);
    Pair a = random_pair(DType::BF16, {n}), b = random_pair(DType::BF16, {n});
    Pair out = pair(DType::BF16, {n});
    out.g.poison();
    cpu->add(out.c, a.c, b.c);
    gpu->add(out.g, a.g, b.g);
    expect_close("add bf16 " + tag, out.g, out.c, kTolBf16Output);

    Pair y = random_pair(DType::BF16, {n});
    cpu->add_inplace(y.c, a.c);
    gpu->add_inplace(y.g, a.g);
    expect_close("add_inplace bf16 += bf16 " + tag, y.g, y.c, kTolBf16Output);

    // fp32 += bf16 (an fp32 accumulator fed by bf16 activations): the sum of two values
    // exact in fp32 rounds once in fp32.
    Pair yf = random_pair(DType::F32, {n});
    cpu->add_inplace(yf.c, a.c);
    gpu->add_inplace(yf.g, a.g);
    expect_close("add_inplace f32 += bf16 " + tag, yf.g, yf.c, 1e-6);
  }
}

TEST_F(ReductionsParity, SumSquares) {
  for (DType t : {DType::F32, DType::BF16})
    for (int64_t n : {int64_t(1), int64_t(4097), int64_t(3000017)}) {
      Pair x = random_pair(t, {n});
      const double ref = cpu->sum_squares(x.c), got = gpu->sum_squares(x.g);
      // Squares and sums in fp64 on both sides from identical values: only the order
      // of the fp64 sums differs (~n * 2^-53 relative at worst).
      const double rel = std::fabs(got - ref) / ref;
      std::printf("PARITY %-48s rel_err %.3e\n",
                  ("sum_squares " + std::string(dtype_name(t)) + " n" + std::to_string(n)).c_str(),
                  rel);
      EXPECT_LT(rel, 1e-9) << dtype_name(t) << " n " << n;
    }
}

TEST_F(ReductionsParity, ZeroAndCopy) {
  const int64_t n = 12345;
  Pair src = random_pair(DType::BF16, {n});
  Pair dst = pair(DType::BF16, {n});
  dst.g.poison();
  gpu->copy(dst.g, src.g);
  expect_close("copy", dst.g.get(), src.c.get(), 1e-12);  // bit copy: exact
  gpu->zero(dst.g);
  for (double v : dst.g.get()) ASSERT_EQ(v, 0.0);
}

}  // namespace
}  // namespace mhar::test
