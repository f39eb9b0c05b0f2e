// norm_cudatest.cpp: CUDA RMSNorm forward/backward (also as per-head QK-norm through a
// [N*heads, head_dim] view) against the CPU reference. The shapes cover each row
// configuration of norm.cu's vector path (D = 8 .. 4096, lanes per row 8/16/32, 1..16
// vectors per lane), its fallbacks (D not a multiple of 8, D past the vector limits,
// misaligned tensors, FP32 activations), F32 weights, and row counts that leave a block's
// last rows empty; and that the backward's dw is the same bits run to run.
#include <gtest/gtest.h>

#include "tests/cuda_test_util.h"

namespace mhar::test {
namespace {

class NormParity : public CudaParity {
 protected:
  void check(int64_t R, int64_t D, bool accumulate_dx, DType wt = DType::BF16,
             DType act = DType::BF16) {
    const std::string tag = "R" + std::to_string(R) + " D" + std::to_string(D) +
                            (accumulate_dx ? " acc" : "") +
                            (wt == DType::F32 ? " w-f32" : "") +
                            (act == DType::F32 ? " act-f32" : "");
    const double eps = 1e-6;
    Pair x = random_pair(act, {R, D}, 2.0, 0.3);
    Pair w = random_pair(wt, {D}, 0.3, 1.0);
    Pair y = pair(act, {R, D});
    Pair rstd = pair(DType::F32, {R});
    y.g.poison();
    rstd.g.poison();
    cpu->rmsnorm_forward(y.c, rstd.c, x.c, w.c, eps);
    gpu->rmsnorm_forward(y.g, rstd.g, x.g, w.g, eps);
    expect_close("rmsnorm_forward y " + tag, y.g, y.c, kTolBf16Output);
    expect_close("rmsnorm_forward rstd " + tag, rstd.g, rstd.c, kTolF32Output);

    // The backward's inputs: the reference's rstd on both sides.
    rstd.g.set(rstd.c.get());
    Pair dy = random_pair(act, {R, D});
    Pair dx = accumulate_dx ? random_pair(act, {R, D}) : pair(act, {R, D});
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

// Every row configuration of the vector path (D/8 vectors: <=8, <=16, <=32, <=64, <=96,
// <=128, <=160, <=192, <=256; forward only <=384, <=512) with odd row counts, so blocks end
// part-way through their rows; the model widths 512, 1024, 1280, 2048.
TEST_F(NormParity, VectorPathRowConfigs) {
  for (int64_t D : {8, 40, 64, 72, 128, 248, 256, 512, 768, 1024, 1280, 1536, 2048})
    for (int64_t R : {int64_t(1), int64_t(37), int64_t(1001)}) check(R, D, R == 37);
  check(3001, 64, true);  // many blocks, grid-stride over rows
  check(5000, 1280, false);
  // Past 2048 the backward falls back to the scalar kernels; past 4096 the forward too.
  check(33, 3072, false);
  check(33, 4096, true);
  check(9, 4104, false);
}

TEST_F(NormParity, FallbacksAndWeightDtype) {
  check(37, 1280, true, DType::F32);  // fp32 weights on the vector path
  check(37, 64, false, DType::F32);
  check(37, 1004, false);  // D % 8 != 0
  check(37, 12, true);
  check(37, 256, true, DType::BF16, DType::F32);  // FP32 activations: scalar path
}

// A tensor one element into its buffer is 2 bytes off 16-byte alignment: the scalar path.
TEST_F(NormParity, MisalignedTensorsTakeTheScalarPath) {
  const int64_t R = 37, D = 512;
  const double eps = 1e-6;
  Buffer xg(*gpu, DType::BF16, {R * D + 1}), yg(*gpu, DType::BF16, {R * D + 1});
  auto shifted = [](const Buffer& b, std::initializer_list<int64_t> shape) {
    return Tensor(static_cast<char*>(b.t().data) + dtype_size(b.t().dtype), b.t().dtype, shape);
  };
  const Tensor x = shifted(xg, {R, D}), y = shifted(yg, {R, D});
  const std::vector<double> xv = random_normal(rng, R * D, DType::BF16, 2.0, 0.3);
  gpu->upload(x, xv.data());
  const std::vector<double> nan(size_t(R * D), std::nan(""));
  gpu->upload(y, nan.data());
  Pair w = random_pair(DType::BF16, {D}, 0.3, 1.0);
  Pair rstd = pair(DType::F32, {R});
  Buffer xc(*cpu, DType::F32, {R, D}), yc(*cpu, DType::F32, {R, D});
  xc.set(xv);
  cpu->rmsnorm_forward(yc, rstd.c, xc, w.c, eps);
  gpu->rmsnorm_forward(y, rstd.g, x, w.g, eps);
  std::vector<double> got(size_t(R * D));
  gpu->download(got.data(), y);
  expect_close("rmsnorm_forward y misaligned", got, yc.get(), kTolBf16Output);
  expect_close("rmsnorm_forward rstd misaligned", rstd.g, rstd.c, kTolF32Output);
}

// dw is summed without atomics on the vector path: two runs from the same inputs give the
// same bits (dw's own start value included).
TEST_F(NormParity, BackwardDwIsDeterministic) {
  for (int64_t D : {int64_t(64), int64_t(1280), int64_t(2048)}) {
    const int64_t R = 4099;
    Pair x = random_pair(DType::BF16, {R, D}, 2.0, 0.3);
    Pair w = random_pair(DType::BF16, {D}, 0.3, 1.0);
    Pair y = pair(DType::BF16, {R, D}), rstd = pair(DType::F32, {R});
    gpu->rmsnorm_forward(y.g, rstd.g, x.g, w.g, 1e-6);
    Pair dy = random_pair(DType::BF16, {R, D});
    Pair dx = pair(DType::BF16, {R, D});
    const std::vector<double> dw0 = random_normal(rng, D, DType::F32);
    std::vector<std::vector<double>> runs;
    for (int run = 0; run < 3; ++run) {
      dx.g.poison();
      Buffer dw(*gpu, DType::F32, {D});
      dw.set(dw0);
      gpu->rmsnorm_backward(dx.g, dw, dy.g, x.g, w.g, rstd.g, false);
      runs.push_back(dw.get());
    }
    for (int run = 1; run < 3; ++run)
      for (int64_t c = 0; c < D; ++c)
        ASSERT_EQ(runs[size_t(run)][size_t(c)], runs[0][size_t(c)])
            << "D " << D << " column " << c << " run " << run;
  }
}

}  // namespace
}  // namespace mhar::test
