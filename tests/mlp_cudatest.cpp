// mlp_cudatest.cpp: CUDA SwiGLU forward/backward against the CPU reference, on the
// stacked gate/up layout (gate_up [rows, 2F], row = [gate | up]): the vector path (F a
// multiple of 8, 16-byte aligned), the scalar path (F not a multiple of 8, or misaligned
// tensors), BF16 and FP32. The backward's recomputed h (the model keeps no h for the
// backward) must be the forward's h bit for bit, and writing it must not change d_gate_up.
#include <gtest/gtest.h>

#include "tests/cuda_test_util.h"

namespace mhar::test {
namespace {

class SwigluParity : public CudaParity {
 protected:
  // Every GPU tensor starts `shift` elements into its buffer.
  void check(int64_t rows, int64_t F, DType t, int64_t shift) {
    const std::string tag = std::to_string(rows) + "x" + std::to_string(F) + " " +
                            dtype_name(t) + (shift ? " shifted" + std::to_string(shift) : "");
    const double tol = t == DType::F32 ? kTolF32Output : kTolBf16Output;
    const int64_t n = rows * F;
    std::vector<Buffer> bufs;
    auto make = [&](int64_t cols, const std::vector<double>* v) {
      bufs.emplace_back(*gpu, t, std::initializer_list<int64_t>{rows * cols + shift});
      const Tensor g(static_cast<char*>(bufs.back().t().data) + shift * dtype_size(t), t,
                     {rows, cols});
      const std::vector<double> fill =
          v ? *v : std::vector<double>(size_t(rows * cols), std::nan(""));
      gpu->upload(g, fill.data());
      return g;
    };
    auto get = [&](const Tensor& g) {
      std::vector<double> v(static_cast<size_t>(g.numel()));
      gpu->download(v.data(), g);
      return v;
    };
    auto cpu_buf = [&](int64_t cols, const std::vector<double>* v) {
      Buffer b(*cpu, DType::F32, {rows, cols});
      if (v) b.set(*v);
      return b;
    };
    // The gate half drawn with 2x the spread of the up half: a swap of the halves shows.
    std::vector<double> gate_up(size_t(2 * n));
    const std::vector<double> gate = random_normal(rng, n, t, 2.0), up = random_normal(rng, n, t),
                              dh = random_normal(rng, n, t);
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t c = 0; c < F; ++c) {
        gate_up[size_t(r * 2 * F + c)] = gate[size_t(r * F + c)];
        gate_up[size_t(r * 2 * F + F + c)] = up[size_t(r * F + c)];
      }
    const Tensor gug = make(2 * F, &gate_up), hg = make(F, nullptr), dhg = make(F, &dh),
                 dgug = make(2 * F, nullptr), h2g = make(F, nullptr);
    Buffer guc = cpu_buf(2 * F, &gate_up), dhc = cpu_buf(F, &dh);
    Buffer hc = cpu_buf(F, nullptr), dguc = cpu_buf(2 * F, nullptr);
    cpu->swiglu_forward(hc, guc);
    gpu->swiglu_forward(hg, gug);
    expect_close("swiglu_forward h " + tag, get(hg), hc.get(), tol);
    cpu->swiglu_backward(dguc, Tensor(), dhc, guc);
    gpu->swiglu_backward(dgug, Tensor(), dhg, gug);
    expect_close("swiglu_backward d_gate_up " + tag, get(dgug), dguc.get(), tol);
    const std::vector<double> dgu_first = get(dgug);
    gpu->swiglu_backward(dgug, h2g, dhg, gug);
    expect_same_bits("swiglu_backward's h against the forward's " + tag, get(h2g), get(hg));
    expect_same_bits("swiglu_backward d_gate_up with h " + tag, get(dgug), dgu_first);
  }
};

TEST_F(SwigluParity, ForwardAndBackward) {
  for (auto [rows, F] : {std::pair<int64_t, int64_t>{1, 1}, {17, 59}, {37, 352}}) {
    const std::string tag = std::to_string(rows) + "x" + std::to_string(F);
    Pair gate_up = random_pair(DType::BF16, {rows, 2 * F}, 2.0);
    Pair h = pair(DType::BF16, {rows, F});
    h.g.poison();
    cpu->swiglu_forward(h.c, gate_up.c);
    gpu->swiglu_forward(h.g, gate_up.g);
    expect_close("swiglu_forward h " + tag, h.g, h.c, kTolBf16Output);

    Pair dh = random_pair(DType::BF16, {rows, F});
    Pair d_gate_up = pair(DType::BF16, {rows, 2 * F});
    d_gate_up.g.poison();
    Pair h_again = pair(DType::BF16, {rows, F});
    h_again.g.poison();
    cpu->swiglu_backward(d_gate_up.c, h_again.c, dh.c, gate_up.c);
    gpu->swiglu_backward(d_gate_up.g, h_again.g, dh.g, gate_up.g);
    expect_close("swiglu_backward d_gate_up " + tag, d_gate_up.g, d_gate_up.c, kTolBf16Output);
    expect_same_bits("CPU swiglu_backward's h " + tag, h_again.c.get(), h.c.get());
    expect_same_bits("GPU swiglu_backward's h " + tag, h_again.g.get(), h.g.get());
  }
}

TEST_F(SwigluParity, VectorPathAndFallbacks) {
  // F % 8 == 0: vector kernels; 7, 9, 1003: scalar kernels (a row's halves not 16-byte
  // aligned); rows * F / 8 past 2^31 is beyond a test's memory, the 64-bit division path
  // is the same expression.
  for (auto [rows, F] : {std::pair<int64_t, int64_t>{3, 7}, {5, 8}, {4, 9}, {2, 16},
                         {13, 1003}, {129, 4096 + 8}, {977, 1024}})
    for (DType t : {DType::BF16, DType::F32}) check(rows, F, t, 0);
  check(11, 96, DType::BF16, 1);  // 2 bytes off 16-byte alignment: scalar kernels
  check(11, 96, DType::F32, 1);   // 4 bytes off
  check(11, 96, DType::BF16, 8);  // 16 bytes in: still aligned, vector kernels
}

}  // namespace
}  // namespace mhar::test
