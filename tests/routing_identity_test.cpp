// routing_identity_test.cpp: identities the routing must satisfy exactly (fp64 CPU):
// - mhar with H = 1 is attnres (same weights give the same loss and gradients);
// - zero queries make every site the uniform mean of its sources;
// - mhar whose heads all see the same query slice, gain slice and source slices has
//   identical per-head logits, and then equals attnres with query q/H;
// - a site never reads a future source (forward or backward), checked by poisoning.
#include <gtest/gtest.h>

#include <cmath>
#include <limits>

#include "tests/model_test_util.h"

using namespace mhar;
using namespace mhar::test;

namespace {

TEST(RoutingIdentity, MharWithOneHeadIsAttnRes) {
  Config a = tiny_config(ResidualMode::AttnRes), m = tiny_config(ResidualMode::Mhar, 1);
  auto be = make_cpu_backend(DType::F64);
  Model ma(a.model, a.residual, *be, 2, 5), mm(m.model, m.residual, *be, 2, 5);
  randomize_weights(ma, 3);
  copy_weights(ma, mm);
  std::vector<int32_t> tok, tgt;
  random_tokens(10, a.model.vocab_size, 5, tok, tgt);
  ma.zero_grads();
  mm.zero_grads();
  const double la = ma.forward(tok.data(), tgt.data(), 1.0);
  const double lm = mm.forward(tok.data(), tgt.data(), 1.0);
  EXPECT_EQ(la, lm);
  ma.backward();
  mm.backward();
  for (auto& p : ma.parameters())
    EXPECT_EQ(download(*be, p.grad), download(*be, mm.parameter(p.name).grad)) << p.name;
}

TEST(RoutingIdentity, ZeroQueriesGiveTheUniformMeanOfSources) {
  for (int heads : {1, 2, 4}) {
    Config c = tiny_config(heads == 1 ? ResidualMode::AttnRes : ResidualMode::Mhar, heads);
    auto be = make_cpu_backend(DType::F64);
    Model m(c.model, c.residual, *be, 2, 5);
    randomize_weights(m, 9);
    for (auto& p : m.parameters())
      if (p.name.find(".query") != std::string::npos) be->zero(p.value);
    std::vector<int32_t> tok, tgt;
    random_tokens(10, c.model.vocab_size, 1, tok, tgt);
    m.forward(tok.data(), tgt.data(), 0.0);
    auto hist = download(*be, m.history());
    const size_t slot = hist.size() / size_t(c.model.n_sources());
    for (int j = 0; j < c.model.n_sites(); ++j) {
      auto x = download(*be, m.site_input(j));
      auto w = download(*be, m.routing_weights(j));
      for (double a : w) EXPECT_NEAR(a, 1.0 / (j + 1), 1e-15);
      for (size_t e = 0; e < slot; ++e) {
        double mean = 0;
        for (int i = 0; i <= j; ++i) mean += hist[size_t(i) * slot + e];
        EXPECT_NEAR(x[e], mean / (j + 1), 1e-12) << "site " << j << " heads " << heads;
      }
    }
  }
}

// Op-level fixture: history [S, N, d] and per-site parameters on the fp64 backend.
struct RoutingOp {
  std::unique_ptr<Backend> be = make_cpu_backend(DType::F64);
  int S, N, d;
  std::vector<double> hist, inv_rms, query, gain;
  RoutingOp(int S_, int N_, int d_) : S(S_), N(N_), d(d_) {}
  Tensor t(std::vector<double>& v, std::initializer_list<int64_t> shape) {
    return Tensor(v.data(), DType::F64, shape);
  }
  void stats() {
    inv_rms.assign(size_t(S) * N, 0);
    for (int i = 0; i < S; ++i)
      be->routing_source_stats(t(inv_rms, {S, N})[i], t(hist, {S, N, d})[i], 1e-6);
  }
  std::vector<double> forward(int n_src, int heads, std::vector<double>* weights = nullptr) {
    std::vector<double> x(size_t(N) * d, 0), w(size_t(N) * heads * n_src, 0);
    be->routing_forward(t(x, {N, d}), t(w, {N, heads, n_src}), t(hist, {S, N, d}),
                        t(inv_rms, {S, N}), t(query, {d}), t(gain, {d}), n_src, heads);
    if (weights) *weights = w;
    return x;
  }
};

TEST(RoutingIdentity, SameSliceInEveryHeadEqualsAttnResWithQueryOverH) {
  const int S = 5, N = 7, d = 12, H = 3, hs = d / H;
  RoutingOp op(S, N, d);
  std::mt19937_64 rng(2);
  std::normal_distribution<double> nd;
  // Sources, query and gain repeat the same hs-wide slice in every head.
  op.hist.resize(size_t(S) * N * d);
  for (int i = 0; i < S; ++i)
    for (int n = 0; n < N; ++n) {
      std::vector<double> slice(hs);
      for (double& x : slice) x = nd(rng);
      for (int c = 0; c < d; ++c) op.hist[(size_t(i) * N + n) * d + c] = slice[c % hs];
    }
  std::vector<double> qs(hs), gs(hs);
  for (int c = 0; c < hs; ++c) qs[c] = nd(rng), gs[c] = 1 + 0.3 * nd(rng);
  op.query.resize(d);
  op.gain.resize(d);
  for (int c = 0; c < d; ++c) op.query[c] = qs[c % hs], op.gain[c] = gs[c % hs];
  op.stats();
  std::vector<double> w_mhar, w_attn;
  auto x_mhar = op.forward(S, H, &w_mhar);
  for (double& q : op.query) q /= H;  // attnres sums the logit over all H slices
  auto x_attn = op.forward(S, 1, &w_attn);
  for (size_t e = 0; e < x_mhar.size(); ++e) EXPECT_NEAR(x_mhar[e], x_attn[e], 1e-13);
  for (int n = 0; n < N; ++n)
    for (int h = 0; h < H; ++h)
      for (int i = 0; i < S; ++i)
        EXPECT_NEAR(w_mhar[(size_t(n) * H + h) * S + i], w_attn[size_t(n) * S + i], 1e-14);
  // And the weights are far from uniform, so the identity is not the trivial one.
  double spread = 0;
  for (int i = 0; i < S; ++i) spread = std::max(spread, std::fabs(w_attn[i] - 1.0 / S));
  EXPECT_GT(spread, 0.05);
}

TEST(RoutingIdentity, SiteNeverReadsAFutureSource) {
  const int S = 7, N = 6, d = 8;
  for (int heads : {1, 2, 4})
    for (int n_src = 1; n_src < S; ++n_src) {
      RoutingOp op(S, N, d);
      std::mt19937_64 rng(n_src * 10 + heads);
      std::normal_distribution<double> nd;
      op.hist.resize(size_t(S) * N * d);
      for (double& x : op.hist) x = nd(rng);
      op.query.resize(d), op.gain.resize(d);
      for (int c = 0; c < d; ++c) op.query[c] = nd(rng), op.gain[c] = 1 + 0.2 * nd(rng);
      op.stats();
      std::vector<double> w_clean;
      auto clean = op.forward(n_src, heads, &w_clean);
      // Poison every future slot and its statistics with NaN.
      const double nan = std::numeric_limits<double>::quiet_NaN();
      for (size_t e = size_t(n_src) * N * d; e < op.hist.size(); ++e) op.hist[e] = nan;
      for (size_t e = size_t(n_src) * N; e < op.inv_rms.size(); ++e) op.inv_rms[e] = nan;
      std::vector<double> w;
      auto poisoned = op.forward(n_src, heads, &w);
      EXPECT_EQ(clean, poisoned) << "n_src " << n_src;
      // Backward: gradients land only in slots < n_src; future slots keep their values.
      std::vector<double> dx(size_t(N) * d), dh(op.hist.size(), 0.0), dq(d, 0), dg(d, 0);
      for (double& x : dx) x = nd(rng);
      for (size_t e = size_t(n_src) * N * d; e < dh.size(); ++e) dh[e] = 42.0;
      op.be->routing_backward(op.t(dh, {S, N, d}), op.t(dq, {d}), op.t(dg, {d}),
                              op.t(dx, {N, d}), op.t(op.hist, {S, N, d}),
                              op.t(op.inv_rms, {S, N}), op.t(w, {N, heads, n_src}),
                              op.t(op.query, {d}), op.t(op.gain, {d}), n_src, heads);
      for (size_t e = 0; e < dh.size(); ++e) {
        if (e >= size_t(n_src) * N * d) EXPECT_EQ(dh[e], 42.0);
        else EXPECT_TRUE(std::isfinite(dh[e]));
      }
      for (int c = 0; c < d; ++c) EXPECT_TRUE(std::isfinite(dq[c]) && std::isfinite(dg[c]));
    }
}

}  // namespace
