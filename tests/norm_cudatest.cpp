// norm_cudatest.cpp: CUDA RMSNorm forward/backward (also as per-head QK-norm through a
// [N*heads, head_dim] view) against the CPU reference.
#include <gtest/gtest.h>

#include "tests/cuda_test_util.h"

namespace mhar::test {
namespace {

class NormParity : public CudaParity {
 protected:
  void check(int64_t R, int64_t D, bool accumulate_dx) {
    const std::string tag = "R" + std::to_string(R) + " D" + std::to_string(D) +
                            (accumulate_dx ? " acc" : "");
    const double eps = 1e-6;
    Pair x = random_pair(DType::BF16, {R, D}, 2.0, 0.3);
    Pair w = random_pair(DType::BF16, {D}, 0.3, 1.0);
    Pair y = pair(DType::BF16, {R, D});
    Pair rstd = pair(DType::F32, {R});
    y.g.poison();
    rstd.g.poison();
    cpu->rmsnorm_forward(y.c, rstd.c, x.c, w.c, eps);
    gpu->rmsnorm_forward(y.g, rstd.g, x.g, w.g, eps);
    expect_close("rmsnorm_forward y " + tag, y.g, y.c, kTolBf16Output);
    expect_close("rmsnorm_forward rstd " + tag, rstd.g, rstd.c, kTolF32Output);

    // The backward's inputs: the reference's rstd on both sides.
    rstd.g.set(rstd.c.get());
    Pair dy = random_pair(DType::BF16, {R, D});
    Pair dx = accumulate_dx ? random_pair(DType::BF16, {R, D}) : pair(DType::BF16, {R, D});
    if (!accumulate_dx) dx.g.poison();
    Pair dw = random_pair(DType::F32, {D});
    cpu->rmsnorm_backward(dx.c, dw.c, dy.c, x.c, w.c, rstd.c, accumulate_dx);
    gpu->rmsnorm_backward(dx.g, dw.g, dy.g, x.g, w.g, rstd.g, accumulate_dx);
    expect_close("rmsnorm_backward dx " + tag, dx.g, dx.c, kTolBf16Output);
    expect_close("rmsnorm_backward dw " + tag, dw.g, dw.c, kTolF32Output);
  }
};

TEST_F(NormParity, ModelWidthRows) {
  check(37, 96, false);
  check(37, 96, true);
  check(65, 2048, false);
  check(9, 1000, true);  // D not a multiple of 32
  check(3000, 256, false);  // many row slabs for the dw reduction
}

TEST_F(NormParity, PerHeadQkNormView) {
  // q [B=2, T=37, heads=4, hd] normalised per head: R = 2*37*4 rows of head_dim.
  check(2 * 37 * 4, 64, false);
  check(2 * 37 * 4, 128, true);
}

}  // namespace
}  // namespace mhar::test
