// golden_test.cpp: the engine against an independent implementation. The fixtures in
// tests/fixtures/golden/ were made by tools/reference/make_golden.py (PyTorch autograd,
// float64): weights, one batch, and the expected loss, logits and every parameter
// gradient, per residual mode, for attnres and mhar with block routing
// (<mode>_block: blocks of 2 and of 3 sublayers), and for static Hyper-Connections with
// 3 streams (tied) and 4 (hyper_n4, untied), dynamic with 3 (hyper_dynamic), whose rms_eps
// is 0.05 (make_golden.py's HYPER_RMS_EPS: site 0's mix coefficients act through the
// RMSNorm's eps alone), and for the delta mode (blocks of 1 layer, tied; delta_l2: blocks of
// 2 layers, untied) at non-zero gates, null and queries. The CPU engine must match per tensor,
// relative error ||ours - ref|| / ||ref|| (the norm itself where ref is exactly 0):
//   fp64 engine: <= 1e-10 (the same arithmetic in fp64, different summation orders).
//   fp32 engine: <= max(kF32Floor, kF32Sigmas * s_t), s_t measured per tensor t (loss,
//                logits, every gradient) as below.
//
// The fp32 bound. A fixed one holds on one BLAS kernel's summation order only (1e-5
// passed with OpenBLAS's SkylakeX sgemm, worst 5.2e-6, and failed with its Haswell sgemm,
// 2.26e-5 on attnres routing.1 query/gain), so each tensor's fp32 rounding noise is
// measured, in the fp64 engine. The fp32 engine holds the fixture's weights exactly (they
// are stored as F32; perturbing them would model an error it does not make) and rounds
// every value it computes. Fp32Noise runs the fp64 engine with one fp32 rounding error
// added to each of those values: to every element of every op output (activations, saved
// statistics, gradients), and, inside the sums the fp32 kernels accumulate in fp32, to
// every partial sum in sequential order (matmuls over K, where the order is the BLAS
// kernel's; norm-weight gradients over rows; the embedding gradient over tokens). Each
// error is uniform within half an fp32 ulp of its value, as round-to-nearest leaves a
// value whose low bits are random (relative size 2^-25 to 2^-24 by where the value sits
// in its binade). s_t is the RMS over kDraws draws of the relative change of t.
// A sequential sum has the longest partial sums of any order, so s_t does not depend on
// the kernel. Measured fp32 error / s_t over every tensor of the three modes, with
// OpenBLAS's Haswell, Sandybridge and Prescott kernels: 0.2-1.7 (mean 0.6-1.4 per mode),
// so s_t is the size of the error; what the model leaves out (ops that round several
// times per element, RMSNorm's x*rstd*w, RoPE, SwiGLU and the sums inside attention, get
// one rounding of their output) is within that factor 1.7.
// Sums that cancel measure a larger s_t and get a wider bound (the routing query/gain
// gradients are sums over tokens of terms of both signs; attnres is the most sensitive
// mode throughout, s_t up to 1.4e-5 on routing.1 against 1-4e-6 in standard and mhar).
//   kF32Sigmas = 4: a 4-sigma bound on an error of RMS s_t, as the GPU parity bounds
//     (tests/model_cudatest.cpp); 2.3 times the worst error / s_t measured.
//   kF32Floor = 1e-5, the former fixed bound, as the least bound: 4 s_t of a typical
//     well-conditioned tensor here (s_t 1-4e-6), so it decides only where a tensor's own
//     4 s_t is smaller (the loss, the logits, the best-conditioned gradients), and it
//     bounds the norm of routing.0's query and gain gradients, exactly 0 in the
//     reference and in the fp32 engine (site 0 mixes a single source).
//   kPower = 1e-4: every bound must reject a mistake of that relative size in its
//     tensor, and the test checks it for each (largest bound measured: 5.7e-5, attnres
//     routing.1.query), so the test can always fail.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "engine/safetensors.h"
#include "tests/model_pair_util.h"
#include "tests/model_test_util.h"

using namespace mhar;
using namespace mhar::test;

namespace {

constexpr double kF32Sigmas = 4;
constexpr double kF32Floor = 1e-5;
constexpr int kDraws = 32;
constexpr double kPower = 1e-4;  // a mistake of this relative size must always fail
constexpr double kF64Tolerance = 1e-10;

// The fp64 CPU backend, with one random fp32 rounding error on every value the fp32
// backend rounds (see the header). Ops whose fp32 result is exact (copies, the embedding
// lookup) and those the model never trains with here (sum_squares, adamw) pass through.
class Fp32Noise final : public Backend {
 public:
  Fp32Noise() : inner_(make_cpu_backend(DType::F64)) {}
  // on = false: the plain fp64 engine.
  void reset(bool on, uint64_t seed) {
    on_ = on;
    rng_.seed(seed);
  }

  std::string name() const override { return "cpu-fp64+fp32-rounding-noise"; }
  DType act_dtype() const override { return DType::F64; }
  DType stat_dtype() const override { return DType::F64; }
  DType grad_dtype() const override { return DType::F64; }
  void* allocate(size_t bytes) override { return inner_->allocate(bytes); }
  void release(void* p) override { inner_->release(p); }
  void zero(Tensor t) override { inner_->zero(t); }
  void copy(Tensor dst, Tensor src) override { inner_->copy(dst, src); }  // exact in fp32 too
  void upload(Tensor dst, const double* host) override { inner_->upload(dst, host); }
  void download(double* host, Tensor src) override { inner_->download(host, src); }
  void upload_tokens(Tensor dst, const int32_t* host) override { inner_->upload_tokens(dst, host); }

  void embedding_forward(Tensor out, Tensor tokens, Tensor table) override {
    inner_->embedding_forward(out, tokens, table);  // a copy of fp32 weights: exact
  }
  void embedding_backward(Tensor dtable, Tensor dout, Tensor tokens) override {
    // fp32 adds token rows into the table one by one: one rounding per addition.
    const int64_t N = tokens.numel(), d = dtable.dim(1);
    std::vector<double> exact(at(dtable), at(dtable) + dtable.numel()), noisy = exact;
    inner_->embedding_backward(dtable, dout, tokens);
    for (int64_t n = 0; n < N; ++n)
      for (int64_t c = 0; c < d; ++c) {
        const size_t e = size_t(tokens.ptr<int32_t>()[n] * d + c);
        exact[e] += at(dout)[n * d + c];
        noisy[e] = rounded(noisy[e] + at(dout)[n * d + c]);
      }
    for (int64_t e = 0; e < dtable.numel(); ++e) at(dtable)[e] += noisy[size_t(e)] - exact[size_t(e)];
  }
  void rmsnorm_forward(Tensor y, Tensor rstd, Tensor x, Tensor w, double eps) override {
    inner_->rmsnorm_forward(y, rstd, x, w, eps);
    round_all(y);
    round_all(rstd);
  }
  void rmsnorm_backward(Tensor dx, Tensor dw, Tensor dy, Tensor x, Tensor w, Tensor rstd,
                        bool accumulate_dx) override {
    // dw[c] += sum over rows of dy * x * rstd, accumulated in fp32 row by row.
    const int64_t D = w.numel(), R = x.numel() / D;
    std::vector<double> before(at(dw), at(dw) + D);
    inner_->rmsnorm_backward(dx, dw, dy, x, w, rstd, accumulate_dx);
    round_all(dx);
    for (int64_t c = 0; c < D; ++c) {
      double exact = 0, noisy = 0;
      for (int64_t r = 0; r < R; ++r) {
        const double term = at(dy)[r * D + c] * at(x)[r * D + c] * at(rstd)[r];
        exact += term;
        noisy = rounded(noisy + term);
      }
      at(dw)[c] += rounded(before[size_t(c)] + noisy) - (before[size_t(c)] + exact);
    }
  }
  void matmul(Tensor c, Tensor a, Tensor b, bool ta, bool tb, bool accumulate) override {
    // sgemm: each output a sum over K of fused multiply-adds, one rounding per step,
    // then (beta = 1) one more for the addition to C.
    const int64_t M = c.dim(0), N = c.dim(1), K = ta ? a.dim(0) : a.dim(1);
    const int64_t lda = a.dim(1), ldb = b.dim(1);
    std::vector<double> before(at(c), at(c) + c.numel());
    inner_->matmul(c, a, b, ta, tb, accumulate);
    for (int64_t m = 0; m < M; ++m)
      for (int64_t n = 0; n < N; ++n) {
        double exact = 0, noisy = 0;
        for (int64_t k = 0; k < K; ++k) {
          const double term = at(a)[ta ? k * lda + m : m * lda + k] * at(b)[tb ? n * ldb + k : k * ldb + n];
          exact += term;
          noisy = rounded(noisy + term);
        }
        const double old = accumulate ? before[size_t(m * N + n)] : 0.0;
        at(c)[m * N + n] += (accumulate ? rounded(old + noisy) : noisy) - (old + exact);
      }
  }
  void rope(Tensor x, double theta, bool backward) override {
    inner_->rope(x, theta, backward);
    round_all(x);
  }
  void attention_forward(Tensor out, Tensor lse, Tensor q, Tensor k, Tensor v) override {
    inner_->attention_forward(out, lse, q, k, v);
    round_all(out);
    round_all(lse);
  }
  void attention_backward(Tensor dq, Tensor dk, Tensor dv, Tensor dout, Tensor q, Tensor k,
                          Tensor v, Tensor out, Tensor lse) override {
    inner_->attention_backward(dq, dk, dv, dout, q, k, v, out, lse);
    round_all(dq);
    round_all(dk);
    round_all(dv);
  }
  void swiglu_forward(Tensor h, Tensor gate_up) override {
    inner_->swiglu_forward(h, gate_up);
    round_all(h);
  }
  void swiglu_backward(Tensor d_gate_up, Tensor h, Tensor dh, Tensor gate_up) override {
    inner_->swiglu_backward(d_gate_up, h, dh, gate_up);
    round_all(d_gate_up);
    if (!h.empty()) round_all(h);
  }
  void add(Tensor out, Tensor a, Tensor b) override {
    inner_->add(out, a, b);
    round_all(out);
  }
  void add_inplace(Tensor y, Tensor x) override {
    inner_->add_inplace(y, x);
    round_all(y);
  }
  void cross_entropy(Tensor losses, Tensor logits, Tensor targets, double grad_scale,
                     bool compute_grad) override {
    inner_->cross_entropy(losses, logits, targets, grad_scale, compute_grad);
    round_all(losses);
    if (compute_grad) round_all(logits);
  }
  // Routing: only the pairs a call writes are rounded (weights holds every pair).
  void routing_source_logits(Tensor weights, Tensor inv_rms, Tensor v, const RoutingParams& p,
                             const RoutingLayout& lay, int source, int heads, double eps) override {
    inner_->routing_source_logits(weights, inv_rms, v, p, lay, source, heads, eps);
    round_all(inv_rms);
    for (int k = source; k <= lay.last_site(source); ++k) round_all(weights[lay.pair(source, k)]);
  }
  void routing_mix(Tensor x, Tensor weights, Tensor history, const RoutingLayout& lay, int site,
                   int heads) override {
    inner_->routing_mix(x, weights, history, lay, site, heads);
    round_all(x);
    for (int t = 0; t < lay.site_sources(site); ++t)
      round_all(weights[lay.pair(lay.site_source(site, t), site)]);
  }
  void routing_source_backward(Tensor dv, Tensor weights, Tensor ubar, Tensor gsum,
                               const std::vector<Tensor>& site_dx, Tensor x, Tensor v,
                               Tensor inv_rms,
                               const RoutingParams& p, const RoutingLayout& lay, int source,
                               int heads) override {
    inner_->routing_source_backward(dv, weights, ubar, gsum, site_dx, x, v, inv_rms, p, lay,
                                    source, heads);
    round_all(dv);
    for (int k = source; k <= lay.last_site(source); ++k) round_all(weights[lay.pair(source, k)]);
    round_all(ubar[source]);
    round_all(gsum);  // G_k += this source's sum, for every site k reading it (zeros stay zero)
  }
  void routing_param_grads(const RoutingParams& p, Tensor gsum) override {
    inner_->routing_param_grads(p, gsum);
    for (int k = 0; k < p.sites(); ++k) {
      round_all(p.dquery[size_t(k)]);
      round_all(p.dgain[size_t(k)]);
    }
  }
  // Hyper-Connections: the fp32 kernels accumulate every element, the coefficient
  // gradients' token sums included, in double and round it once (engine/cpu/hyper.h).
  bool has_hyper_ops() const override { return true; }
  void hyper_mix(Tensor x, Tensor H, Tensor c) override {
    inner_->hyper_mix(x, H, c);
    round_all(x);
  }
  void hyper_mix_backward(Tensor dH, Tensor dc, Tensor dx, Tensor H, Tensor c, bool acc) override {
    inner_->hyper_mix_backward(dH, dc, dx, H, c, acc);
    round_all(dH);
    if (!c.empty()) round_all(dc);
  }
  void hyper_update(Tensor out, Tensor in, Tensor v, Tensor Ar, Tensor B) override {
    inner_->hyper_update(out, in, v, Ar, B);
    round_all(out);
  }
  void hyper_update_backward(Tensor din, Tensor dv, Tensor dAr, Tensor dB, Tensor dout, Tensor in,
                             Tensor v, Tensor Ar, Tensor B) override {
    inner_->hyper_update_backward(din, dv, dAr, dB, dout, in, v, Ar, B);
    for (Tensor t : {din, dv, dAr, dB}) round_all(t);
  }
  // Dynamic Hyper-Connections: the same, each output rounded once (the per-token
  // coefficients, their tanh and rstd, the mixes, and every gradient).
  void hyper_dynamic_coef(Tensor C, Tensor T, Tensor rstd, Tensor H, Tensor W, Tensor Am, Tensor Ar,
                          Tensor B, Tensor sa, Tensor sb, double eps) override {
    inner_->hyper_dynamic_coef(C, T, rstd, H, W, Am, Ar, B, sa, sb, eps);
    for (Tensor t : {C, T, rstd}) round_all(t);
  }
  void hyper_mix_dynamic(Tensor x, Tensor H, Tensor C) override {
    inner_->hyper_mix_dynamic(x, H, C);
    round_all(x);
  }
  void hyper_mix_dynamic_backward(Tensor dH, Tensor dC, Tensor dx, Tensor H, Tensor C) override {
    inner_->hyper_mix_dynamic_backward(dH, dC, dx, H, C);
    for (Tensor t : {dH, dC}) round_all(t);
  }
  void hyper_update_dynamic(Tensor out, Tensor in, Tensor v, Tensor C) override {
    inner_->hyper_update_dynamic(out, in, v, C);
    round_all(out);
  }
  void hyper_update_dynamic_backward(Tensor din, Tensor dv, Tensor dC, Tensor dout, Tensor in,
                                     Tensor v, Tensor C) override {
    inner_->hyper_update_dynamic_backward(din, dv, dC, dout, in, v, C);
    for (Tensor t : {din, dv, dC}) round_all(t);
  }
  void hyper_dynamic_coef_backward(Tensor dH, Tensor dW, Tensor dAm, Tensor dAr, Tensor dB,
                                   Tensor dsa, Tensor dsb, Tensor dC, Tensor H, Tensor W, Tensor T,
                                   Tensor rstd, Tensor sa, Tensor sb) override {
    inner_->hyper_dynamic_coef_backward(dH, dW, dAm, dAr, dB, dsa, dsb, dC, H, W, T, rstd, sa, sb);
    for (Tensor t : {dH, dW, dAm, dAr, dB, dsa, dsb}) round_all(t);
  }

  // Delta: each element (the gate's and the null's token sums included) accumulated in
  // double and rounded once (engine/cpu/delta.h); the null's broadcast is a copy.
  bool has_delta_ops() const override { return true; }
  void delta_gate(Tensor x, Tensor base, Tensor alpha, Tensor r) override {
    inner_->delta_gate(x, base, alpha, r);
    round_all(x);
  }
  void delta_gate_backward(Tensor dr, Tensor da, Tensor dx, Tensor r, Tensor alpha,
                           Tensor scratch) override {
    inner_->delta_gate_backward(dr, da, dx, r, alpha, scratch);
    round_all(dr);
    round_all(da);
  }
  void delta_null_forward(Tensor out, Tensor row) override { inner_->delta_null_forward(out, row); }
  void delta_null_backward(Tensor drow, Tensor dout, Tensor scratch) override {
    inner_->delta_null_backward(drow, dout, scratch);
    round_all(drow);
  }
  double sum_squares(Tensor t) override { return inner_->sum_squares(t); }
  void adamw(Tensor param, Tensor master, Tensor grad, Tensor m, Tensor v, const AdamW& hp) override {
    inner_->adamw(param, master, grad, m, v, hp);
  }

 private:
  static double* at(const Tensor& t) { return t.ptr<double>(); }
  // x plus the error of rounding it to fp32 (round to nearest): uniform within half an
  // fp32 ulp of x. For |x| in [2^E, 2^(E+1)) that is 2^(E-24): x's exponent field less 24
  // (by bits, as this runs a few million times per test).
  double rounded(double x) {
    uint64_t bits;
    std::memcpy(&bits, &x, sizeof bits);
    const uint64_t exponent = bits >> 52 & 0x7ff;
    if (!on_ || exponent <= 24 || exponent == 0x7ff) return x;  // 0, far below fp32's range, inf
    const uint64_t half_ulp_bits = (exponent - 24) << 52;
    double half_ulp;
    std::memcpy(&half_ulp, &half_ulp_bits, sizeof half_ulp);
    return x + half_ulp * (double(int64_t(rng_()) >> 11) * 0x1p-52);  // uniform in [-1, 1)
  }
  void round_all(Tensor t) {
    for (int64_t i = 0; i < t.numel(); ++i) at(t)[i] = rounded(at(t)[i]);
  }

  std::unique_ptr<Backend> inner_;
  bool on_ = false;
  std::mt19937_64 rng_;
};

// Loss and logits of a forward without gradient, then every parameter gradient.
struct Outputs {
  double loss;
  std::vector<double> logits;
  std::vector<std::vector<double>> grads;
};

Outputs evaluate(Model& m, Backend& be, const std::vector<int32_t>& tokens,
                 const std::vector<int32_t>& targets) {
  Outputs o;
  o.loss = m.forward(tokens.data(), targets.data(), 0.0);
  o.logits = download(be, m.logits());
  m.zero_grads();
  m.forward(tokens.data(), targets.data(), 1.0);
  m.backward();
  for (auto& p : m.parameters()) o.grads.push_back(download(be, p.grad));
  return o;
}

struct GoldenCase {
  const char* fixture;  // tests/fixtures/golden/<fixture>.safetensors
  const char* mode;
  DType dtype;
};

class Golden : public ::testing::TestWithParam<GoldenCase> {};

TEST_P(Golden, LossLogitsAndEveryGradientMatchPyTorch) {
  const GoldenCase& gc = GetParam();
  const std::string path =
      std::string(MHAR_SOURCE_DIR) + "/tests/fixtures/golden/" + gc.fixture + ".safetensors";
  SafetensorsFile f = SafetensorsFile::load(path);
  nlohmann::json meta = nlohmann::json::parse(f.metadata().at("config").get<std::string>());
  const int B = meta.at("batch"), T = meta.at("seq_len");
  nlohmann::json cfg_json = {{"model", meta.at("model")}, {"residual", meta.at("residual")},
                             {"train", {{"micro_batch", B}, {"seq_len", T}, {"warmup_steps", 0}}}};
  Config cfg = config_from_json(cfg_json, path);
  ASSERT_STREQ(residual_mode_name(cfg.residual.mode), gc.mode);
  // The block fixtures must route over blocks (block_size 1 would be full routing).
  ASSERT_EQ(std::string(gc.fixture).find("_block") != std::string::npos, cfg.residual.block_size > 1);

  auto be = make_cpu_backend(gc.dtype);
  Model m(cfg.model, cfg.residual, *be, B, T);
  // Every model parameter must be in the fixture, and every fixture weight in the model.
  size_t weights_in_file = 0;
  for (const auto& name : f.names())
    if (name.rfind("model.", 0) == 0 || name.rfind("lm_head.", 0) == 0) ++weights_in_file;
  ASSERT_EQ(weights_in_file, m.parameters().size());
  for (auto& p : m.parameters()) {
    ASSERT_EQ(f.numel(p.name), p.value.numel()) << p.name;
    auto w = f.to_f64(p.name);
    be->upload(p.value, w.data());
  }
  const auto tokens = f.to_i32("input_ids"), targets = f.to_i32("targets");
  ASSERT_EQ(int(tokens.size()), B * T);
  const Outputs got = evaluate(m, *be, tokens, targets);

  // Every output by name: got, the reference, and (fp32) its measured rounding noise.
  std::vector<std::string> names = {"loss", "logits"};
  std::vector<std::vector<double>> ours = {{got.loss}, got.logits};
  std::vector<std::vector<double>> ref = {f.to_f64("expected.loss"), f.to_f64("expected.logits")};
  for (size_t i = 0; i < m.parameters().size(); ++i) {
    names.push_back(m.parameters()[i].name);
    ours.push_back(got.grads[i]);
    ref.push_back(f.to_f64("expected.grad." + m.parameters()[i].name));
  }
  std::vector<double> noise(names.size(), 0.0);
  if (gc.dtype == DType::F32) {
    Fp32Noise nb;
    Model mn(cfg.model, cfg.residual, nb, B, T);
    copy_weights(m, mn);
    const Outputs base = evaluate(mn, nb, tokens, targets);
    for (int draw = 0; draw < kDraws; ++draw) {
      nb.reset(true, 1000 + uint64_t(draw));
      const Outputs o = evaluate(mn, nb, tokens, targets);
      std::vector<double> e = {rel_error({o.loss}, {base.loss}), rel_error(o.logits, base.logits)};
      for (size_t i = 0; i < o.grads.size(); ++i) e.push_back(rel_error(o.grads[i], base.grads[i]));
      for (size_t i = 0; i < e.size(); ++i) noise[i] += e[i] * e[i] / kDraws;
    }
    for (double& s : noise) s = std::sqrt(s);
  }

  double worst_ratio = 0;
  std::string worst_name;
  for (size_t i = 0; i < names.size(); ++i) {
    const double err = rel_error(ours[i], ref[i]);
    const double bound = gc.dtype == DType::F32 ? std::max(kF32Floor, kF32Sigmas * noise[i])
                                                : kF64Tolerance;
    EXPECT_LE(err, bound) << gc.fixture << " " << dtype_name(gc.dtype) << " " << names[i]
                          << " (measured fp32 noise " << noise[i] << ")";
    // The test must stay able to fail: a mistake of kPower relative (in a random
    // direction, on top of what we computed) must break the bound of every tensor.
    if (norm(ref[i]) > 0) {
      std::mt19937_64 rng(17 + i);
      std::normal_distribution<double> nd;
      std::vector<double> dir(ref[i].size()), wrong = ours[i];
      for (double& x : dir) x = nd(rng);
      const double scale = kPower * norm(ref[i]) / norm(dir);
      for (size_t e = 0; e < wrong.size(); ++e) wrong[e] += scale * dir[e];
      EXPECT_GT(rel_error(wrong, ref[i]), bound)
          << names[i] << ": a " << kPower << " relative mistake would pass the bound " << bound;
    }
    const double ratio = err / bound;
    std::printf("[ golden ] %s %s %-34s error %.2e  fp32 noise %.2e  bound %.2e  error/bound %.2f\n",
                gc.fixture, dtype_name(gc.dtype), names[i].c_str(), err, noise[i], bound, ratio);
    if (ratio > worst_ratio) worst_ratio = ratio, worst_name = names[i];
  }
  std::printf("[ golden ] %s %s: loss %.9f (ref %.9f); worst error/bound %.2f (%s)\n", gc.fixture,
              dtype_name(gc.dtype), got.loss, ref[0][0], worst_ratio, worst_name.c_str());
}

INSTANTIATE_TEST_SUITE_P(
    AllModes, Golden,
    ::testing::Values(GoldenCase{"standard", "standard", DType::F32},
                      GoldenCase{"attnres", "attnres", DType::F32},
                      GoldenCase{"mhar", "mhar", DType::F32},
                      GoldenCase{"attnres_block", "attnres", DType::F32},
                      GoldenCase{"mhar_block", "mhar", DType::F32},
                      GoldenCase{"hyper", "hyper", DType::F32},
                      GoldenCase{"hyper_n4", "hyper", DType::F32},
                      GoldenCase{"hyper_dynamic", "hyper", DType::F32},
                      GoldenCase{"delta", "delta", DType::F32},
                      GoldenCase{"delta_l2", "delta", DType::F32},
                      GoldenCase{"standard", "standard", DType::F64},
                      GoldenCase{"attnres", "attnres", DType::F64},
                      GoldenCase{"mhar", "mhar", DType::F64},
                      GoldenCase{"attnres_block", "attnres", DType::F64},
                      GoldenCase{"mhar_block", "mhar", DType::F64},
                      GoldenCase{"hyper", "hyper", DType::F64},
                      GoldenCase{"hyper_n4", "hyper", DType::F64},
                      GoldenCase{"hyper_dynamic", "hyper", DType::F64},
                      GoldenCase{"delta", "delta", DType::F64},
                      GoldenCase{"delta_l2", "delta", DType::F64}),
    [](const ::testing::TestParamInfo<GoldenCase>& i) {
      return std::string(i.param.fixture) + "_" + dtype_name(i.param.dtype);
    });

}  // namespace
