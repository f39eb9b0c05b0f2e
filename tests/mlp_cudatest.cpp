// mlp_cudatest.cpp: CUDA SwiGLU forward/backward against the CPU reference, on the vector
// path (16-byte aligned, n % 8 tails of 0..7 elements) and the scalar path (misaligned
// tensors), BF16 and FP32. The backward's recomputed h (the model keeps no h for the
// backward) must be the forward's h bit for bit, and writing it must not change dgate/dup.
#include <gtest/gtest.h>

#include "tests/cuda_test_util.h"

namespace mhar::test {
namespace {

class SwigluParity : public CudaParity {
 protected:
  // gate/up/h/dh/dgate/dup on the GPU start `shift` elements into their buffers.
  void check(int64_t n, DType t, int64_t shift) {
    const std::string tag = "n" + std::to_string(n) + " " + dtype_name(t) +
                            (shift ? " shifted" + std::to_string(shift) : "");
    const double tol = t == DType::F32 ? kTolF32Output : kTolBf16Output;
    std::vector<Buffer> bufs;
    auto make = [&](const std::vector<double>* v) {
      bufs.emplace_back(*gpu, t, std::initializer_list<int64_t>{n + shift});
      const Tensor g(static_cast<char*>(bufs.back().t().data) + shift * dtype_size(t), t, {n});
      const std::vector<double> fill = v ? *v : std::vector<double>(size_t(n), std::nan(""));
      gpu->upload(g, fill.data());
      return g;
    };
    auto get = [&](const Tensor& g) {
      std::vector<double> v(static_cast<size_t>(n));
      gpu->download(v.data(), g);
      return v;
    };
    auto cpu_buf = [&](const std::vector<double>& v) {
      Buffer b(*cpu, DType::F32, {n});
      b.set(v);
      return b;
    };
    const std::vector<double> gate = random_normal(rng, n, t, 2.0), up = random_normal(rng, n, t),
                              dh = random_normal(rng, n, t);
    const Tensor gg = make(&gate), ug = make(&up), hg = make(nullptr), dhg = make(&dh),
                 dgg = make(nullptr), dug = make(nullptr), h2g = make(nullptr);
    Buffer gc = cpu_buf(gate), uc = cpu_buf(up), dhc = cpu_buf(dh);
    Buffer hc(*cpu, DType::F32, {n}), dgc(*cpu, DType::F32, {n}), duc(*cpu, DType::F32, {n});
    cpu->swiglu_forward(hc, gc, uc);
    gpu->swiglu_forward(hg, gg, ug);
    expect_close("swiglu_forward h " + tag, get(hg), hc.get(), tol);
    cpu->swiglu_backward(dgc, duc, Tensor(), dhc, gc, uc);
    gpu->swiglu_backward(dgg, dug, Tensor(), dhg, gg, ug);
    expect_close("swiglu_backward dgate " + tag, get(dgg), dgc.get(), tol);
    expect_close("swiglu_backward dup " + tag, get(dug), duc.get(), tol);
    const std::vector<double> dgate_first = get(dgg), dup_first = get(dug);
    gpu->swiglu_backward(dgg, dug, h2g, dhg, gg, ug);
    expect_same_bits("swiglu_backward's h against the forward's " + tag, get(h2g), get(hg));
    expect_same_bits("swiglu_backward dgate with h " + tag, get(dgg), dgate_first);
    expect_same_bits("swiglu_backward dup with h " + tag, get(dug), dup_first);
  }
};

TEST_F(SwigluParity, ForwardAndBackward) {
  for (int64_t n : {int64_t(1), int64_t(1003), int64_t(37 * 352)}) {
    const std::string tag = "n" + std::to_string(n);
    Pair gate = random_pair(DType::BF16, {n}, 2.0);
    Pair up = random_pair(DType::BF16, {n});
    Pair h = pair(DType::BF16, {n});
    h.g.poison();
    cpu->swiglu_forward(h.c, gate.c, up.c);
    gpu->swiglu_forward(h.g, gate.g, up.g);
    expect_close("swiglu_forward h " + tag, h.g, h.c, kTolBf16Output);

    Pair dh = random_pair(DType::BF16, {n});
    Pair dgate = pair(DType::BF16, {n}), dup = pair(DType::BF16, {n});
    dgate.g.poison();
    dup.g.poison();
    Pair h_again = pair(DType::BF16, {n});
    h_again.g.poison();
    cpu->swiglu_backward(dgate.c, dup.c, h_again.c, dh.c, gate.c, up.c);
    gpu->swiglu_backward(dgate.g, dup.g, h_again.g, dh.g, gate.g, up.g);
    expect_close("swiglu_backward dgate " + tag, dgate.g, dgate.c, kTolBf16Output);
    expect_close("swiglu_backward dup " + tag, dup.g, dup.c, kTolBf16Output);
    expect_same_bits("CPU swiglu_backward's h " + tag, h_again.c.get(), h.c.get());
    expect_same_bits("GPU swiglu_backward's h " + tag, h_again.g.get(), h.g.get());
  }
}

TEST_F(SwigluParity, VectorTailsAndFallbacks) {
  for (int64_t n : {int64_t(7), int64_t(8), int64_t(9), int64_t(15), int64_t(4096 + 5),
                    int64_t(1000003)})
    for (DType t : {DType::BF16, DType::F32}) check(n, t, 0);
  check(1003, DType::BF16, 1);  // 2 bytes off 16-byte alignment: scalar kernels
  check(1003, DType::F32, 1);   // 4 bytes off
  check(1003, DType::BF16, 8);  // 16 bytes in: still aligned, vector kernels
}

}  // namespace
}  // namespace mhar::test
