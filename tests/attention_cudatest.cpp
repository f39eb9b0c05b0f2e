// attention_cudatest.cpp: CUDA causal GQA attention forward/backward against the CPU
// reference, head_dim 64 and 128, GQA ratios 1, 2, 3 and 8, T not a multiple of the tiles;
// forward and backward through each BF16 kernel the device has (Hopper wgmma, mma.sync).
// StridedVSameBitsAsDense: v and dv as columns of the stacked q/k/v rows (the model's
// layout) on every path, bit for bit against the dense call, nothing else written.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <random>
#include <vector>

#include "cuda/kernels.h"
#include "tests/cuda_test_util.h"

namespace mhar::test {
namespace {

struct AttnCase {
  int64_t B, T, Hq, Hkv, hd;
};

class AttentionParity : public CudaParity, public ::testing::WithParamInterface<AttnCase> {};

TEST_P(AttentionParity, ForwardAndBackward) {
  const AttnCase c = GetParam();
  const std::string tag = "B" + std::to_string(c.B) + " T" + std::to_string(c.T) + " Hq" +
                          std::to_string(c.Hq) + " Hkv" + std::to_string(c.Hkv) + " hd" +
                          std::to_string(c.hd);
  // q scaled by 2 makes some rows' softmax peaked, others flat.
  Pair q = random_pair(DType::BF16, {c.B, c.T, c.Hq, c.hd}, 2.0);
  Pair k = random_pair(DType::BF16, {c.B, c.T, c.Hkv, c.hd});
  Pair v = random_pair(DType::BF16, {c.B, c.T, c.Hkv, c.hd});
  Pair out = pair(DType::BF16, {c.B, c.T, c.Hq, c.hd});
  Pair lse = pair(DType::F32, {c.B, c.Hq, c.T});
  cpu->attention_forward(out.c, lse.c, q.c, k.c, v.c, 0);
  // Both BF16 forward kernels, where the device has both: the Hopper wgmma kernel and the
  // mma.sync one (cuda::attention_set_hopper); each against the reference, same bounds.
  const bool had_hopper = cuda::attention_set_hopper(true);
  std::vector<bool> paths{false};  // use_hopper
  if (cuda::attention_uses_hopper()) paths.insert(paths.begin(), true);
  else std::printf("PARITY attention %s: no Hopper kernels on this device\n", tag.c_str());
  auto path_name = [](bool use_hopper) { return use_hopper ? " (wgmma) " : " (mma.sync) "; };
  for (const bool use_hopper : paths) {
    cuda::attention_set_hopper(use_hopper);
    const std::string path = path_name(use_hopper);
    out.g.poison();
    lse.g.poison();
    gpu->attention_forward(out.g, lse.g, q.g, k.g, v.g, 0);
    expect_close("attention_forward out" + path + tag, out.g, out.c, kTolBf16Output);
    expect_close("attention_forward lse" + path + tag, lse.g, lse.c, kTolF32Output);
  }
  cuda::attention_set_hopper(had_hopper);

  // Backward from the same saved tensors on both sides: the reference's out, rounded to
  // what the GPU stores, and its lse.
  out.set(rounded(DType::BF16, out.c.get()));
  lse.g.set(lse.c.get());
  Pair dout = random_pair(DType::BF16, {c.B, c.T, c.Hq, c.hd});
  Pair dq = pair(DType::BF16, {c.B, c.T, c.Hq, c.hd});
  Pair dk = pair(DType::BF16, {c.B, c.T, c.Hkv, c.hd});
  Pair dv = pair(DType::BF16, {c.B, c.T, c.Hkv, c.hd});
  cpu->attention_backward(dq.c, dk.c, dv.c, dout.c, q.c, k.c, v.c, out.c, lse.c, 0);
  for (const bool use_hopper : paths) {
    cuda::attention_set_hopper(use_hopper);
    const std::string path = path_name(use_hopper);
    dq.g.poison();
    dk.g.poison();
    dv.g.poison();
    gpu->attention_backward(dq.g, dk.g, dv.g, dout.g, q.g, k.g, v.g, out.g, lse.g, 0);
    if (c.T == 1) {
      // One key: p = 1 and D = dout.out = dout.v = dp, so ds = 0 and dq = dk = 0 exactly;
      // the GPU's two fp32 dot products of hd O(1) terms differ by rounding only (~1e-6).
      for (const Pair* g : {&dq, &dk}) {
        const Comparison cmp = compare(g->g.get(), g->c.get());
        std::printf("PARITY %-48s max_abs %.3e (exact gradient is 0)\n",
                    ("attention_backward dq/dk" + path + tag).c_str(), cmp.max_abs_err);
        EXPECT_EQ(cmp.bad, 0);
        EXPECT_LT(cmp.max_abs_err, 1e-5);
      }
    } else {
      expect_close("attention_backward dq" + path + tag, dq.g, dq.c, kTolBf16Output);
      expect_close("attention_backward dk" + path + tag, dk.g, dk.c, kTolBf16Output);
    }
    expect_close("attention_backward dv" + path + tag, dv.g, dv.c, kTolBf16Output);
  }
  cuda::attention_set_hopper(had_hopper);
}

// v as its columns of the stacked q/k/v projection output [B*T, (Hq + 2 Hkv) hd] and dv
// into its columns of the stacked gradient (the model's layout; v_row_stride = the row):
// on every path (Hopper wgmma, mma.sync, and the fp32 kernels through F32 tensors) the
// same kernels with other row addresses, so the same bits as the dense call. The stacked
// input's other columns hold NaN (a read of them would show); the stacked gradient's
// other columns hold values that must survive unchanged. A row stride that is not a
// multiple of 8 elements sends BF16 to the fp32 kernels: checked against the CPU.
class StridedV {
 public:
  // v: the dense v's values [rows, width]; in and grad: [rows * stride] buffers (the
  // stacked input and gradient).
  StridedV(const std::vector<double>& v, int64_t rows, int64_t width, int64_t col,
           int64_t stride, Buffer& in, Buffer& grad)
      : rows_(rows), width_(width), col_(col), stride_(stride), in_(in), grad_(grad) {
    std::vector<double> host(size_t(rows * stride), std::nan(""));
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t c = 0; c < width; ++c) host[size_t(r * stride + col + c)] = v[size_t(r * width + c)];
    in_.set(host);
  }
  // A view of `b`'s v columns with v's 4-D shape.
  Tensor view(const Buffer& b, std::initializer_list<int64_t> dims) const {
    return Tensor(static_cast<char*>(b.t().data) + size_t(col_) * dtype_size(b.t().dtype),
                  b.t().dtype, dims);
  }
  Buffer& in() { return in_; }
  Buffer& grad() { return grad_; }
  // Fills the stacked gradient with values (rounded to its dtype) to be kept outside the
  // v columns, NaN inside.
  void prefill_grad(std::mt19937_64& rng) {
    std::normal_distribution<double> nd;
    before_.assign(size_t(rows_ * stride_), 0.0);
    for (double& x : before_) x = round_to(grad_.t().dtype, nd(rng));
    std::vector<double> h = before_;
    for (int64_t r = 0; r < rows_; ++r)
      for (int64_t c = 0; c < width_; ++c) h[size_t(r * stride_ + col_ + c)] = std::nan("");
    grad_.set(h);
  }
  // The gradient's v columns, dense; and whether every other element kept its value.
  std::vector<double> grad_columns(int64_t* changed_outside) const {
    const std::vector<double> h = grad_.get();
    std::vector<double> out(size_t(rows_ * width_));
    *changed_outside = 0;
    for (int64_t r = 0; r < rows_; ++r)
      for (int64_t c = 0; c < stride_; ++c) {
        const size_t i = size_t(r * stride_ + c);
        if (c >= col_ && c < col_ + width_) out[size_t(r * width_ + c - col_)] = h[i];
        else if (std::memcmp(&h[i], &before_[i], sizeof(double)) != 0) ++*changed_outside;
      }
    return out;
  }

 private:
  int64_t rows_, width_, col_, stride_;
  Buffer &in_, &grad_;
  std::vector<double> before_;
};

TEST_P(AttentionParity, StridedVSameBitsAsDense) {
  const AttnCase c = GetParam();
  const std::string tag = "B" + std::to_string(c.B) + " T" + std::to_string(c.T) + " Hq" +
                          std::to_string(c.Hq) + " Hkv" + std::to_string(c.Hkv) + " hd" +
                          std::to_string(c.hd);
  const int64_t rows = c.B * c.T, kvd = c.Hkv * c.hd, model_stride = (c.Hq + 2 * c.Hkv) * c.hd;
  const int64_t vcol = (c.Hq + c.Hkv) * c.hd;
  struct Path {
    DType dt;
    int hopper;             // 1 on, 0 off
    int64_t stride_extra;   // added to the model's row: not a multiple of 8 -> fp32 kernels
    bool same_bits;         // dense and strided take the same kernel
    const char* name;
  };
  const bool had_hopper = cuda::attention_set_hopper(true);
  std::vector<Path> paths;
  if (cuda::attention_uses_hopper()) paths.push_back({DType::BF16, 1, 0, true, " (wgmma)"});
  else std::printf("PARITY strided attention %s: no Hopper kernels on this device\n", tag.c_str());
  paths.push_back({DType::BF16, 0, 0, true, " (mma.sync)"});
  paths.push_back({DType::F32, 0, 0, true, " (fp32 kernels, F32)"});
  paths.push_back({DType::BF16, 0, 4, false, " (fp32 kernels, stride % 8 = 4)"});
  for (const Path& path : paths) {
    cuda::attention_set_hopper(path.hopper == 1);
    const std::string what = std::string(path.name) + " " + tag;
    const int64_t stride = model_stride + path.stride_extra;
    Pair q = random_pair(path.dt, {c.B, c.T, c.Hq, c.hd}, 2.0);
    Pair k = random_pair(path.dt, {c.B, c.T, c.Hkv, c.hd});
    Pair v = random_pair(path.dt, {c.B, c.T, c.Hkv, c.hd});
    Buffer v_stacked(*gpu, path.dt, {rows * stride}), dv_stacked(*gpu, path.dt, {rows * stride});
    StridedV sv(v.c.get(), rows, kvd, vcol, stride, v_stacked, dv_stacked);
    Tensor v_s = sv.view(sv.in(), {c.B, c.T, c.Hkv, c.hd});
    Pair out = pair(path.dt, {c.B, c.T, c.Hq, c.hd}), lse = pair(DType::F32, {c.B, c.Hq, c.T});
    Buffer out_s(*gpu, path.dt, {c.B, c.T, c.Hq, c.hd}), lse_s(*gpu, DType::F32, {c.B, c.Hq, c.T});
    out.g.poison();
    out_s.poison();
    gpu->attention_forward(out.g, lse.g, q.g, k.g, v.g, 0);
    gpu->attention_forward(out_s, lse_s, q.g, k.g, v_s, stride);
    if (path.same_bits) {
      expect_same_bits("strided attention_forward out" + what, out_s.get(), out.g.get());
      expect_same_bits("strided attention_forward lse" + what, lse_s.get(), lse.g.get());
    } else {
      cpu->attention_forward(out.c, lse.c, q.c, k.c, v.c, 0);
      expect_close("strided attention_forward out" + what, out_s, out.c, kTolBf16Output);
      expect_close("strided attention_forward lse" + what, lse_s, lse.c, kTolF32Output);
    }

    // Backward from the dense forward's out and lse on both calls.
    Pair dout = random_pair(path.dt, {c.B, c.T, c.Hq, c.hd});
    Pair dq = pair(path.dt, {c.B, c.T, c.Hq, c.hd}), dk = pair(path.dt, {c.B, c.T, c.Hkv, c.hd});
    Pair dv = pair(path.dt, {c.B, c.T, c.Hkv, c.hd});
    Buffer dq_s(*gpu, path.dt, {c.B, c.T, c.Hq, c.hd}), dk_s(*gpu, path.dt, {c.B, c.T, c.Hkv, c.hd});
    for (Buffer* b : {&dq.g, &dk.g, &dv.g, &dq_s, &dk_s}) b->poison();
    sv.prefill_grad(rng);
    gpu->attention_backward(dq.g, dk.g, dv.g, dout.g, q.g, k.g, v.g, out.g, lse.g, 0);
    gpu->attention_backward(dq_s, dk_s, sv.view(sv.grad(), {c.B, c.T, c.Hkv, c.hd}), dout.g,
                            q.g, k.g, v_s, out.g, lse.g, stride);
    int64_t changed = 0;
    const std::vector<double> dv_s = sv.grad_columns(&changed);
    EXPECT_EQ(changed, 0) << "strided attention_backward wrote " << changed
                          << " elements outside dv's columns" << what;
    if (path.same_bits) {
      expect_same_bits("strided attention_backward dq" + what, dq_s.get(), dq.g.get());
      expect_same_bits("strided attention_backward dk" + what, dk_s.get(), dk.g.get());
      expect_same_bits("strided attention_backward dv" + what, dv_s, dv.g.get());
    } else {
      // The reference from the GPU's saved out and lse (as ForwardAndBackward does).
      out.c.set(out.g.get());
      lse.c.set(lse.g.get());
      cpu->attention_backward(dq.c, dk.c, dv.c, dout.c, q.c, k.c, v.c, out.c, lse.c, 0);
      if (c.T > 1) {  // T = 1: dq = dk = 0 exactly (ForwardAndBackward checks that case)
        expect_close("strided attention_backward dq" + what, dq_s, dq.c, kTolBf16Output);
        expect_close("strided attention_backward dk" + what, dk_s, dk.c, kTolBf16Output);
      }
      expect_close("strided attention_backward dv" + what, dv_s, dv.c.get(), kTolBf16Output);
    }
  }
  cuda::attention_set_hopper(had_hopper);
}

// Incremental decoding: a chunk of Tq queries against Tk >= Tq cached keys (the chunk's own
// keys last), no lse.
TEST_F(CudaParity, AttentionCachedChunksAgainstLongerCache) {
  for (auto [Tq, Tk, Hq, Hkv, hd] : {std::tuple<int64_t, int64_t, int64_t, int64_t, int64_t>{
                                         1, 1, 2, 1, 64},
                                     {1, 77, 4, 2, 128},
                                     {5, 300, 4, 4, 64},
                                     {40, 40, 2, 1, 128}}) {
    const std::string tag = "Tq" + std::to_string(Tq) + " Tk" + std::to_string(Tk) + " Hq" +
                            std::to_string(Hq) + " Hkv" + std::to_string(Hkv) + " hd" +
                            std::to_string(hd);
    Pair q = random_pair(DType::BF16, {1, Tq, Hq, hd}, 2.0);
    Pair k = random_pair(DType::BF16, {1, Tk, Hkv, hd});
    Pair v = random_pair(DType::BF16, {1, Tk, Hkv, hd});
    Pair out = pair(DType::BF16, {1, Tq, Hq, hd});
    out.g.poison();
    cpu->attention_cached(out.c, q.c, k.c, v.c);
    gpu->attention_cached(out.g, q.g, k.g, v.g);
    expect_close("attention_cached out " + tag, out.g, out.c, kTolBf16Output);
  }
}

INSTANTIATE_TEST_SUITE_P(
    Shapes, AttentionParity,
    ::testing::Values(AttnCase{2, 37, 4, 4, 64},    // MHA, T below one tile
                      AttnCase{1, 130, 4, 2, 128},  // GQA 2, hd 128
                      AttnCase{2, 77, 6, 2, 64},    // GQA 3
                      AttnCase{1, 200, 8, 1, 128},  // MQA (GQA 8)
                      AttnCase{1, 1, 2, 1, 64},     // a single token
                      AttnCase{1, 512, 2, 1, 64},   // several key tiles per query tile
                      AttnCase{1, 1024, 2, 2, 128},  // long sequence, hd 128
                      AttnCase{2, 257, 8, 2, 128},   // a block's second warpgroup past T
                      AttnCase{1, 300, 4, 4, 64}),   // hd 64 over several 128-row blocks
    [](const ::testing::TestParamInfo<AttnCase>& i) {
      const AttnCase& c = i.param;
      return "B" + std::to_string(c.B) + "_T" + std::to_string(c.T) + "_Hq" +
             std::to_string(c.Hq) + "_Hkv" + std::to_string(c.Hkv) + "_hd" +
             std::to_string(c.hd);
    });

}  // namespace
}  // namespace mhar::test
