// qk_norm_rope_cudatest.cpp: the CUDA fused QK-norm + RoPE (norm.cu) against the CPU
// reference: Backend's defaults are exactly rmsnorm then rope (forward) and inverse rope
// then rmsnorm backward; the reference runs those CPU ops with the intermediate rounded
// to bf16 as the GPU stores it. head_dim 64/128/256 take the fused
// kernels, other head_dims (and misaligned views) the two ops in turn; GQA head counts,
// rope_at offsets, accumulate_dx, F32 weights. Also: the fused GPU result against the
// GPU's own unfused composition. Every kernel-lab version (cuda::norm_set_kernel_version)
// against version 1, bit for bit. Strided x and dx (the model's q and k as columns of
// the stacked q/k/v projection rows): the same bits as the dense call on the fused
// kernels, every version; the scalar fallback within the parity bounds; nothing written
// outside dx's columns.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <random>

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
    gpu->qk_norm_rope_forward(y.g, rstd.g, x.g, w.g, eps, theta, first, 0);
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
    gpu->qk_norm_rope_backward(dx.g, dw.g, dy.g, x.g, w.g, rstd.g, theta, acc, 0);
    expect_close("qk_norm_rope_backward dx " + tag, dx.g, dx.c, kTolBf16Output);
    expect_close("qk_norm_rope_backward dw " + tag, dw.g, dw.c, kTolF32Output);
  }

  // x as columns [col, col + H*hd) of a stacked [B*T, stride] matrix (the model's q or k in
  // the q/k/v projection output; dx into the same columns of the stacked gradient), with
  // x_row_stride = stride, against the dense call on the same GPU: the same bits where both
  // take the same kernel (same_bits: the fused kernels, with a stride a multiple of 8 and
  // 16-byte aligned columns), else the parity bounds (the strided call's scalar norm
  // kernels against the dense call's vector ones). The stacked input's other columns hold
  // NaN (a read of them would show); the stacked gradient's other columns must keep their
  // values. Every kernel-lab version of the fused kernels (all_versions).
  void check_strided(int64_t B, int64_t T, int64_t H, int64_t hd, int64_t stride, int64_t col,
                     int64_t first, bool acc, bool same_bits, bool all_versions = false) {
    const std::string tag = "strided B" + std::to_string(B) + " T" + std::to_string(T) + " H" +
                            std::to_string(H) + " hd" + std::to_string(hd) + " stride" +
                            std::to_string(stride) + " col" + std::to_string(col) +
                            (first ? " at" + std::to_string(first) : "") + (acc ? " acc" : "");
    const double eps = 1e-6, theta = 1e6;
    const int64_t N = B * T, w = H * hd;
    Buffer x = random_gpu(DType::BF16, {N, w}, 2.0), wt = random_gpu(DType::BF16, {hd});
    const std::vector<double> xh = x.get();
    // Columns [col, col + w) of a stacked [N, stride] buffer: a view of them, and the
    // host copy's elements in or out of them.
    auto view = [&](const Buffer& b, std::initializer_list<int64_t> dims) {
      return Tensor(static_cast<char*>(b.t().data) + size_t(col) * 2, DType::BF16, dims);
    };
    auto inside = [&](int64_t i) { return i % stride >= col && i % stride < col + w; };
    Buffer xs(*gpu, DType::BF16, {N * stride});
    {
      std::vector<double> h(size_t(N * stride), std::nan(""));
      for (int64_t n = 0; n < N; ++n)
        for (int64_t c = 0; c < w; ++c) h[size_t(n * stride + col + c)] = xh[size_t(n * w + c)];
      xs.set(h);
    }
    Buffer dy0 = random_gpu(DType::BF16, {B, T, H, hd}), old_dx = random_gpu(DType::BF16, {N, w});
    Buffer dw0 = random_gpu(DType::F32, {hd});
    Buffer y(*gpu, DType::BF16, {B, T, H, hd}), ys(*gpu, DType::BF16, {B, T, H, hd});
    Buffer rstd(*gpu, DType::F32, {N * H}), rstds(*gpu, DType::F32, {N * H});
    Buffer dy(*gpu, DType::BF16, {B, T, H, hd}), dx(*gpu, DType::BF16, {N, w});
    Buffer dxs(*gpu, DType::BF16, {N * stride}), dw(*gpu, DType::F32, {hd}),
        dws(*gpu, DType::F32, {hd});
    using cuda::NormKernel;
    const int versions = all_versions ? cuda::norm_kernel_versions(NormKernel::QkNormRope) : 1;
    for (int v = 1; v <= versions; ++v) {
      if (all_versions) cuda::norm_set_kernel_version(NormKernel::QkNormRope, v);
      const std::string what = tag + (all_versions ? " v" + std::to_string(v) : "");
      y.poison();
      ys.poison();
      gpu->qk_norm_rope_forward(y, rstd, x, wt, eps, theta, first, 0);
      gpu->qk_norm_rope_forward(ys, rstds, view(xs, {N, w}), wt, eps, theta, first, stride);
      if (same_bits) {
        expect_same_bits("qk_norm_rope_forward y " + what, ys.get(), y.get());
        expect_same_bits("qk_norm_rope_forward rstd " + what, rstds.get(), rstd.get());
      } else {
        expect_close("qk_norm_rope_forward y " + what, ys, y, kTolBf16Output);
        expect_close("qk_norm_rope_forward rstd " + what, rstds, rstd, kTolF32Output);
      }
      if (first != 0) continue;  // the backward is a training op: positions from 0

      // The stacked gradient: values to keep outside the columns; inside, the old dx
      // ("+=") or NaN.
      std::vector<double> before(size_t(N * stride));
      std::normal_distribution<double> nd;
      for (double& e : before) e = round_to(DType::BF16, nd(rng));
      {
        std::vector<double> h = before;
        const std::vector<double> old = old_dx.get();
        for (int64_t n = 0; n < N; ++n)
          for (int64_t c = 0; c < w; ++c)
            h[size_t(n * stride + col + c)] = acc ? old[size_t(n * w + c)] : std::nan("");
        dxs.set(h);
      }
      if (acc) gpu->copy(dx, old_dx);
      else dx.poison();
      gpu->copy(dw, dw0);
      gpu->copy(dws, dw0);
      gpu->copy(dy, dy0);  // the unfused path overwrites dy: each call its own copy
      gpu->qk_norm_rope_backward(dx, dw, dy, x, wt, rstd, theta, acc, 0);
      gpu->copy(dy, dy0);
      gpu->qk_norm_rope_backward(view(dxs, {N, w}), dws, dy, view(xs, {N, w}), wt, rstd, theta,
                                 acc, stride);
      const std::vector<double> got = dxs.get();
      std::vector<double> cols(size_t(N * w));
      int64_t changed = 0;
      for (int64_t i = 0; i < N * stride; ++i) {
        if (inside(i)) cols[size_t((i / stride) * w + i % stride - col)] = got[size_t(i)];
        else if (std::memcmp(&got[size_t(i)], &before[size_t(i)], sizeof(double)) != 0) ++changed;
      }
      EXPECT_EQ(changed, 0) << "qk_norm_rope_backward wrote " << changed
                            << " elements outside dx's columns, " << what;
      if (same_bits) {
        expect_same_bits("qk_norm_rope_backward dx " + what, cols, dx.get());
        expect_same_bits("qk_norm_rope_backward dw " + what, dws.get(), dw.get());
      } else {
        expect_close("qk_norm_rope_backward dx " + what, cols, dx.get(), kTolBf16Output);
        expect_close("qk_norm_rope_backward dw " + what, dws, dw, kTolF32Output);
      }
    }
    if (all_versions) cuda::norm_set_kernel_version(NormKernel::QkNormRope, 0);
  }
};

// The model's layouts: q at column 0 and k at column Hq*hd of rows (Hq + 2 Hkv) hd wide
// (GQA 16/8 and 8/8 at head_dim 128, 8/4 at 64, 4/2 at 256; 3/1 where a warp's rows span
// tokens), "+=" too, and decode positions; every kernel-lab version on two of them.
TEST_F(QkNormRopeParity, StridedFusedSameBitsAsDense) {
  struct Case {
    int64_t B, T, Hq, Hkv, hd;
  };
  for (const Case c : {Case{2, 37, 16, 8, 128}, Case{1, 300, 8, 8, 128}, Case{2, 45, 8, 4, 64},
                       Case{1, 33, 4, 2, 256}, Case{2, 29, 3, 1, 128}, Case{1, 41, 3, 1, 64}}) {
    const int64_t stride = (c.Hq + 2 * c.Hkv) * c.hd;
    for (bool acc : {false, true}) {
      check_strided(c.B, c.T, c.Hq, c.hd, stride, 0, 0, acc, true);             // q
      check_strided(c.B, c.T, c.Hkv, c.hd, stride, c.Hq * c.hd, 0, acc, true);  // k
    }
    check_strided(1, c.T, c.Hq, c.hd, stride, 0, 777, false, true);  // decode positions
  }
  check_strided(2, 1000, 16, 128, (16 + 16) * 128, 0, 0, false, true, true);
  check_strided(3, 1001, 3, 64, 5 * 64, 3 * 64, 0, true, true, true);
}

// Strides and columns the fused kernels cannot read 16 bytes at a time (not a multiple of
// 8 elements), and head_dims without a fused kernel: the scalar norm kernels read the
// strided rows, against the dense call within the parity bounds.
TEST_F(QkNormRopeParity, StridedFallbackPaths) {
  check_strided(2, 37, 16, 128, 16 * 128 * 2 + 4, 4, 0, false, false);
  check_strided(2, 37, 8, 64, 8 * 64 + 12, 4, 0, true, false);
  check_strided(2, 17, 3, 16, 3 * 16 * 3, 16, 0, false, false);
  check_strided(1, 9, 2, 96, 2 * 96 * 2 + 3, 5, 0, true, false);
  check_strided(1, 9, 2, 96, 2 * 96 * 2 + 3, 5, 12, false, false);
}

TEST_F(QkNormRopeParity, FusedHeadDims) {
  for (int64_t hd : {int64_t(64), int64_t(128), int64_t(256)}) {
    check(2, 37, 16, hd, 0, false);  // q of GQA 16/8
    check(2, 37, 8, hd, 0, true);    // k
    check(1, 33, 3, hd, 0, false);   // heads not a multiple of a warp's rows
    check(3, 5, 1, hd, 0, true, DType::F32);
  }
  check(8, 300, 4, 128, 0, false);  // many blocks
}

// Every kernel-lab version of the fused kernels (cuda::NormKernel::QkNormRope) gives
// version 1's bits: y and rstd (positions from 0 and decode offsets), dx overwritten and
// "+=", dw. Head counts with a warp's rows on one token (16, 8) and not (3; 4 at head_dim
// 64), row counts with several steps a block on every grid rule.
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
      gpu->qk_norm_rope_forward(y, rstd, x, w, eps, theta, c.first, 0);
      std::vector<std::vector<double>> got = {y.get(), rstd.get()};
      if (c.first == 0) {  // the backward is a training op: positions from 0
        rstd.set(v == 1 ? got[1] : ref[1]);
        for (bool acc : {false, true}) {
          if (acc) gpu->copy(dx, old_dx);
          else dx.poison();
          gpu->copy(dw, dw0);
          gpu->qk_norm_rope_backward(dx, dw, dy, x, w, rstd, theta, acc, 0);
          got.push_back(dx.get());
          got.push_back(dw.get());
        }
      }
      if (v == 1) {
        ref = std::move(got);
        continue;
      }
      for (size_t k = 0; k < got.size(); ++k)
        expect_same_bits("v" + std::to_string(v) + " " + names[k] + " " + tag, got[k], ref[k]);
    }
    cuda::norm_set_kernel_version(NormKernel::QkNormRope, 0);
  }
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
