// model_gradcheck_test.cpp: the analytic backward of the whole model, in float64 on the
// CPU backend, against central finite differences of the loss for EVERY element of
// EVERY parameter tensor (embeddings, norms, QK-norms, projections, routing queries and
// gains, hyper coefficients A_m, A_r, B), in each residual mode, with full and block
// routing (blocks of 2, of 3 (the last block incomplete) and of all 4 sublayers) and
// static Hyper-Connections with 1 to 4 streams (3: the one-hot starts wrap around),
// dynamic ones (per-token coefficients: w, s_a, s_b too) with 1 and 3, and the delta mode
// (gates, null source, block queries and gains at non-zero values) with blocks of 1 and 2
// layers. With h = 1e-5 in fp64 the difference quotient is
// accurate to ~1e-10 relative (truncation h^2 plus rounding eps/h), so the 1e-6 bound
// the issue sets leaves room only for that, never for a wrong term.
#include <gtest/gtest.h>

#include <cstdio>

#include "tests/model_test_util.h"

using namespace mhar;
using namespace mhar::test;

namespace {

struct GradCase {
  const char* label;
  ResidualMode mode;
  int heads;
  bool tied;
  int block_size = 0;
  int hyper_n = 4;
  bool hyper_dynamic = false;
  int block_layers = 1;  // mode delta
};

// The hyper cases' RMSNorm eps. A site that mixes equal streams (site 0 always: every
// stream is v_0; every site when n = 1) gives its sublayer x = (sum a_m) h, and the
// sublayer's RMSNorm is scale-invariant but for eps: with eps 1e-6 the gradient of that
// a_m is ~1e-7, below the difference quotient's own rounding noise (~1e-11 absolute),
// so no relative bound could check it. At 0.05 (the activations' mean square here is
// ~0.1) the eps path carries signal and every coefficient meets the same 1e-6.
constexpr double kHyperRmsEps = 0.05;

class ModelGradCheck : public ::testing::TestWithParam<GradCase> {};

TEST_P(ModelGradCheck, EveryParameterMatchesFiniteDifferences) {
  const GradCase& gc = GetParam();
  Config cfg = tiny_config(gc.mode, gc.heads, gc.tied, gc.block_size, gc.hyper_n,
                           gc.block_layers);
  if (gc.mode == ResidualMode::Hyper) cfg.model.rms_eps = kHyperRmsEps;
  cfg.residual.hyper_dynamic = gc.hyper_dynamic;
  auto be = make_cpu_backend(DType::F64);
  Model m(cfg.model, cfg.residual, *be, cfg.train.micro_batch, cfg.train.seq_len);
  randomize_weights(m, 7);
  std::vector<int32_t> tok, tgt;
  random_tokens(m.batch() * m.seq_len(), cfg.model.vocab_size, 11, tok, tgt);

  m.zero_grads();
  m.forward(tok.data(), tgt.data(), 1.0);
  m.backward();

  const double h = 1e-5;
  double worst = 0;
  std::string worst_name;
  for (auto& p : m.parameters()) {
    std::vector<double> analytic = download(*be, p.grad);
    std::vector<double> w = download(*be, p.value), numeric(w.size());
    for (size_t i = 0; i < w.size(); ++i) {
      const double w0 = w[i];
      w[i] = w0 + h;
      be->upload(p.value, w.data());
      const double lp = m.forward(tok.data(), tgt.data(), 0.0);
      w[i] = w0 - h;
      be->upload(p.value, w.data());
      const double lm = m.forward(tok.data(), tgt.data(), 0.0);
      w[i] = w0;
      numeric[i] = (lp - lm) / (2 * h);
    }
    be->upload(p.value, w.data());
    double norm = 0;
    for (double x : analytic) norm += x * x;
    // Site 0 routes a single source (v_0; the null in mode delta): its softmax weight is 1
    // whatever the query, so its query and gain truly have zero gradient. Every other
    // tensor must have signal, or the comparison would prove nothing.
    const bool dead_by_design = p.name.rfind("model.routing.0.", 0) == 0 ||
                                p.name == "model.delta.0.query" || p.name == "model.delta.0.gain";
    if (dead_by_design) EXPECT_EQ(norm, 0) << p.name;
    else EXPECT_GT(norm, 0) << p.name << " has an all-zero gradient: the check would be vacuous";
    const double err = rel_error(analytic, numeric);
    EXPECT_LE(err, 1e-6) << gc.label << " " << p.name;
    if (err > worst) worst = err, worst_name = p.name;
  }
  std::printf("[ gradcheck ] %s: worst relative error %.2e (%s)\n", gc.label, worst,
              worst_name.c_str());
}

INSTANTIATE_TEST_SUITE_P(
    AllModes, ModelGradCheck,
    ::testing::Values(GradCase{"standard", ResidualMode::Standard, 0, true},
                      GradCase{"standard_untied", ResidualMode::Standard, 0, false},
                      GradCase{"attnres", ResidualMode::AttnRes, 1, true},
                      GradCase{"mhar_h2", ResidualMode::Mhar, 2, true},
                      GradCase{"mhar_h4_untied", ResidualMode::Mhar, 4, false},
                      GradCase{"mhar_h16", ResidualMode::Mhar, 16, true},
                      GradCase{"attnres_block2", ResidualMode::AttnRes, 1, true, 2},
                      GradCase{"mhar_h2_block2", ResidualMode::Mhar, 2, true, 2},
                      GradCase{"mhar_h4_block3_untied", ResidualMode::Mhar, 4, false, 3},
                      GradCase{"mhar_h2_block4", ResidualMode::Mhar, 2, true, 4},
                      GradCase{"hyper_n1", ResidualMode::Hyper, 0, true, 0, 1},
                      GradCase{"hyper_n2", ResidualMode::Hyper, 0, true, 0, 2},
                      GradCase{"hyper_n3_untied", ResidualMode::Hyper, 0, false, 0, 3},
                      GradCase{"hyper_n4", ResidualMode::Hyper, 0, true, 0, 4},
                      GradCase{"hyper_dynamic_n1", ResidualMode::Hyper, 0, true, 0, 1, true},
                      GradCase{"hyper_dynamic_n3_untied", ResidualMode::Hyper, 0, false, 0, 3, true},
                      GradCase{"delta_h2_block1", ResidualMode::Delta, 2, true, 0, 4, false, 1},
                      GradCase{"delta_h4_block2_untied", ResidualMode::Delta, 4, false, 0, 4, false, 2},
                      GradCase{"delta_h1_block2", ResidualMode::Delta, 1, true, 0, 4, false, 2}),
    [](const ::testing::TestParamInfo<GradCase>& i) { return std::string(i.param.label); });

}  // namespace
