// hyper_test.cpp: identities static Hyper-Connections (residual.mode hyper) must satisfy
// exactly on the CPU reference, and its refusals:
// - n = 1 with its initial coefficients (A_m = 1, A_r = 1, B = 1) is `standard`: the same
//   loss and the same gradient of every shared parameter, bit for bit in fp64 and fp32
//   (each stream op rounds v + h once, as the standard residual's add does);
// - the initialiser writes A_m = one-hot(k mod n), A_r = I_n, B = 1, and then every
//   sublayer's input is the standard residual bit for bit (n = 4, one-hot wrapping);
// - the head reads sum_i h_i (checked against the streams summed on the host);
// - dynamic at its init (w = 0) is static (loss and the other gradients bit for bit);
// - a backend without the stream ops is refused when the model is built, naming the mode
//   and the way out;
// - each stream op against its equation written as plain loops, with poisoned outputs
//   (what an op overwrites must not read them) and pre-filled gradients (what it adds
//   to must keep them): the contract a CUDA implementation will be held to.
#include <gtest/gtest.h>

#include <limits>

#include "engine/forwarding_backend.h"
#include "tests/model_pair_util.h"
#include "tests/model_test_util.h"

using namespace mhar;
using namespace mhar::test;

namespace {

void expect_n1_static_is_standard(DType dt) {
  const Config s = tiny_config(ResidualMode::Standard), h = tiny_config(ResidualMode::Hyper, 0, true, 0, 1);
  auto be = make_cpu_backend(dt);
  Model ms(s.model, s.residual, *be, 2, 5), mh(h.model, h.residual, *be, 2, 5);
  ms.init_weights(21);
  mh.init_weights(21);  // same seed and names: the shared parameters start equal
  randomize_weights(ms, 4);  // larger weights than the init, so every path carries signal
  copy_weights(ms, mh);
  std::vector<int32_t> tok, tgt;
  random_tokens(10, s.model.vocab_size, 8, tok, tgt);
  for (int step = 0; step < 2; ++step) {  // twice: the stream buffers are reused
    ms.zero_grads();
    mh.zero_grads();
    const double ls = ms.forward(tok.data(), tgt.data(), 1.0);
    const double lh = mh.forward(tok.data(), tgt.data(), 1.0);
    EXPECT_EQ(ls, lh) << dtype_name(dt);
    ms.backward();
    mh.backward();
    size_t shared = 0;
    for (auto& p : ms.parameters()) {
      EXPECT_EQ(download(*be, p.grad), download(*be, mh.parameter(p.name).grad))
          << dtype_name(dt) << " " << p.name;
      ++shared;
    }
    EXPECT_EQ(shared + 3 * 2 * size_t(s.model.n_layers), mh.parameters().size());
  }
}

TEST(HyperIdentity, OneStreamAtItsInitIsStandardFp64) { expect_n1_static_is_standard(DType::F64); }
TEST(HyperIdentity, OneStreamAtItsInitIsStandardFp32) { expect_n1_static_is_standard(DType::F32); }

TEST(HyperIdentity, InitIsThePreNormResidualStream) {
  const int n = 4;
  Config s = tiny_config(ResidualMode::Standard), h = tiny_config(ResidualMode::Hyper, 0, true, 0, n);
  s.model.n_layers = h.model.n_layers = 3;  // 6 sublayers: the one-hot index wraps (k mod 4)
  auto be = make_cpu_backend(DType::F64);
  Model ms(s.model, s.residual, *be, 2, 5), mh(h.model, h.residual, *be, 2, 5);
  ms.init_weights(5);
  mh.init_weights(5);
  const int L2 = 2 * h.model.n_layers;
  for (int k = 0; k < L2; ++k) {
    const std::string pre = "model.hyper." + std::to_string(k);
    std::vector<double> am(n, 0.0), ar(n * n, 0.0), b(n, 1.0);
    am[size_t(k % n)] = 1;
    for (int i = 0; i < n; ++i) ar[size_t(i * n + i)] = 1;
    EXPECT_EQ(download(*be, mh.parameter(pre + ".a_m").value), am) << pre;
    EXPECT_EQ(download(*be, mh.parameter(pre + ".a_r").value), ar) << pre;
    EXPECT_EQ(download(*be, mh.parameter(pre + ".b").value), b) << pre;
  }
  randomize_weights(ms, 6);
  for (auto& p : ms.parameters()) {  // larger matrices; hyper coefficients stay at init
    auto v = download(*be, p.value);
    be->upload(mh.parameter(p.name).value, v.data());
  }
  std::vector<int32_t> tok, tgt;
  random_tokens(10, s.model.vocab_size, 2, tok, tgt);
  ms.forward(tok.data(), tgt.data(), 0.0);
  mh.forward(tok.data(), tgt.data(), 0.0);
  for (int j = 0; j < L2; ++j)
    EXPECT_EQ(download(*be, ms.site_input(j)), download(*be, mh.site_input(j))) << "site " << j;
  // The head reads the sum of the n streams, each the standard residual: n times it, up
  // to the rounding of the running sum (at most n - 1 roundings of 2^-53 relative).
  const auto xs = download(*be, ms.site_input(L2)), xh = download(*be, mh.site_input(L2));
  for (size_t e = 0; e < xs.size(); ++e)
    EXPECT_NEAR(xh[e], n * xs[e], std::abs(n * xs[e]) * (n - 1) * 0x1p-52) << e;
}

// With random coefficients: every site input is sum_i A_m[i] h_i and the head's input
// the plain sum of the streams, the streams updated as DESIGN.md section 2 says.
TEST(HyperIdentity, HeadReadsTheSumOfTheStreams) {
  const int n = 3;
  const Config h = tiny_config(ResidualMode::Hyper, 0, true, 0, n);
  auto be = make_cpu_backend(DType::F64);
  Model m(h.model, h.residual, *be, 2, 5);
  randomize_weights(m, 12);
  std::vector<int32_t> tok, tgt;
  random_tokens(10, h.model.vocab_size, 3, tok, tgt);
  m.forward(tok.data(), tgt.data(), 0.0);
  const int L2 = 2 * h.model.n_layers;
  // Every stream recomputed on the host from the history (the sublayer outputs) and the
  // coefficients, checking each site input on the way.
  std::vector<std::vector<double>> H(static_cast<size_t>(n));
  const auto hist = download(*be, m.history());
  const size_t M = hist.size() / size_t(h.model.n_sources());
  for (auto& s : H) s.assign(hist.begin(), hist.begin() + long(M));
  for (int k = 0; k < L2; ++k) {
    const std::string pre = "model.hyper." + std::to_string(k);
    const auto am = download(*be, m.parameter(pre + ".a_m").value);
    const auto ar = download(*be, m.parameter(pre + ".a_r").value);
    const auto b = download(*be, m.parameter(pre + ".b").value);
    const auto x = download(*be, m.site_input(k));
    std::vector<std::vector<double>> next(static_cast<size_t>(n), std::vector<double>(M));
    for (size_t e = 0; e < M; ++e) {
      double xe = 0;
      for (int i = 0; i < n; ++i) xe += am[size_t(i)] * H[size_t(i)][e];
      ASSERT_NEAR(x[e], xe, 1e-12 * (1 + std::abs(xe))) << "site " << k;
      for (int i = 0; i < n; ++i) {
        double acc = b[size_t(i)] * hist[size_t(k + 1) * M + e];
        for (int r = 0; r < n; ++r) acc += ar[size_t(r * n + i)] * H[size_t(r)][e];
        next[size_t(i)][e] = acc;
      }
    }
    H = next;
  }
  const auto x = download(*be, m.site_input(L2));
  for (size_t e = 0; e < M; ++e) {
    double sum = 0;
    for (int i = 0; i < n; ++i) sum += H[size_t(i)][e];
    EXPECT_NEAR(x[e], sum, 1e-12 * (1 + std::abs(sum))) << e;
  }
}

// Dynamic Hyper-Connections at their init (w = 0) are the static ones: the same loss and
// the same gradient of every other parameter bit for bit (tanh(0) = 0 leaves every
// coefficient its static value, and the norm path adds dhbar = w dz = 0), the static
// coefficients' gradients equal up to the order of their token sums (per token first),
// s_a and s_b exactly 0 (tanh(0) = 0), and w's nonzero: the only way the dynamic terms
// can start learning.
void expect_dynamic_at_init_is_static(DType dt) {
  const int n = 3;
  Config s = tiny_config(ResidualMode::Hyper, 0, true, 0, n), dy = s;
  dy.residual.hyper_dynamic = true;
  auto be = make_cpu_backend(dt);
  Model ms(s.model, s.residual, *be, 2, 5), md(dy.model, dy.residual, *be, 2, 5);
  ms.init_weights(3);
  md.init_weights(3);
  randomize_weights(ms, 9);  // the static coefficients off their init too
  for (auto& p : ms.parameters()) {
    const auto v = download(*be, p.value);
    be->upload(md.parameter(p.name).value, v.data());
  }
  std::vector<int32_t> tok, tgt;
  random_tokens(10, s.model.vocab_size, 4, tok, tgt);
  ms.zero_grads();
  md.zero_grads();
  EXPECT_EQ(ms.forward(tok.data(), tgt.data(), 1.0), md.forward(tok.data(), tgt.data(), 1.0));
  ms.backward();
  md.backward();
  // The coefficient gradients: the same products summed per token first. Relative to the
  // size of their site's sums (|own| + |a_r's|: site 0's a_m alone is a near-total
  // cancellation, the RMSNorm eps path), one rounding per token sum, N = 10 tokens:
  // 10 * 2^-53 = 1.1e-15 in fp64 (bound 2e-15; measured 3.7e-16), 10 * 2^-24 = 6e-7 in
  // fp32 (bound 1e-6; measured 2.3e-8).
  const double tol = dt == DType::F64 ? 2e-15 : 1e-6;
  double worst = 0;
  for (auto& p : ms.parameters()) {
    const auto a = download(*be, p.grad), b = download(*be, md.parameter(p.name).grad);
    if (p.name.rfind("model.hyper.", 0) != 0) {
      EXPECT_EQ(a, b) << dtype_name(dt) << " " << p.name;
      continue;
    }
    const std::string site = p.name.substr(0, p.name.rfind('.'));
    const double scale = norm(a) + norm(download(*be, ms.parameter(site + ".a_r").grad));
    const double r = rel_error(b, a) * norm(a) / scale;
    EXPECT_LE(r, tol) << dtype_name(dt) << " " << p.name;
    worst = std::max(worst, r);
  }
  std::printf("[ hyper ] dynamic at init vs static, %s: coefficient gradients differ by %.2e of "
              "their site's scale\n", dtype_name(dt), worst);
  for (int k = 0; k < 2 * s.model.n_layers; ++k) {
    const std::string pre = "model.hyper." + std::to_string(k);
    EXPECT_EQ(download(*be, md.parameter(pre + ".s_a").grad), std::vector<double>{0.0}) << pre;
    EXPECT_EQ(download(*be, md.parameter(pre + ".s_b").grad), std::vector<double>{0.0}) << pre;
    EXPECT_GT(norm(download(*be, md.parameter(pre + ".w").grad)), 0) << pre;
    const double s0 = dt == DType::F64 ? 0.01 : double(float(0.01));
    EXPECT_EQ(download(*be, md.parameter(pre + ".s_a").value), std::vector<double>{s0}) << pre;
  }
}

TEST(HyperIdentity, DynamicAtItsInitIsStaticFp64) { expect_dynamic_at_init_is_static(DType::F64); }
TEST(HyperIdentity, DynamicAtItsInitIsStaticFp32) { expect_dynamic_at_init_is_static(DType::F32); }

// A backend that lacks the stream ops.
class NoHyperOps final : public ForwardingBackend {
 public:
  using ForwardingBackend::ForwardingBackend;
  std::string name() const override { return "test-gpu"; }
  bool has_hyper_ops() const override { return false; }
};

TEST(HyperRefusal, BackendWithoutStreamOpsFailsWhenTheModelIsBuilt) {
  const Config h = tiny_config(ResidualMode::Hyper, 0, true, 0, 2);
  auto cpu = make_cpu_backend(DType::F32);
  NoHyperOps be(*cpu);
  try {
    Model m(h.model, h.residual, be, 2, 5);
    FAIL() << "a hyper model was built on a backend without the stream ops";
  } catch (const std::exception& e) {
    const std::string what = e.what();
    EXPECT_NE(what.find("residual.mode hyper"), std::string::npos) << what;
    EXPECT_NE(what.find("test-gpu"), std::string::npos) << what;
    EXPECT_NE(what.find("--device cpu"), std::string::npos) << what;
  }
  // The base class's ops refuse too, should anything call them without the check.
  struct Bare final : ForwardingBackend {
    using ForwardingBackend::ForwardingBackend;
    void hyper_mix(Tensor x, Tensor H, Tensor c) override { Backend::hyper_mix(x, H, c); }
  } bare(*cpu);
  EXPECT_THROW(bare.hyper_mix(Tensor(), Tensor(), Tensor()), std::exception);
}

void expect_close(const std::vector<double>& got, const std::vector<double>& want, const char* what) {
  ASSERT_EQ(got.size(), want.size()) << what;
  for (size_t i = 0; i < got.size(); ++i)
    EXPECT_NEAR(got[i], want[i], 1e-12 * (1 + std::abs(want[i]))) << what << " [" << i << "]";
}

TEST(HyperOps, EachOpIsItsEquationOverwritingAndAccumulatingAsDocumented) {
  auto be = make_cpu_backend(DType::F64);
  std::mt19937_64 rng(31);
  const int n = 3;
  const int64_t N = 5, d = 4, M = N * d;
  std::vector<void*> owned;
  auto buf = [&](std::initializer_list<int64_t> shape) {
    int64_t numel = 1;
    for (int64_t x : shape) numel *= x;
    void* p = be->allocate(size_t(numel) * sizeof(double));
    owned.push_back(p);
    return Tensor(p, DType::F64, shape);
  };
  Tensor H = buf({n, N, d}), H2 = buf({n, N, d}), dH = buf({n, N, d}), dH2 = buf({n, N, d});
  Tensor x = buf({N, d}), dx = buf({N, d}), v = buf({N, d}), dv = buf({N, d});
  Tensor am = buf({n}), dam = buf({n}), ar = buf({n * n}), dar = buf({n * n}), b = buf({n}),
         db = buf({n});
  const auto h = fill(*be, H, rng), a_m = fill(*be, am, rng), a_r = fill(*be, ar, rng),
             bb = fill(*be, b, rng), vv = fill(*be, v, rng), g = fill(*be, dx, rng);

  // hyper_mix, with coefficients and as the head's plain sum.
  for (bool plain : {false, true}) {
    poison(*be, x);
    be->hyper_mix(x, H, plain ? Tensor() : am);
    std::vector<double> want(size_t(M), 0.0);
    for (int i = 0; i < n; ++i)
      for (int64_t e = 0; e < M; ++e) want[size_t(e)] += (plain ? 1.0 : a_m[size_t(i)]) * h[size_t(i * M + e)];
    expect_close(download(*be, x), want, plain ? "mix (sum)" : "mix");
  }

  // hyper_mix_backward: dH overwritten or added to; dA_m added to.
  for (bool acc : {false, true}) {
    std::vector<double> dh0(size_t(n * M), 0.0);
    if (acc) dh0 = fill(*be, dH, rng);
    else poison(*be, dH);
    const auto dam0 = fill(*be, dam, rng);
    be->hyper_mix_backward(dH, dam, dx, H, am, acc);
    std::vector<double> want_dh = dh0, want_dam = dam0;
    for (int i = 0; i < n; ++i)
      for (int64_t e = 0; e < M; ++e) {
        want_dh[size_t(i * M + e)] += a_m[size_t(i)] * g[size_t(e)];
        want_dam[size_t(i)] += g[size_t(e)] * h[size_t(i * M + e)];
      }
    expect_close(download(*be, dH), want_dh, acc ? "mix backward dH (+=)" : "mix backward dH");
    expect_close(download(*be, dam), want_dam, "mix backward dA_m");
  }
  poison(*be, dH);  // the head's form: no coefficients, so no coefficient gradient
  be->hyper_mix_backward(dH, Tensor(), dx, Tensor(), Tensor(), false);
  for (int i = 0; i < n; ++i)
    expect_close(download(*be, dH[i]), g, "sum backward");

  // hyper_update: out[i] = B[i] v + sum_r A_r[r, i] in[r].
  poison(*be, H2);
  be->hyper_update(H2, H, v, ar, b);
  std::vector<double> want(size_t(n * M));
  for (int i = 0; i < n; ++i)
    for (int64_t e = 0; e < M; ++e) {
      double s = bb[size_t(i)] * vv[size_t(e)];
      for (int r = 0; r < n; ++r) s += a_r[size_t(r * n + i)] * h[size_t(r * M + e)];
      want[size_t(i * M + e)] = s;
    }
  expect_close(download(*be, H2), want, "update");

  // hyper_update_backward: din and dv overwritten, dA_r and dB added to.
  const auto go = fill(*be, dH2, rng), dar0 = fill(*be, dar, rng), db0 = fill(*be, db, rng);
  poison(*be, dH);
  poison(*be, dv);
  be->hyper_update_backward(dH, dv, dar, db, dH2, H, v, ar, b);
  std::vector<double> want_din(size_t(n * M), 0.0), want_dv(size_t(M), 0.0), want_dar = dar0,
                      want_db = db0;
  for (int i = 0; i < n; ++i)
    for (int64_t e = 0; e < M; ++e) {
      const double gi = go[size_t(i * M + e)];
      want_dv[size_t(e)] += bb[size_t(i)] * gi;
      want_db[size_t(i)] += gi * vv[size_t(e)];
      for (int r = 0; r < n; ++r) {
        want_din[size_t(r * M + e)] += a_r[size_t(r * n + i)] * gi;
        want_dar[size_t(r * n + i)] += gi * h[size_t(r * M + e)];
      }
    }
  expect_close(download(*be, dH), want_din, "update backward din");
  expect_close(download(*be, dv), want_dv, "update backward dv");
  expect_close(download(*be, dar), want_dar, "update backward dA_r");
  expect_close(download(*be, db), want_db, "update backward dB");

  // Shapes are checked: coefficients of the wrong length, and an update in place.
  EXPECT_THROW(be->hyper_mix(x, H, ar), Error);
  EXPECT_THROW(be->hyper_update(H, H, v, ar, b), Error);
  for (void* p : owned) be->release(p);
}

}  // namespace
