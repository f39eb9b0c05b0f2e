// optimizer_cudatest.cpp: CUDA AdamW against the CPU reference, with fp32 master weights
// written to bf16 parameters, and with an fp32 parameter as its own master.
#include <gtest/gtest.h>

#include "tests/cuda_test_util.h"

namespace mhar::test {
namespace {

class AdamwParity : public CudaParity {};

TEST_F(AdamwParity, MasterWeightsAndPlainFp32) {
  const int64_t n = 100003;
  Backend::AdamW hp{};
  hp.lr = 3e-3;
  hp.beta1 = 0.9;
  hp.beta2 = 0.95;
  hp.eps = 1e-8;
  hp.weight_decay = 0.1;
  hp.grad_scale = 0.5;
  for (bool with_master : {true, false}) {
    const std::string tag = with_master ? "master f32 -> param bf16" : "param f32";
    // The CPU's parameter is its master; start both sides from the same fp32 values.
    auto w0 = random_normal(rng, n, DType::F32, 0.02);
    Pair param = pair(with_master ? DType::BF16 : DType::F32, {n});
    Buffer master(*gpu, DType::F32, {n});
    cpu->upload(param.c, w0.data());
    if (with_master) {
      master.set(w0);
      param.g.poison();
    } else {
      param.g.set(w0);
    }
    Pair m = pair(DType::F32, {n}), v = pair(DType::F32, {n});
    for (long long step = 1; step <= 3; ++step) {
      hp.step = step;
      Pair grad = random_pair(DType::F32, {n}, 1e-2);
      cpu->adamw(param.c, Tensor(), grad.c, m.c, v.c, hp);
      gpu->adamw(param.g, with_master ? master.t() : Tensor(), grad.g, m.g, v.g, hp);
    }
    // Moments and weights are fp32 on both sides (the CPU rounds fp64 arithmetic to fp32
    // once per step): differences stay at fp32 rounding level.
    expect_close("adamw m " + tag, m.g, m.c, kTolF32Output);
    expect_close("adamw v " + tag, v.g, v.c, kTolF32Output);
    if (with_master) {
      expect_close("adamw master " + tag, master.get(), param.c.get(), kTolF32Output);
      expect_close("adamw param " + tag, param.g, param.c, kTolBf16Output);
    } else {
      expect_close("adamw param " + tag, param.g, param.c, kTolF32Output);
    }
  }
}

}  // namespace
}  // namespace mhar::test
