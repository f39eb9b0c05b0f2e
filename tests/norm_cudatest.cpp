// norm_cudatest.cpp: CUDA RMSNorm forward/backward (also as per-head QK-norm through a
// [N*heads, head_dim] view) against the CPU reference. The shapes cover each row
// configuration of norm.cu's vector path (D = 8 .. 4096, lanes per row 8/16/32, 1..16
// vectors per lane), its fallbacks (D not a multiple of 8, D past the vector limits,
// misaligned tensors, FP32 activations), F32 weights, and row counts that leave a block's
// last rows empty; and that the backward's dw is the same bits run to run.
// add_rmsnorm_forward (the fused residual add + norm): against the CPU reference (add,
// x rounded to bf16 as the GPU stores it, then the norm), and bit for bit against the
// GPU's own add then rmsnorm_forward, over the same row configurations and fallbacks,
// x in place of a. The backward's "+=" (the standard scheme adds each norm's dx into the
// running residual gradient with it) against the two-op path dx into a buffer, then
// add_inplace: the one difference, dx's bf16 rounding, bounded per element.
// Every kernel-lab version of the forward, the fused add + norm and the backward
// (cuda::norm_set_kernel_version) gives version 1's bits.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>

#include "cuda/kernels.h"
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

class AddNormParity : public CudaParity {
 protected:
  // x = a + b, then the norm; `in_place`: x is a's buffer (the op allows it, as add does).
  void check(int64_t R, int64_t D, bool in_place = false, DType wt = DType::BF16,
             DType act = DType::BF16) {
    const std::string tag = "R" + std::to_string(R) + " D" + std::to_string(D) +
                            (in_place ? " in-place" : "") + (wt == DType::F32 ? " w-f32" : "") +
                            (act == DType::F32 ? " act-f32" : "");
    const double eps = 1e-6;
    // a: the previous site input, b: a sublayer output (smaller, as in the model).
    Pair a = random_pair(act, {R, D}, 2.0, 0.3), b = random_pair(act, {R, D}, 0.5);
    Pair w = random_pair(wt, {D}, 0.3, 1.0);
    Pair x = pair(act, {R, D}), y = pair(act, {R, D}), rstd = pair(DType::F32, {R});
    // Reference: the CPU's add, x rounded as the GPU stores it, the CPU's norm of that.
    cpu->add(x.c, a.c, b.c);
    x.c.set(rounded(act, x.c.get()));
    cpu->rmsnorm_forward(y.c, rstd.c, x.c, w.c, eps);

    // The GPU's two ops from the same inputs.
    Pair xu = pair(act, {R, D}), yu = pair(act, {R, D}), ru = pair(DType::F32, {R});
    gpu->add(xu.g, a.g, b.g);
    gpu->rmsnorm_forward(yu.g, ru.g, xu.g, w.g, eps);

    y.g.poison();
    rstd.g.poison();
    Tensor xg = x.g;
    if (in_place) xg = a.g;
    else x.g.poison();
    gpu->add_rmsnorm_forward(xg, y.g, rstd.g, a.g, b.g, w.g, eps);
    std::vector<double> xgot(size_t(R * D));
    gpu->download(xgot.data(), xg);
    expect_close("add_rmsnorm_forward x " + tag, xgot, x.c.get(), kTolBf16Output);
    expect_close("add_rmsnorm_forward y " + tag, y.g, y.c, kTolBf16Output);
    expect_close("add_rmsnorm_forward rstd " + tag, rstd.g, rstd.c, kTolF32Output);
    // The same bits as the GPU's add then rmsnorm_forward.
    const std::vector<double> xw = xu.g.get(), yw = yu.g.get(), rw = ru.g.get();
    const std::vector<double> yg = y.g.get(), rg = rstd.g.get();
    for (int64_t i = 0; i < R * D; ++i) {
      ASSERT_EQ(xgot[size_t(i)], xw[size_t(i)]) << tag << " x element " << i;
      ASSERT_EQ(yg[size_t(i)], yw[size_t(i)]) << tag << " y element " << i;
    }
    for (int64_t r = 0; r < R; ++r) ASSERT_EQ(rg[size_t(r)], rw[size_t(r)]) << tag << " rstd row " << r;
  }
};

// Every row configuration of the forward vector path (as VectorPathRowConfigs), odd row
// counts; the model widths.
TEST_F(AddNormParity, VectorPathRowConfigs) {
  for (int64_t D : {8, 40, 64, 128, 248, 512, 768, 1024, 1280, 1536, 2048, 3072, 4096})
    for (int64_t R : {int64_t(1), int64_t(37), int64_t(1001)}) check(R, D);
  check(5000, 1280);  // many blocks, grid-stride over rows
  check(37, 1280, true);
  check(1001, 64, true);
}

TEST_F(AddNormParity, FallbacksTakeTheTwoOps) {
  check(37, 1004);  // D % 8 != 0
  check(9, 4104);   // past the vector path's 4096
  check(37, 1280, false, DType::F32);  // fp32 weights: still the vector path
  check(37, 256, false, DType::BF16, DType::F32);  // FP32 activations
  check(37, 256, true, DType::BF16, DType::F32);
}

// rmsnorm_backward's "+=" against dx into its own buffer, then add_inplace: the same
// bits (cuda/norm.cu rounds dx to bf16 before the fp32 add, as the two-op path stores
// it), on every path: vector (D 64, 1280, 2048) and scalar (D 1004).
TEST_F(NormParity, AccumulatedDxIsTheTwoOpsBitForBit) {
  for (int64_t D : {int64_t(64), int64_t(1280), int64_t(2048), int64_t(1004)}) {
    const int64_t R = 1001;
    Pair x = random_pair(DType::BF16, {R, D}, 2.0, 0.3), w = random_pair(DType::BF16, {D}, 0.3, 1.0);
    Pair y = pair(DType::BF16, {R, D}), rstd = pair(DType::F32, {R});
    gpu->rmsnorm_forward(y.g, rstd.g, x.g, w.g, 1e-6);
    Pair dy = random_pair(DType::BF16, {R, D});
    const std::vector<double> old = random_normal(rng, R * D, DType::BF16, 3.0);
    Buffer fused(*gpu, DType::BF16, {R, D}), two(*gpu, DType::BF16, {R, D}),
        own(*gpu, DType::BF16, {R, D}), dw(*gpu, DType::F32, {D});
    fused.set(old);
    two.set(old);
    gpu->rmsnorm_backward(fused, dw, dy.g, x.g, w.g, rstd.g, true);
    gpu->rmsnorm_backward(own, dw, dy.g, x.g, w.g, rstd.g, false);
    gpu->add_inplace(two, own);
    const BitDifferences d = bit_differences(fused.get(), two.get());
    EXPECT_EQ(d.count, 0) << "D " << D << ": the += differs from dx then add_inplace, first "
                          << d.first;
    std::printf("PARITY rmsnorm_backward += vs two ops D %lld: %lld of %lld elements differ\n",
                (long long)D, (long long)d.count, (long long)(R * D));
  }
}

// Every kernel-lab version (cuda::norm_set_kernel_version) computes each value with version
// 1's operations in version 1's order: y, rstd, the fused add's x, y, rstd (x apart from
// a, and x in a's buffer), dx overwritten and "+=" are version 1's bits, and so is dw for
// backward versions 2-4 (the same partial rows summed in the same order); versions 5-12
// sum their own grid's partial rows, so their dw is compared within fp32 rounding. The
// row counts give each grid rule several steps a block and a part-filled last step (D 4096:
// the forward only; its backward takes the scalar path).
TEST_F(NormParity, EveryKernelVersionSameBits) {
  using cuda::NormKernel;
  const double eps = 1e-6;
  struct Case {
    int64_t R, D;
  };
  for (const Case c : {Case{80001, 64}, Case{50001, 128}, Case{15001, 512}, Case{6001, 1280},
                       Case{3001, 2048}, Case{1501, 4096}}) {
    const int64_t R = c.R, D = c.D;
    const std::string tag = "R" + std::to_string(R) + " D" + std::to_string(D);
    Buffer x = random_gpu(DType::BF16, {R, D}, 2.0), b = random_gpu(DType::BF16, {R, D}, 0.5);
    Buffer w = random_gpu(DType::BF16, {D}), dy = random_gpu(DType::BF16, {R, D});
    Buffer old_dx = random_gpu(DType::BF16, {R, D}), dw0 = random_gpu(DType::F32, {D});
    Buffer y(*gpu, DType::BF16, {R, D}), rstd(*gpu, DType::F32, {R});
    Buffer ax(*gpu, DType::BF16, {R, D}), dx(*gpu, DType::BF16, {R, D}), dw(*gpu, DType::F32, {D});
    const char* fwd_names[] = {"y", "rstd", "add x", "add y", "add rstd", "add x in a", "add y in a"};
    std::vector<std::vector<double>> ref;
    const int fv = cuda::norm_kernel_versions(NormKernel::Forward);
    for (int v = 1; v <= fv; ++v) {
      cuda::norm_set_kernel_version(NormKernel::Forward, v);
      y.poison();
      rstd.poison();
      gpu->rmsnorm_forward(y, rstd, x, w, eps);
      std::vector<std::vector<double>> got = {y.get(), rstd.get()};
      y.poison();
      rstd.poison();
      ax.poison();
      gpu->add_rmsnorm_forward(ax, y, rstd, x, b, w, eps);
      got.push_back(ax.get());
      got.push_back(y.get());
      got.push_back(rstd.get());
      gpu->copy(ax, x);  // x in place of a (the op allows it, as add does)
      y.poison();
      gpu->add_rmsnorm_forward(ax, y, rstd, ax, b, w, eps);
      got.push_back(ax.get());
      got.push_back(y.get());
      if (v == 1) {
        ref = std::move(got);
        continue;
      }
      for (size_t k = 0; k < got.size(); ++k)
        expect_same_bits("forward v" + std::to_string(v) + " " + fwd_names[k] + " " + tag,
                         got[k], ref[k]);
    }
    cuda::norm_set_kernel_version(NormKernel::Forward, 0);
    if (D > 2048) continue;

    rstd.set(ref[1]);
    std::vector<std::vector<double>> bref;
    const int bv = cuda::norm_kernel_versions(NormKernel::Backward);
    for (int v = 1; v <= bv; ++v) {
      cuda::norm_set_kernel_version(NormKernel::Backward, v);
      std::vector<std::vector<double>> got;
      for (bool acc : {false, true}) {
        if (acc) gpu->copy(dx, old_dx);
        else dx.poison();
        gpu->copy(dw, dw0);
        gpu->rmsnorm_backward(dx, dw, dy, x, w, rstd, acc);
        got.push_back(dx.get());
        got.push_back(dw.get());
      }
      if (v == 1) {
        bref = std::move(got);
        continue;
      }
      const char* names[] = {"dx", "dw", "dx +=", "dw (+=)"};
      for (size_t k = 0; k < got.size(); ++k) {
        const std::string what = "backward v" + std::to_string(v) + " " + names[k] + " " + tag;
        // Versions 5-12 sum dw over their own grid's partial rows: another order of fp32
        // sums (11's and 12's varies run to run).
        if (v >= 5 && (k == 1 || k == 3)) expect_close(what, got[k], bref[k], kTolF32Output);
        else expect_same_bits(what, got[k], bref[k]);
      }
    }
    cuda::norm_set_kernel_version(NormKernel::Backward, 0);
  }
}

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
// The backward's numerics: version 1 (versions 2-4 are its bits), versions 5-12 (dw
// summed over their own grids; 7-9 the ring kernel; 11-12 rows taken from a counter).
TEST_F(NormParity, VectorPathRowConfigs) {
  for (int v : {1, 5, 6, 7, 8, 9, 10, 11, 12}) {
    cuda::norm_set_kernel_version(cuda::NormKernel::Backward, v);
    for (int64_t D : {8, 40, 64, 72, 128, 248, 256, 512, 768, 1024, 1280, 1536, 2048})
      for (int64_t R : {int64_t(1), int64_t(37), int64_t(1001)}) check(R, D, R == 37);
    check(5000, 1280, false);
    check(20000, 1280, true);  // several rows a block on version 5's grid
  }
  cuda::norm_set_kernel_version(cuda::NormKernel::Backward, 0);
  check(3001, 64, true);  // many blocks, grid-stride over rows
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

// dw is summed without atomics on every path: two runs from the same inputs give the same
// bits (dw's own start value included). At the default version; lab versions 11 and 12 do
// not (their rows go to whichever warp asks first). D 64, 1280 and 2048 in bf16 take the
// vector path; 4096 (wider than its backward), 100 (not whole vectors) and fp32 rows the
// scalar one, whose slab kernel once added into dw by atomics.
TEST_F(NormParity, BackwardDwIsDeterministic) {
  for (auto [D, dt] : {std::pair{int64_t(64), DType::BF16},
                       {int64_t(1280), DType::BF16},
                       {int64_t(2048), DType::BF16},
                       {int64_t(4096), DType::BF16},
                       {int64_t(100), DType::BF16},
                       {int64_t(1280), DType::F32}}) {
    const int64_t R = 4099;
    Pair x = random_pair(dt, {R, D}, 2.0, 0.3);
    Pair w = random_pair(DType::BF16, {D}, 0.3, 1.0);
    Pair y = pair(dt, {R, D}), rstd = pair(DType::F32, {R});
    gpu->rmsnorm_forward(y.g, rstd.g, x.g, w.g, 1e-6);
    Pair dy = random_pair(dt, {R, D});
    Pair dx = pair(dt, {R, D});
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
            << "D " << D << " " << dtype_name(dt) << " column " << c << " run " << run;
  }
}

}  // namespace
}  // namespace mhar::test
