// routing_cudatest.cpp: CUDA depth routing (source statistics, forward, backward) against
// the CPU reference for H = 1, 2, 4, 8 (and 16), n_src = 1..9, head sizes that are and
// are not multiples of 32 (the two per-head reduction paths), and d above 256 (several
// features per thread).
#include <gtest/gtest.h>

#include "tests/cuda_test_util.h"

namespace mhar::test {
namespace {

class RoutingParity : public CudaParity {
 protected:
  // S = n_src + 2 slots, so the slots a site must not read exist and hold data.
  void check(int64_t N, int64_t d, int n_src, int H) {
    const std::string tag = "N" + std::to_string(N) + " d" + std::to_string(d) + " n_src" +
                            std::to_string(n_src) + " H" + std::to_string(H);
    const int64_t S = n_src + 2;
    const double eps = 1e-6;
    // Sources of different scales (like real sublayer outputs), so the RMS matters.
    Pair history = pair(DType::BF16, {S, N, d});
    {
      std::vector<double> h;
      for (int64_t i = 0; i < S; ++i) {
        auto v = random_normal(rng, N * d, DType::BF16, 0.5 + 0.4 * double(i));
        h.insert(h.end(), v.begin(), v.end());
      }
      history.set(h);
    }
    Pair inv_rms = pair(DType::F32, {S, N});
    inv_rms.g.poison();
    for (int64_t i = 0; i < S; ++i) {
      cpu->routing_source_stats(inv_rms.c.t()[i], history.c.t()[i], eps);
      gpu->routing_source_stats(inv_rms.g.t()[i], history.g.t()[i], eps);
    }
    expect_close("routing_source_stats inv_rms " + tag, inv_rms.g, inv_rms.c, kTolF32Output);
    inv_rms.g.set(inv_rms.c.get());  // identical statistics for what follows

    // Logits s = r * sum_{c in h} q g v have std about |q| |g| sqrt(d/H): scale q so that
    // the softmax is neither uniform nor one-hot.
    const double q_std = 1.5 / std::sqrt(double(d / H));
    Pair query = random_pair(DType::BF16, {d}, q_std);
    Pair gain = random_pair(DType::BF16, {d}, 0.3, 1.0);
    Pair x = pair(DType::BF16, {N, d});
    Pair weights = pair(DType::F32, {N, H, n_src});
    x.g.poison();
    weights.g.poison();
    cpu->routing_forward(x.c, weights.c, history.c, inv_rms.c, query.c, gain.c, n_src, H);
    gpu->routing_forward(x.g, weights.g, history.g, inv_rms.g, query.g, gain.g, n_src, H);
    expect_close("routing_forward x " + tag, x.g, x.c, kTolBf16Output);
    expect_close("routing_forward weights " + tag, weights.g, weights.c, kTolF32Output);

    weights.g.set(weights.c.get());
    Pair dx = random_pair(DType::BF16, {N, d});
    // += output: starts non-zero but small, so the op's own contribution dominates the
    // result and its bf16 rounding (2^-9 of the result) stays within kTolBf16Output of
    // the contribution, which is what is compared.
    Pair dhistory = random_pair(DType::BF16, {S, N, d}, 0.05);
    Pair dquery = random_pair(DType::F32, {d}, 0.1);
    Pair dgain = random_pair(DType::F32, {d}, 0.1);
    const std::vector<double> dhistory_before = dhistory.g.get();
    cpu->routing_backward(dhistory.c, dquery.c, dgain.c, dx.c, history.c, inv_rms.c,
                          weights.c, query.c, gain.c, n_src, H);
    gpu->routing_backward(dhistory.g, dquery.g, dgain.g, dx.g, history.g, inv_rms.g,
                          weights.g, query.g, gain.g, n_src, H);
    const std::vector<double> got = dhistory.g.get(), ref = dhistory.c.get();
    const size_t read = size_t(n_src) * size_t(N * d);
    std::vector<double> got_delta(read), ref_delta(read);
    for (size_t e = 0; e < read; ++e) {
      got_delta[e] = got[e] - dhistory_before[e];
      ref_delta[e] = ref[e] - dhistory_before[e];
    }
    expect_close("routing_backward dhistory " + tag, got_delta, ref_delta, kTolBf16Output);
    // Slots >= n_src are untouched (exactly).
    std::vector<double> got_tail(got.begin() + long(read), got.end());
    std::vector<double> before_tail(dhistory_before.begin() + long(read), dhistory_before.end());
    EXPECT_EQ(got_tail, before_tail) << "routing_backward wrote slots >= n_src " << tag;
    expect_close("routing_backward dquery " + tag, dquery.g, dquery.c, kTolF32Output);
    expect_close("routing_backward dgain " + tag, dgain.g, dgain.c, kTolF32Output);
  }
};

TEST_F(RoutingParity, HeadsAndSourceCountsSmallWidth) {
  // d = 96: heads of 96, 48, 24, 12 features (none a multiple of 32: per-feature atomics).
  for (int n_src = 1; n_src <= 9; ++n_src)
    for (int H : {1, 2, 4, 8}) check(37, 96, n_src, H);
}

TEST_F(RoutingParity, HeadsAndSourceCountsWarpAlignedHeads) {
  // d = 256: heads of 256, 128, 64, 32 features (warp-reduction path).
  for (int n_src : {1, 2, 3, 5, 9})
    for (int H : {1, 2, 4, 8}) check(29, 256, n_src, H);
}

TEST_F(RoutingParity, WideModelSeveralFeaturesPerThread) {
  // d = 640: 3 features per thread; H = 8 gives heads of 80 (not warp aligned).
  for (int n_src : {1, 4, 9})
    for (int H : {1, 2, 4, 8}) check(21, 640, n_src, H);
  check(16, 2048, 9, 16);  // 1B-like width, 16 heads of 128
}

}  // namespace
}  // namespace mhar::test
