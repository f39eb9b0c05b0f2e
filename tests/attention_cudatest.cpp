// attention_cudatest.cpp: CUDA causal GQA attention forward/backward against the CPU
// reference, head_dim 64 and 128, GQA ratios 1, 2, 3 and 8, T not a multiple of the tiles;
// forward and backward through each BF16 kernel the device has (Hopper wgmma, both of its
// forward and its three backward versions, and mma.sync).
#include <gtest/gtest.h>

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
  cpu->attention_forward(out.c, lse.c, q.c, k.c, v.c);
  // Every BF16 forward kernel the device has: the Hopper wgmma kernels in both versions
  // (cuda::attention_set_hopper_forward: warp-specialized, or every warp loading) and the
  // mma.sync one (cuda::attention_set_hopper); each against the reference, same bounds.
  const bool had_hopper = cuda::attention_set_hopper(true);
  std::vector<bool> paths{false};  // use_hopper
  if (cuda::attention_uses_hopper()) paths.insert(paths.begin(), true);
  else std::printf("PARITY attention %s: no Hopper kernels on this device\n", tag.c_str());
  auto path_name = [](bool use_hopper) { return use_hopper ? " (wgmma) " : " (mma.sync) "; };
  const int had_forward = cuda::attention_set_hopper_forward(2);
  for (const bool use_hopper : paths)
    for (const int version : {2, 1}) {
      if (!use_hopper && version == 1) continue;
      cuda::attention_set_hopper(use_hopper);
      cuda::attention_set_hopper_forward(version);
      const std::string path =
          use_hopper ? " (wgmma v" + std::to_string(version) + ") " : path_name(false);
      out.g.poison();
      lse.g.poison();
      gpu->attention_forward(out.g, lse.g, q.g, k.g, v.g);
      expect_close("attention_forward out" + path + tag, out.g, out.c, kTolBf16Output);
      expect_close("attention_forward lse" + path + tag, lse.g, lse.c, kTolF32Output);
    }
  cuda::attention_set_hopper_forward(had_forward);
  cuda::attention_set_hopper(had_hopper);

  // Backward from the same saved tensors on both sides: the reference's out, rounded to
  // what the GPU stores, and its lse.
  out.set(rounded(DType::BF16, out.c.get()));
  lse.g.set(lse.c.get());
  Pair dout = random_pair(DType::BF16, {c.B, c.T, c.Hq, c.hd});
  Pair dq = pair(DType::BF16, {c.B, c.T, c.Hq, c.hd});
  Pair dk = pair(DType::BF16, {c.B, c.T, c.Hkv, c.hd});
  Pair dv = pair(DType::BF16, {c.B, c.T, c.Hkv, c.hd});
  cpu->attention_backward(dq.c, dk.c, dv.c, dout.c, q.c, k.c, v.c, out.c, lse.c);
  // The Hopper backward in its three versions (cuda::attention_set_hopper_backward: dq
  // reading the score-gradient tiles of the warp-specialized dk/dv kernel or of the other
  // one, or recomputing them), then mma.sync; same bounds.
  struct BackwardPath {
    bool use_hopper;
    int version;
  };
  std::vector<BackwardPath> backward_paths;
  for (const bool use_hopper : paths)
    for (const int version : {3, 2, 1})
      if (use_hopper || version == 2) backward_paths.push_back({use_hopper, version});
  const int had_version = cuda::attention_set_hopper_backward(2);
  for (const auto [use_hopper, version] : backward_paths) {
    cuda::attention_set_hopper(use_hopper);
    cuda::attention_set_hopper_backward(version);
    const std::string path =
        use_hopper ? " (wgmma v" + std::to_string(version) + ") " : path_name(false);
    dq.g.poison();
    dk.g.poison();
    dv.g.poison();
    gpu->attention_backward(dq.g, dk.g, dv.g, dout.g, q.g, k.g, v.g, out.g, lse.g);
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
  cuda::attention_set_hopper_backward(had_version);
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
