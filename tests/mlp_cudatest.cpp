// mlp_cudatest.cpp: CUDA SwiGLU forward/backward against the CPU reference.
#include <gtest/gtest.h>

#include "tests/cuda_test_util.h"

namespace mhar::test {
namespace {

class SwigluParity : public CudaParity {};

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
    cpu->swiglu_backward(dgate.c, dup.c, dh.c, gate.c, up.c);
    gpu->swiglu_backward(dgate.g, dup.g, dh.g, gate.g, up.g);
    expect_close("swiglu_backward dgate " + tag, dgate.g, dgate.c, kTolBf16Output);
    expect_close("swiglu_backward dup " + tag, dup.g, dup.c, kTolBf16Output);
  }
}

}  // namespace
}  // namespace mhar::test
