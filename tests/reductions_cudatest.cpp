// reductions_cudatest.cpp: CUDA add, add_inplace, sum_squares, zero and copy against the
// CPU reference. add/add_inplace: the vector path (16-byte aligned, n % 8 tails), the
// scalar path (misaligned), and the dtype mixes the engine uses.
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

// add and add_inplace for every BF16/F32 mix, with the tensors `shift` elements into their
// GPU buffers (shift 1: off 16-byte alignment, the scalar kernels).
TEST_F(ReductionsParity, AddDtypeMixesTailsAndAlignment) {
  auto run = [&](int64_t n, DType to, DType ta, DType tb, int64_t shift) {
    const std::string tag = "n" + std::to_string(n) + " " + dtype_name(to) + "=" +
                            dtype_name(ta) + "+" + dtype_name(tb) +
                            (shift ? " shifted" : "");
    std::vector<Buffer> bufs;
    auto make = [&](DType t, const std::vector<double>& v) {
      bufs.emplace_back(*gpu, t, std::initializer_list<int64_t>{n + shift});
      const Tensor g(static_cast<char*>(bufs.back().t().data) + shift * dtype_size(t), t, {n});
      gpu->upload(g, v.data());
      return g;
    };
    auto get = [&](const Tensor& g) {
      std::vector<double> v(static_cast<size_t>(n));
      gpu->download(v.data(), g);
      return v;
    };
    const std::vector<double> av = random_normal(rng, n, ta), bv = random_normal(rng, n, tb),
                              yv = random_normal(rng, n, to);
    const Tensor ag = make(ta, av), bg = make(tb, bv),
                 og = make(to, std::vector<double>(size_t(n), std::nan(""))), yg = make(to, yv);
    Buffer ac(*cpu, DType::F32, {n}), bc(*cpu, DType::F32, {n}), oc(*cpu, DType::F32, {n}),
        yc(*cpu, DType::F32, {n});
    ac.set(av);
    bc.set(bv);
    yc.set(yv);
    // An F32 output of two values exact in fp32 rounds once in fp32 on both sides.
    const double tol = to == DType::F32 ? 1e-6 : kTolBf16Output;
    cpu->add(oc, ac, bc);
    gpu->add(og, ag, bg);
    expect_close("add " + tag, get(og), oc.get(), tol);
    cpu->add_inplace(yc, ac);
    gpu->add_inplace(yg, ag);
    expect_close("add_inplace " + tag, get(yg), yc.get(), tol);
  };
  for (int64_t n : {int64_t(7), int64_t(8), int64_t(13), int64_t(65536 + 3)})
    for (DType to : {DType::BF16, DType::F32})
      for (DType ta : {DType::BF16, DType::F32})
        for (DType tb : {DType::BF16, DType::F32}) run(n, to, ta, tb, 0);
  run(1003, DType::BF16, DType::BF16, DType::BF16, 1);
  run(1003, DType::F32, DType::BF16, DType::BF16, 1);
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
