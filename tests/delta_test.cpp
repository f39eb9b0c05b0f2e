// delta_test.cpp: residual.mode delta on the CPU reference (DESIGN.md section 2,
// residual_delta.cpp):
// - the conversion identity: with every gate alpha_j = 0 a delta model is its standard
//   model bit for bit (loss, logits, every site input, the gradient of every shared
//   parameter), in fp32 and fp64, even with random routing queries, gains and null (so
//   the routed term it gates off is far from zero), over two steps (buffers reused);
//   and with one gate non-zero it is not (the routed term reaches the loss);
// - the initialiser: gates, null and queries 0, gains 1, in the bucket "delta";
// - the config: mode delta's fields validated with errors naming field and value;
// - each delta op against its equation, poisoned outputs and pre-filled gradients;
// - a backend without the delta ops is refused when the model is built;
// - the activation plan at the 350M and 1B shapes: standard's plus what delta keeps.
#include <gtest/gtest.h>

#include <limits>

#include "engine/error.h"
#include "engine/forwarding_backend.h"
#include "tests/model_test_util.h"

using namespace mhar;
using namespace mhar::test;

namespace {

bool is_delta(const std::string& name) { return name.rfind("model.delta.", 0) == 0; }

// Every delta parameter random except the gates, which stay 0.
void randomize_delta_keep_gates(Model& m, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<double> nd(0.0, 1.0);
  for (auto& p : m.parameters()) {
    if (!is_delta(p.name) || p.name.find(".alpha") != std::string::npos) continue;
    std::vector<double> v(size_t(p.value.numel()));
    for (double& x : v) x = (p.init == Init::One ? 1.0 : 0.0) + 0.5 * nd(rng);
    m.backend().upload(p.value, v.data());
  }
}

void expect_zero_gates_is_standard(DType dt, int block_layers) {
  Config s = tiny_config(ResidualMode::Standard);
  Config dc = tiny_config(ResidualMode::Delta, 2, true, 0, 4, block_layers);
  s.model.n_layers = dc.model.n_layers = 3;  // 6 sublayers: closed and partial blocks
  auto be = make_cpu_backend(dt);
  Model ms(s.model, s.residual, *be, 2, 5), md(dc.model, dc.residual, *be, 2, 5);
  ms.init_weights(21);
  md.init_weights(21);
  randomize_weights(ms, 4);
  copy_weights(ms, md);
  randomize_delta_keep_gates(md, 9);
  std::vector<int32_t> tok, tgt;
  random_tokens(10, s.model.vocab_size, 8, tok, tgt);
  for (int step = 0; step < 2; ++step) {
    // Logits first (a forward without a loss scale leaves them readable).
    EXPECT_EQ(ms.forward(tok.data(), tgt.data(), 0.0), md.forward(tok.data(), tgt.data(), 0.0));
    EXPECT_EQ(download(*be, ms.logits()), download(*be, md.logits())) << dtype_name(dt);
    for (int j = 0; j < s.model.n_sites(); ++j)
      EXPECT_EQ(download(*be, ms.site_input(j)), download(*be, md.site_input(j))) << "site " << j;
    ms.zero_grads();
    md.zero_grads();
    EXPECT_EQ(ms.forward(tok.data(), tgt.data(), 1.0), md.forward(tok.data(), tgt.data(), 1.0));
    ms.backward();
    md.backward();
    size_t shared = 0;
    for (auto& p : ms.parameters()) {
      EXPECT_EQ(download(*be, p.grad), download(*be, md.parameter(p.name).grad))
          << dtype_name(dt) << " " << p.name;
      ++shared;
    }
    // alpha, query, gain per site and the null.
    EXPECT_EQ(shared + 3 * size_t(s.model.n_sites()) + 1, md.parameters().size());
    // The gates do see the routed term: their gradients are not all zero.
    double ga = 0;
    for (int j = 1; j < s.model.n_sites(); ++j)
      ga += std::abs(download(*be, md.parameter("model.delta." + std::to_string(j) + ".alpha").grad)[0]);
    EXPECT_GT(ga, 0);
  }
  // One gate opened: the routed term reaches the loss.
  const double alpha = 0.5;
  be->upload(md.parameter("model.delta.3.alpha").value, &alpha);
  EXPECT_NE(ms.forward(tok.data(), tgt.data(), 0.0), md.forward(tok.data(), tgt.data(), 0.0));
}

TEST(DeltaIdentity, ZeroGatesAreStandardFp32) {
  expect_zero_gates_is_standard(DType::F32, 1);
  expect_zero_gates_is_standard(DType::F32, 2);
}
TEST(DeltaIdentity, ZeroGatesAreStandardFp64) {
  expect_zero_gates_is_standard(DType::F64, 1);
  expect_zero_gates_is_standard(DType::F64, 2);
}

TEST(DeltaInit, GatesNullAndQueriesZeroGainsOneInTheirOwnBucket) {
  const Config dc = tiny_config(ResidualMode::Delta, 0, true, 0, 4, 2);
  EXPECT_EQ(dc.residual.heads, dc.model.n_kv_heads);  // the default
  auto be = make_cpu_backend(DType::F32);
  Model m(dc.model, dc.residual, *be, 2, 5);
  m.init_weights(3);
  const int64_t d = dc.model.d_model;
  for (int j = 0; j < dc.model.n_sites(); ++j) {
    const std::string pre = "model.delta." + std::to_string(j);
    EXPECT_EQ(download(*be, m.parameter(pre + ".alpha").value), std::vector<double>(1, 0.0));
    EXPECT_EQ(download(*be, m.parameter(pre + ".query").value), std::vector<double>(size_t(d), 0.0));
    EXPECT_EQ(download(*be, m.parameter(pre + ".gain").value), std::vector<double>(size_t(d), 1.0));
  }
  EXPECT_EQ(download(*be, m.parameter("model.delta.null").value), std::vector<double>(size_t(d), 0.0));
  const GradBucket& b = m.buckets().back();
  EXPECT_EQ(b.name, "delta");
  for (int i = b.first_param; i < b.end_param; ++i) {
    EXPECT_TRUE(is_delta(m.parameters()[size_t(i)].name)) << m.parameters()[size_t(i)].name;
    EXPECT_FALSE(m.parameters()[size_t(i)].decay) << m.parameters()[size_t(i)].name;
  }
  EXPECT_EQ(b.end_param - b.first_param, 3 * dc.model.n_sites() + 1);
}

void expect_config_error(const std::function<void(nlohmann::json&)>& edit,
                         const std::vector<std::string>& needles) {
  nlohmann::json j = {{"model", {{"vocab_size", 23}, {"d_model", 16}, {"n_layers", 2},
                                 {"n_heads", 4}, {"n_kv_heads", 2}, {"head_dim", 4},
                                 {"d_ff", 24}, {"context_length", 8}}},
                      {"residual", {{"mode", "delta"}, {"block_layers", 1}}},
                      {"train", {{"micro_batch", 2}, {"seq_len", 5}, {"warmup_steps", 0}}}};
  edit(j);
  try {
    config_from_json(j, "t.json");
    ADD_FAILURE() << "accepted: " << j.dump();
  } catch (const Error& e) {
    const std::string what = e.what();
    for (const auto& n : needles) EXPECT_NE(what.find(n), std::string::npos) << what;
  }
}

TEST(DeltaConfig, FieldsAreValidatedWithTheirValues) {
  expect_config_error([](auto& j) { j["residual"]["block_layers"] = 0; },
                      {"t.json", "residual.block_layers", "0"});
  expect_config_error([](auto& j) { j["residual"]["block_layers"] = 3; },
                      {"residual.block_layers", "3", "model.n_layers = 2", "1..2"});
  expect_config_error([](auto& j) { j["residual"]["heads"] = 3; },
                      {"residual.heads", "3", "does not divide model.d_model = 16"});
  expect_config_error(
      [](auto& j) {
        j["residual"]["mode"] = "mhar";
        j["residual"]["block_layers"] = 2;
      },
      {"residual.block_layers", "2", "no meaning in mode \"mhar\""});
  expect_config_error([](auto& j) { j["residual"]["block_size"] = 2; },
                      {"residual.block_size", "no meaning in mode \"delta\""});
  expect_config_error([](auto& j) { j["residual"]["mode"] = "deltaa"; }, {"\"delta\""});
  // The default block (4 layers) on a 2-layer model names the field too.
  expect_config_error([](auto& j) { j["residual"].erase("block_layers"); },
                      {"residual.block_layers", "4", "model.n_layers = 2"});
  // And a valid one round-trips through its JSON form.
  nlohmann::json j = tiny_config(ResidualMode::Delta, 4, true, 0, 4, 2).to_json();
  const Config back = config_from_json(j, "rt");
  EXPECT_EQ(back.residual.mode, ResidualMode::Delta);
  EXPECT_EQ(back.residual.block_layers, 2);
  EXPECT_EQ(back.residual.heads, 4);
  EXPECT_EQ(residual_summary(back.residual), "delta H=4 block_layers 2");
}


TEST(DeltaOps, EachOpIsItsEquation) {
  auto be = make_cpu_backend(DType::F64);
  std::mt19937_64 rng(5);
  const int64_t N = 7, d = 6;
  std::vector<void*> owned;
  auto buf = [&](std::initializer_list<int64_t> shape) {
    int64_t n = 1;
    for (int64_t x : shape) n *= x;
    void* p = be->allocate(size_t(n) * sizeof(double));
    owned.push_back(p);
    return Tensor(p, DType::F64, shape);
  };
  Tensor x = buf({N, d}), base = buf({N, d}), r = buf({N, d}), dx = buf({N, d}), dr = buf({N, d});
  Tensor alpha = buf({1}), dalpha = buf({1}), row = buf({d}), drow = buf({d}), scratch = buf({4, d});
  const auto vb = fill(*be, base, rng), vr = fill(*be, r, rng), vdx = fill(*be, dx, rng);
  const auto va = fill(*be, alpha, rng), vda = fill(*be, dalpha, rng);
  const auto vrow = fill(*be, row, rng), vdrow = fill(*be, drow, rng);
  poison(*be, x);
  be->delta_gate(x, base, alpha, r);
  auto got = download(*be, x);
  for (size_t e = 0; e < got.size(); ++e) EXPECT_NEAR(got[e], vb[e] + va[0] * vr[e], 1e-15) << e;
  // In place (x aliases base).
  be->delta_gate(base, base, alpha, r);
  EXPECT_EQ(download(*be, base), got);

  poison(*be, dr);
  be->delta_gate_backward(dr, dalpha, dx, r, alpha, scratch);
  got = download(*be, dr);
  double dot = 0;
  for (size_t e = 0; e < got.size(); ++e) {
    EXPECT_NEAR(got[e], va[0] * vdx[e], 1e-15) << e;
    dot += vdx[e] * vr[e];
  }
  EXPECT_NEAR(download(*be, dalpha)[0], vda[0] + dot, 1e-13);

  poison(*be, x);
  be->delta_null_forward(x, row);
  got = download(*be, x);
  for (int64_t n = 0; n < N; ++n)
    for (int64_t c = 0; c < d; ++c) EXPECT_EQ(got[size_t(n * d + c)], vrow[size_t(c)]);
  be->delta_null_backward(drow, dx, scratch);
  got = download(*be, drow);
  for (int64_t c = 0; c < d; ++c) {
    double s = vdrow[size_t(c)];
    for (int64_t n = 0; n < N; ++n) s += vdx[size_t(n * d + c)];
    EXPECT_NEAR(got[size_t(c)], s, 1e-13) << c;
  }
  for (void* p : owned) be->release(p);
}

// The fused steps of the scheme's loop (backend.h): each is its equation (fp64, outputs
// poisoned, "+=" gradients pre-filled), with and without its optional tensor, and in fp32
// each gives the bits of the op sequence it stands for, called op by op (the CPU runs the
// defaults; a CPU override that rounded differently would fail here).
TEST(DeltaOps, FusedStepsAreTheirEquationsAndTheirSequences) {
  std::mt19937_64 rng(7);
  const int64_t N = 5, d = 8;
  for (DType dt : {DType::F64, DType::F32}) {
    SCOPED_TRACE(dtype_name(dt));
    auto be = make_cpu_backend(dt);
    std::vector<void*> owned;
    auto buf = [&](std::initializer_list<int64_t> shape) {
      int64_t n = 1;
      for (int64_t x : shape) n *= x;
      void* p = be->allocate(size_t(n) * dtype_size(dt));
      owned.push_back(p);
      return Tensor(p, dt, shape);
    };
    const double tol = dt == DType::F64 ? 1e-15 : 1e-6;
    for (bool opt : {true, false}) {
      SCOPED_TRACE(opt ? "with prev/next" : "without");
      // stream += slot; slot += prev.
      Tensor stream = buf({N, d}), slot = buf({N, d}), prev = buf({N, d});
      const auto vs = fill(*be, stream, rng), vv = fill(*be, slot, rng), vp = fill(*be, prev, rng);
      be->delta_stream_advance(stream, slot, opt ? prev : Tensor());
      const auto got_s = download(*be, stream), got_v = download(*be, slot);
      for (size_t e = 0; e < vs.size(); ++e) {
        EXPECT_NEAR(got_s[e], vs[e] + vv[e], tol) << e;
        EXPECT_NEAR(got_v[e], opt ? vv[e] + vp[e] : vv[e], tol) << e;
      }
      Tensor stream2 = buf({N, d}), slot2 = buf({N, d});
      be->upload(stream2, vs.data());
      be->upload(slot2, vv.data());
      be->add_inplace(stream2, slot2);
      if (opt) be->add_inplace(slot2, prev);
      EXPECT_EQ(download(*be, stream2), got_s);
      EXPECT_EQ(download(*be, slot2), got_v);

      // dresid += dx; dr = alpha dx; dalpha += sum dx r.
      Tensor dresid = buf({N, d}), dr = buf({N, d}), dx = buf({N, d}), r = buf({N, d});
      Tensor alpha = buf({1}), dalpha = buf({1}), scratch = buf({4, d});
      const auto vd = fill(*be, dresid, rng), vdx = fill(*be, dx, rng), vr = fill(*be, r, rng);
      const auto va = fill(*be, alpha, rng), vda = fill(*be, dalpha, rng);
      poison(*be, dr);
      be->delta_resid_gate_backward(dresid, dr, dalpha, dx, r, alpha, scratch);
      const auto got_d = download(*be, dresid), got_dr = download(*be, dr);
      const double got_da = download(*be, dalpha)[0];
      double dot = 0;
      for (size_t e = 0; e < vd.size(); ++e) {
        EXPECT_NEAR(got_d[e], vd[e] + vdx[e], tol) << e;
        EXPECT_NEAR(got_dr[e], va[0] * vdx[e], tol) << e;
        dot += vdx[e] * vr[e];
      }
      EXPECT_NEAR(got_da, vda[0] + dot, 100 * tol);
      be->upload(dresid, vd.data());
      be->upload(dalpha, vda.data());
      poison(*be, dr);
      be->add_inplace(dresid, dx);
      be->delta_gate_backward(dr, dalpha, dx, r, alpha, scratch);
      EXPECT_EQ(download(*be, dresid), got_d);
      EXPECT_EQ(download(*be, dr), got_dr);
      EXPECT_EQ(download(*be, dalpha)[0], got_da);

      // slot += next; out = dresid + slot.
      Tensor out = buf({N, d}), next = buf({N, d});
      be->upload(slot, vv.data());
      const auto vn = fill(*be, next, rng);
      poison(*be, out);
      be->delta_source_grad(out, dresid, slot, opt ? next : Tensor());
      const auto got_o = download(*be, out), got_sl = download(*be, slot);
      for (size_t e = 0; e < vv.size(); ++e) {
        const double sl = opt ? vv[e] + vn[e] : vv[e];
        EXPECT_NEAR(got_sl[e], sl, tol) << e;
        EXPECT_NEAR(got_o[e], got_d[e] + sl, 2 * tol) << e;
      }
      be->upload(slot, vv.data());
      poison(*be, out);
      if (opt) be->add_inplace(slot, next);
      be->add(out, dresid, slot);
      EXPECT_EQ(download(*be, out), got_o);
      EXPECT_EQ(download(*be, slot), got_sl);
    }
    for (void* p : owned) be->release(p);
  }
}

// At the shapes of configs/{350m,1b}_delta.json the activation plan is the standard one
// plus the block-routing statistics (pairs, inv_rms, ubar, key-gradient slabs, the
// reduction scratch), the routed terms r_j of every site (kept from site j to its
// backward, next to x_j: ubar_j needs r_j, sublayer j's backward x_j) and the running
// standard stream; the input gradients dr_j the source-stationary backward keeps must
// fit in memory the backward has freed, as the routed modes' do.
TEST(DeltaMemory, PlanIsStandardPlusRoutedTermsAndRoutingStatistics) {
  auto cpu = make_cpu_backend(DType::F32);
  PlanOnly be(*cpu);
  for (const char* size : {"350m", "1b"}) {
    const std::string dir = std::string(MHAR_SOURCE_DIR) + "/configs/";
    const Config sc = load_config(dir + size + "_standard.json");
    const Config c = load_config(dir + size + "_delta.json");
    const int B = sc.train.micro_batch, T = sc.train.seq_len;
    ASSERT_EQ(c.train.micro_batch, B);
    // One LM-head chunk on both sides, so that both plans peak at the head (see
    // allocator_test.cpp's RoutingAddsOnlyItsStatisticsToTheActivationPlan).
    const int64_t one_chunk = int64_t(B) * T;
    const double standard =
        double(Model(sc.model, sc.residual, be, B, T, 1, one_chunk).activation_plan().total_bytes());
    Model m(c.model, c.residual, be, B, T, 1, one_chunk);
    const int S = c.model.n_sites(), H = c.residual.heads;
    const double N = double(B) * T, d = c.model.d_model, row = 2 * N * d;
    const double stats = 4 * (double(RoutingLayout::blocks(S, c.residual.delta_block()).pairs()) * H * N +
                              S * N + S * H * N + 64.0 * S * d + 64.0 * d);
    const double routed = S * row, stream = row;
    const double got = double(m.activation_plan().total_bytes());
    std::printf("[ memory ] %s_delta: activations %.3f GB, standard %.3f GB (+%.1f%%), routing statistics "
                "%.3f GB, routed terms %.3f GB\n", size, got / 1e9, standard / 1e9,
                100 * (got / standard - 1), stats / 1e9, routed / 1e9);
    EXPECT_LE(got, standard + stats + routed + stream) << size;
    EXPECT_GT(got, standard + routed) << size << ": the routed terms must be planned, not aliased";
  }
}

class NoDeltaOps final : public ForwardingBackend {
 public:
  using ForwardingBackend::ForwardingBackend;
  std::string name() const override { return "test-gpu"; }
  bool has_delta_ops() const override { return false; }
};

TEST(DeltaRefusal, BackendWithoutTheOpsFailsWhenTheModelIsBuilt) {
  const Config dc = tiny_config(ResidualMode::Delta, 2, true, 0, 4, 1);
  auto cpu = make_cpu_backend(DType::F32);
  NoDeltaOps be(*cpu);
  try {
    Model m(dc.model, dc.residual, be, 2, 5);
    FAIL() << "a delta model was built on a backend without the delta ops";
  } catch (const std::exception& e) {
    const std::string what = e.what();
    EXPECT_NE(what.find("residual.mode delta"), std::string::npos) << what;
    EXPECT_NE(what.find("test-gpu"), std::string::npos) << what;
  }
}

}  // namespace
