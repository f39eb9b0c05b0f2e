// qk_norm_rope_cudatest.cpp: the CUDA fused QK-norm + RoPE (norm.cu) against the CPU
// reference: Backend's defaults are exactly rmsnorm then rope (forward) and inverse rope
// then rmsnorm backward; the reference runs those CPU ops with the intermediate rounded
// to bf16 as the GPU stores it. head_dim 64/128/256 take the fused
// kernels, other head_dims (and misaligned views) the two ops in turn; GQA head counts,
// rope_at offsets, accumulate_dx, F32 weights. Also: the fused GPU result against the
// GPU's own unfused composition. Every kernel-lab version (cuda::norm_set_kernel_version)
// against version 1, bit for bit. q and k in one launch against the two calls.
#include <gtest/gtest.h>

#include "cuda/kernels.h"
#include "tests/cuda_test_util.h"

namespace mhar::test {
namespace {

class QkNormRopeParity : public CudaParity {
 protected:
  void check(int64_t B, int64_t T, int64_t H, int64_t hd, int64_t first, bool acc,
             DType wt = DType::BF16) {
    const std::string tag = "B" + std::to_string(B) + " T" + std::to_string(T) + " H" +
                            std::to_string(H) + " hd" + std::to_string(hd) +
                            (first ? " at" + std::to_string(first) : "") + (acc ? " acc" : "") +
                            (wt == DType::F32 ? " w-f32" : "");
    const double eps = 1e-6, theta = 1e6;
    Pair x = random_pair(DType::BF16, {B * T, H * hd}, 2.0, 0.3);  // as the model's q_pre
    Pair w = random_pair(wt, {hd}, 0.3, 1.0);
    Pair y = pair(DType::BF16, {B, T, H, hd});
    Pair rstd = pair(DType::F32, {B * T * H});
    y.g.poison();
    rstd.g.poison();
    // The reference is the composition with the intermediate stored as the GPU stores
    // it (bf16; the fused kernels round there too): without that rounding the bf16 error
    // of the intermediate would dominate dw's fp32 comparison.
    auto round_bf16 = [](Buffer& b) { b.set(rounded(DType::BF16, b.get())); };
    cpu->rmsnorm_forward(y.c, rstd.c, x.c, w.c, eps);
    round_bf16(y.c);
    if (first == 0) cpu->rope(y.c, theta, false);
    else cpu->rope_at(y.c, theta, first);
    gpu->qk_norm_rope_forward(y.g, rstd.g, x.g, w.g, eps, theta, first);
    expect_close("qk_norm_rope_forward y " + tag, y.g, y.c, kTolBf16Output);
    expect_close("qk_norm_rope_forward rstd " + tag, rstd.g, rstd.c, kTolF32Output);

    // The GPU's unfused composition from the same inputs.
    Pair yu = pair(DType::BF16, {B, T, H, hd});
    gpu->rmsnorm_forward(yu.g, rstd.g, x.g, w.g, eps);
    if (first == 0) gpu->rope(yu.g, theta, false);
    else gpu->rope_at(yu.g, theta, first);
    expect_close("qk_norm_rope_forward fused vs unfused GPU " + tag, y.g, yu.g, kTolBf16Output);

    if (first != 0) return;  // the backward is a training op: positions from 0
    rstd.g.set(rstd.c.get());
    Pair dy = random_pair(DType::BF16, {B, T, H, hd});
    Pair dx = acc ? random_pair(DType::BF16, {B * T, H * hd}) : pair(DType::BF16, {B * T, H * hd});
    if (!acc) dx.g.poison();
    Pair dw = random_pair(DType::F32, {hd});
    cpu->rope(dy.c, theta, true);
    round_bf16(dy.c);
    cpu->rmsnorm_backward(dx.c, dw.c, dy.c, x.c, w.c, rstd.c, acc);
    gpu->qk_norm_rope_backward(dx.g, dw.g, dy.g, x.g, w.g, rstd.g, theta, acc);
    expect_close("qk_norm_rope_backward dx " + tag, dx.g, dx.c, kTolBf16Output);
    expect_close("qk_norm_rope_backward dw " + tag, dw.g, dw.c, kTolF32Output);
  }
};

// Both numerics of the fused kernels: version 1 (versions 2-5 are its bits, below) and
// version 6 (the paired-lane kernels, whose row sums take their terms in another order);
// and version 7, the default, whose single calls must run version 6's kernels.
TEST_F(QkNormRopeParity, FusedHeadDims) {
  for (int v : {1, 6, 7}) {
    cuda::norm_set_kernel_version(cuda::NormKernel::QkNormRope, v);
    for (int64_t hd : {int64_t(64), int64_t(128), int64_t(256)}) {
      check(2, 37, 16, hd, 0, false);  // q of GQA 16/8
      check(2, 37, 8, hd, 0, true);    // k
      check(1, 33, 3, hd, 0, false);   // heads not a multiple of a warp's rows
      check(3, 5, 1, hd, 0, true, DType::F32);
    }
    check(8, 300, 4, 128, 0, false);  // many blocks
    check(1, 40, 4, 64, 7, false);    // decode positions inside the table
  }
  cuda::norm_set_kernel_version(cuda::NormKernel::QkNormRope, 0);
}

// Every kernel-lab version of the fused kernels (cuda::NormKernel::QkNormRope) up to 5
// gives version 1's bits: y and rstd (positions from 0 and decode offsets), dx overwritten
// and "+=", dw. Head counts with a warp's rows on one token (16, 8) and not (3; 4 at
// head_dim 64), row counts with several steps a block on every grid rule. Version 6 sums a
// row's terms in another order: within the outputs' rounding of version 1 (and against
// the CPU in FusedHeadDims); where no table covers the positions (at 100000) it runs
// version 3, so there too the same bits. Version 7 runs version 6's kernels for one tensor.
TEST_F(QkNormRopeParity, EveryKernelVersionSameBits) {
  using cuda::NormKernel;
  const double eps = 1e-6, theta = 1e6;
  struct Case {
    int64_t B, T, H, hd, first;
  };
  for (const Case c : {Case{2, 1000, 16, 128, 0}, Case{4, 1000, 8, 128, 0}, Case{3, 3001, 3, 128, 0},
                       Case{2, 2000, 16, 64, 0}, Case{2, 2001, 4, 64, 0}, Case{1, 900, 16, 256, 0},
                       Case{2, 999, 16, 128, 777}, Case{1, 2001, 8, 64, 100000}}) {
    const int64_t B = c.B, T = c.T, H = c.H, hd = c.hd, R = B * T * H;
    const std::string tag = "B" + std::to_string(B) + " T" + std::to_string(T) + " H" +
                            std::to_string(H) + " hd" + std::to_string(hd) + " at" +
                            std::to_string(c.first);
    Buffer x = random_gpu(DType::BF16, {B * T, H * hd}, 2.0), w = random_gpu(DType::BF16, {hd});
    Buffer dy = random_gpu(DType::BF16, {B, T, H, hd}), old_dx = random_gpu(DType::BF16, {B * T, H * hd});
    Buffer dw0 = random_gpu(DType::F32, {hd});
    Buffer y(*gpu, DType::BF16, {B, T, H, hd}), rstd(*gpu, DType::F32, {R});
    Buffer dx(*gpu, DType::BF16, {B * T, H * hd}), dw(*gpu, DType::F32, {hd});
    const char* names[] = {"y", "rstd", "dx", "dw", "dx +=", "dw (+=)"};
    std::vector<std::vector<double>> ref;
    const int versions = cuda::norm_kernel_versions(NormKernel::QkNormRope);
    for (int v = 1; v <= versions; ++v) {
      cuda::norm_set_kernel_version(NormKernel::QkNormRope, v);
      y.poison();
      rstd.poison();
      gpu->qk_norm_rope_forward(y, rstd, x, w, eps, theta, c.first);
      std::vector<std::vector<double>> got = {y.get(), rstd.get()};
      if (c.first == 0) {  // the backward is a training op: positions from 0
        rstd.set(v == 1 ? got[1] : ref[1]);
        for (bool acc : {false, true}) {
          if (acc) gpu->copy(dx, old_dx);
          else dx.poison();
          gpu->copy(dw, dw0);
          gpu->qk_norm_rope_backward(dx, dw, dy, x, w, rstd, theta, acc);
          got.push_back(dx.get());
          got.push_back(dw.get());
        }
      }
      if (v == 1) {
        ref = std::move(got);
        continue;
      }
      for (size_t k = 0; k < got.size(); ++k) {
        const std::string what = "v" + std::to_string(v) + " " + names[k] + " " + tag;
        if (v <= 5 || c.first == 100000) {
          expect_same_bits(what, got[k], ref[k]);
        } else {
          const bool f32 = k == 1 || k == 3 || k == 5;  // rstd, dw
          expect_close(what, got[k], ref[k], f32 ? kTolF32Output : kTolBf16Output);
        }
      }
    }
    cuda::norm_set_kernel_version(NormKernel::QkNormRope, 0);
  }
}

// q and k in one call (Backend::qk_norm_rope_forward_qk / _backward_qk) at QK lab version
// 7: the two single calls' bits for y, rstd and dx (overwritten and "+="); dw within fp32
// rounding (each tensor's partial rows come from its share of the one grid). Shapes where
// both take the paired-lane kernels must run as one launch (cuda::qk_pair_launches counts
// them); head_dim 96 takes the two calls.
TEST_F(QkNormRopeParity, QkInOneLaunchIsTheTwoCalls) {
  const double eps = 1e-6, theta = 1e6;
  cuda::norm_set_kernel_version(cuda::NormKernel::QkNormRope, 7);
  struct Case {
    int64_t B, T, Hq, Hk, hd, first;
    bool one_launch;
  };
  for (const Case c : {Case{2, 1000, 16, 8, 128, 0, true}, Case{2, 37, 16, 8, 64, 0, true},
                       Case{1, 33, 3, 5, 128, 0, true}, Case{1, 40, 16, 8, 256, 0, true},
                       Case{2, 999, 16, 8, 128, 777, true}, Case{2, 17, 4, 2, 96, 0, false}}) {
    const int64_t B = c.B, T = c.T, hd = c.hd;
    const std::string tag = "B" + std::to_string(B) + " T" + std::to_string(T) + " H" +
                            std::to_string(c.Hq) + "/" + std::to_string(c.Hk) + " hd" +
                            std::to_string(hd) + " at" + std::to_string(c.first);
    struct Side {
      Buffer x, w, dy, old_dx, dw0;
      int64_t H;
    };
    std::vector<Side> sides;
    for (int64_t H : {c.Hq, c.Hk})
      sides.push_back(Side{random_gpu(DType::BF16, {B * T, H * hd}, 2.0),
                           random_gpu(DType::BF16, {hd}),
                           random_gpu(DType::BF16, {B, T, H, hd}),
                           random_gpu(DType::BF16, {B * T, H * hd}), random_gpu(DType::F32, {hd}),
                           H});
    // Outputs of a pass: y, rstd per side, then dx, dw per side and acc.
    auto run = [&](bool one_call) {
      std::vector<std::vector<double>> got;
      std::vector<Buffer> y, rstd, dx, dw;
      for (const Side& sd : sides) {
        y.emplace_back(*gpu, DType::BF16, std::initializer_list<int64_t>{B, T, sd.H, hd});
        rstd.emplace_back(*gpu, DType::F32, std::initializer_list<int64_t>{B * T * sd.H});
        dx.emplace_back(*gpu, DType::BF16, std::initializer_list<int64_t>{B * T, sd.H * hd});
        dw.emplace_back(*gpu, DType::F32, std::initializer_list<int64_t>{hd});
        y.back().poison();
        rstd.back().poison();
      }
      if (one_call) {
        gpu->qk_norm_rope_forward_qk({y[0], rstd[0], sides[0].x, sides[0].w},
                                     {y[1], rstd[1], sides[1].x, sides[1].w}, eps, theta, c.first);
      } else {
        for (size_t i = 0; i < 2; ++i)
          gpu->qk_norm_rope_forward(y[i], rstd[i], sides[i].x, sides[i].w, eps, theta, c.first);
      }
      for (size_t i = 0; i < 2; ++i) {
        got.push_back(y[i].get());
        got.push_back(rstd[i].get());
      }
      if (c.first != 0) return got;  // the backward is a training op: positions from 0
      for (bool acc : {false, true}) {
        for (size_t i = 0; i < 2; ++i) {
          if (acc) gpu->copy(dx[i], sides[i].old_dx);
          else dx[i].poison();
          gpu->copy(dw[i], sides[i].dw0);
        }
        // dy is unspecified after a backward: a copy each time.
        Buffer dyq(*gpu, DType::BF16, {B, T, c.Hq, hd}), dyk(*gpu, DType::BF16, {B, T, c.Hk, hd});
        gpu->copy(dyq, sides[0].dy);
        gpu->copy(dyk, sides[1].dy);
        if (one_call) {
          gpu->qk_norm_rope_backward_qk({dx[0], dw[0], dyq, sides[0].x, sides[0].w, rstd[0]},
                                        {dx[1], dw[1], dyk, sides[1].x, sides[1].w, rstd[1]}, theta,
                                        acc);
        } else {
          gpu->qk_norm_rope_backward(dx[0], dw[0], dyq, sides[0].x, sides[0].w, rstd[0], theta,
                                     acc);
          gpu->qk_norm_rope_backward(dx[1], dw[1], dyk, sides[1].x, sides[1].w, rstd[1], theta,
                                     acc);
        }
        for (size_t i = 0; i < 2; ++i) {
          got.push_back(dx[i].get());
          got.push_back(dw[i].get());
        }
      }
      return got;
    };
    const auto two = run(false);
    const int64_t launches = cuda::qk_pair_launches();
    const auto one = run(true);
    EXPECT_EQ(cuda::qk_pair_launches() - launches, c.one_launch ? (c.first == 0 ? 3 : 1) : 0)
        << tag << ": launches of q and k together";
    ASSERT_EQ(one.size(), two.size());
    const char* names[] = {"y", "rstd"};
    for (size_t k = 0; k < one.size(); ++k) {
      const bool fwd = k < 4, is_q = (k / 2) % 2 == 0;
      const std::string what = std::string(fwd ? names[k % 2] : k % 2 ? "dw" : "dx") +
                               (fwd ? "" : k >= 8 ? " +=" : "") + (is_q ? " q " : " k ") + tag;
      if (!fwd && k % 2 == 1) expect_close("one launch " + what, one[k], two[k], kTolF32Output);
      else expect_same_bits("one launch " + what, one[k], two[k]);
    }
  }
  cuda::norm_set_kernel_version(cuda::NormKernel::QkNormRope, 0);
}

TEST_F(QkNormRopeParity, OtherHeadDimsTakeTheTwoOps) {
  check(2, 17, 3, 16, 0, false);
  check(2, 17, 3, 96, 0, true);
  check(1, 9, 2, 12, 0, false);
}

TEST_F(QkNormRopeParity, DecodePositions) {
  for (int64_t first : {int64_t(1), int64_t(777), int64_t(100000)})
    for (int64_t hd : {int64_t(64), int64_t(128), int64_t(16)}) check(1, 5, 4, hd, first, false);
}

}  // namespace
}  // namespace mhar::test
