// probe_test.cpp: the routing probe (engine/probe.h): the divergence and entropy at
// known values, the probe's averages over batches against per-batch probes, the
// inequalities that tie its numbers together (entropy of the mean >= mean entropy;
// JS jointly convex, so JS of the means <= mean JS), single-head sites without a
// divergence, and the page with one heatmap per site.
#include <gtest/gtest.h>

#include <cmath>

#include "engine/probe.h"
#include "tests/model_test_util.h"

namespace mhar::test {
namespace {

TEST(RoutingProbe, DivergenceAndEntropyAtKnownValues) {
  const double a[2] = {1, 0}, b[2] = {0, 1}, u[4] = {0.25, 0.25, 0.25, 0.25};
  EXPECT_NEAR(js_divergence(a, b, 2), std::log(2.0), 1e-15);
  EXPECT_EQ(js_divergence(u, u, 4), 0.0);
  EXPECT_NEAR(entropy_nats(u, 4), std::log(4.0), 1e-15);
  EXPECT_EQ(entropy_nats(a, 2), 0.0);
  // p = (1/2, 1/2), q = (1, 0): m = (3/4, 1/4);
  // JS = 1/2 [1/2 ln(2/3) + 1/2 ln 2] + 1/2 [ln(4/3)].
  const double p[2] = {0.5, 0.5};
  EXPECT_NEAR(js_divergence(p, a, 2),
              0.5 * (0.5 * std::log(2.0 / 3.0) + 0.5 * std::log(2.0)) + 0.5 * std::log(4.0 / 3.0), 1e-15);
}

nlohmann::json probe_of(Model& m, const std::vector<std::vector<int32_t>>& batches) {
  RoutingProbe probe;
  for (const auto& tokens : batches) {
    m.forward(tokens.data(), tokens.data(), 0.0);
    probe.add(m);
  }
  return probe.to_json();
}

TEST(RoutingProbe, AveragesOverBatchesAndKeepsItsInequalities) {
  for (int block : {0, 2})  // full routing, and blocks of 2 sublayers
  for (ResidualMode mode : {ResidualMode::Mhar, ResidualMode::AttnRes}) {
    SCOPED_TRACE(std::string(residual_mode_name(mode)) + " block " + std::to_string(block));
    const Config cfg = tiny_config(mode, mode == ResidualMode::Mhar ? 4 : 0, true, block);
    auto be = make_cpu_backend(DType::F64);
    Model m(cfg.model, cfg.residual, *be, cfg.train.micro_batch, cfg.train.seq_len);
    randomize_weights(m, 5);
    std::vector<int32_t> t1, t2, y;
    random_tokens(int(m.batch() * m.seq_len()), cfg.model.vocab_size, 1, t1, y);
    random_tokens(int(m.batch() * m.seq_len()), cfg.model.vocab_size, 2, t2, y);
    const nlohmann::json both = probe_of(m, {t1, t2}), p1 = probe_of(m, {t1}), p2 = probe_of(m, {t2});
    const int H = cfg.residual.heads;
    ASSERT_EQ(both["sites"].size(), size_t(cfg.model.n_sites()));
    EXPECT_EQ(both["tokens"].get<int64_t>(), 2 * p1["tokens"].get<int64_t>());
    bool heads_disagree = false;
    for (size_t j = 0; j < both["sites"].size(); ++j) {
      const nlohmann::json &s = both["sites"][j], &s1 = p1["sites"][j], &s2 = p2["sites"][j];
      const int S = s["sources"].get<int>();
      ASSERT_EQ(S, block ? 1 + int(j) / block + (j % block ? 1 : 0) : int(j) + 1);
      for (int h = 0; h < H; ++h) {
        double sum = 0;
        for (int i = 0; i < S; ++i) {
          const double w = s["mean_weights"][h][i];
          EXPECT_NEAR(w, 0.5 * (s1["mean_weights"][h][i].get<double>() + s2["mean_weights"][h][i].get<double>()), 1e-14);
          sum += w;
        }
        EXPECT_NEAR(sum, 1.0, 1e-12);  // softmax weights: every token's row sums to 1
        EXPECT_NEAR(s["token_entropy"][h].get<double>(),
                    0.5 * (s1["token_entropy"][h].get<double>() + s2["token_entropy"][h].get<double>()), 1e-13);
        EXPECT_LE(s["entropy"][h].get<double>(), std::log(double(S)) + 1e-12);
        EXPECT_GE(s["entropy"][h].get<double>(), s["token_entropy"][h].get<double>() - 1e-12);  // concavity
      }
      if (H == 1) {
        EXPECT_TRUE(s["js"].is_null());
        EXPECT_TRUE(s["token_js"].is_null());
      } else {
        EXPECT_LE(s["js"].get<double>(), s["token_js"].get<double>() + 1e-12);  // joint convexity
        EXPECT_LE(s["token_js"].get<double>(), std::log(2.0));
        EXPECT_NEAR(s["token_js"].get<double>(), 0.5 * (s1["token_js"].get<double>() + s2["token_js"].get<double>()), 1e-13);
        if (j > 0) heads_disagree |= s["js"].get<double>() > 1e-4;
      }
      if (j == 0) {
        EXPECT_EQ(s["mean_weights"].at(0).at(0).get<double>(), 1.0);  // site 0 reads v_0 only
      }
    }
    if (H > 1) {
      EXPECT_TRUE(heads_disagree) << "random routing queries should make the heads differ";
    }

    const std::string html = render_probe_html(both, "tiny <run>");
    size_t svgs = 0;
    for (size_t pos = 0; (pos = html.find("<svg", pos)) != std::string::npos; ++pos) ++svgs;
    EXPECT_EQ(svgs, size_t(cfg.model.n_sites()));
    EXPECT_NE(html.find("tiny &lt;run&gt;"), std::string::npos);
    EXPECT_EQ(html.find("http"), std::string::npos);  // self-contained
  }
}

// The sums reduced in the backend equal sums computed here from the downloaded weights
// (Model::routing_weights), for the CPU backend's override and for the default
// (host) implementation that other backends inherit.
TEST(RoutingProbe, BackendSumsEqualSumsOfTheDownloadedWeights) {
  for (int block : {0, 3})  // full routing, and blocks of 3 (fewer sources than site + 1)
  for (DType dt : {DType::F64, DType::F32}) {
    const Config cfg = tiny_config(ResidualMode::Mhar, 4, true, block);
    auto be = make_cpu_backend(dt);
    Model m(cfg.model, cfg.residual, *be, cfg.train.micro_batch, cfg.train.seq_len);
    randomize_weights(m, 9);
    std::vector<int32_t> t, y;
    random_tokens(int(m.batch() * m.seq_len()), cfg.model.vocab_size, 3, t, y);
    m.forward(t.data(), y.data(), 0.0);
    const int H = cfg.residual.heads;
    for (int site = 0; site < cfg.model.n_sites(); ++site) {
      const int src = m.routing_sources(site);
      const int64_t n_stats = int64_t(H) * (src + 1) + 1;
      // Expected, from the downloaded [N, H, src] weights.
      const std::vector<double> w = m.routing_weights(site);
      const int64_t N = int64_t(w.size()) / (H * src);
      std::vector<double> want(size_t(n_stats), 0.0);
      for (int64_t n = 0; n < N; ++n) {
        const double* a = w.data() + size_t(n) * H * src;
        double js = 0;
        for (int h = 0; h < H; ++h) {
          for (int i = 0; i < src; ++i) {
            const double x = a[h * src + i];
            want[size_t(h * src + i)] += x;
            if (x > 0) want[size_t(H * src + h)] -= x * std::log(x);
          }
          for (int g = h + 1; g < H; ++g)
            for (int i = 0; i < src; ++i) {
              const double p = a[h * src + i], q = a[g * src + i], mid = (p + q) / 2;
              if (p > 0) js += p * std::log(p / mid) / 2;
              if (q > 0) js += q * std::log(q / mid) / 2;
            }
        }
        want[size_t(H * (src + 1))] += js / (H * (H - 1) / 2.0);
      }
      // The site's weights in a [P, H, N] tensor of the backend's dtype (other pairs 0).
      const RoutingLayout lay =
          RoutingLayout::blocks(cfg.model.n_sources(), cfg.residual.routing_block());
      const int64_t P = lay.pairs();
      std::vector<double> all(size_t(P * H * N), 0.0);
      for (int i = 0; i < src; ++i)
        for (int h = 0; h < H; ++h)
          for (int64_t n = 0; n < N; ++n)
            all[size_t((lay.pair(lay.site_source(site, i), site) * H + h) * N + n)] =
                w[size_t((n * H + h) * src + i)];
      Tensor weights(be->allocate(all.size() * dtype_size(dt)), dt, {P, H, N});
      be->upload(weights, all.data());
      std::vector<double> start(static_cast<size_t>(n_stats));
      for (size_t k = 0; k < start.size(); ++k) start[k] = 0.25 * double(k);  // "+=": from nonzero sums
      for (int path = 0; path < 3; ++path) {
        Tensor stats(be->allocate(size_t(n_stats) * 8), DType::F64, {n_stats});
        be->upload(stats, start.data());
        if (path == 0) m.routing_stats(site, stats);                      // the model's own weights
        if (path == 1) be->routing_stats(stats, weights, lay, site, H);          // the CPU override
        if (path == 2) be->Backend::routing_stats(stats, weights, lay, site, H); // the default (host)
        std::vector<double> got(static_cast<size_t>(n_stats));
        be->download(got.data(), stats);
        for (int64_t k = 0; k < n_stats; ++k)
          EXPECT_NEAR(got[size_t(k)] - start[size_t(k)], want[size_t(k)], 1e-12 * std::max(1.0, std::fabs(want[size_t(k)])))
              << dtype_name(dt) << " site " << site << " stat " << k << " path " << path;
        be->release(stats.data);
      }
      be->release(weights.data);
    }
  }
}

// Standard and hyper models are unrouted: the probe refuses them, naming the mode.
TEST(RoutingProbe, UnroutedModelsHaveNothingToProbe) {
  for (ResidualMode mode : {ResidualMode::Standard, ResidualMode::Hyper}) {
    const Config cfg = tiny_config(mode);
    auto be = make_cpu_backend(DType::F64);
    Model m(cfg.model, cfg.residual, *be, cfg.train.micro_batch, cfg.train.seq_len);
    RoutingProbe probe;
    try {
      probe.add(m);
      ADD_FAILURE() << residual_mode_name(mode) << " model was probed";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find(std::string("residual mode is ") + residual_mode_name(mode)),
                std::string::npos) << e.what();
    }
  }
}

}  // namespace
}  // namespace mhar::test
