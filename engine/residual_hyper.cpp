// residual_hyper.cpp: the `hyper` residual scheme, static and dynamic Hyper-Connections (Zhu et al.,
// arXiv 2409.19606; DESIGN.md section 2) with n = residual.hyper_n streams.
//
// Streams H^k = [h_1..h_n] before sublayer k (k = 0..2L), each [N, d]; H^0 is n copies of
// v_0 (history slot 0). Site k < 2L feeds its sublayer x_k = sum_i A_m^k[i] h_i; the
// sublayer's output v_{k+1} (history slot k+1) then makes the next streams
//   H^{k+1}_i = B^k[i] v_{k+1} + sum_r A_r^k[r, i] H^k_r
// and site 2L (the head) reads x_{2L} = sum_i h_i. Parameters per sublayer k, in the
// gradient bucket "hyper": model.hyper.k.a_m [n] (init one-hot(k mod n)), .a_r [n, n]
// row-major (init I_n), .b [n] (init 1); at init every stream is the pre-norm residual
// of the sublayers it has seen, and with n = 1 the scheme is `standard` exactly.
//
// Every H^k is kept for the backward (A_m^k's and A_r^k's gradients read it). The
// backward of site k (k >= 1) first adds its mix's part to dH^k, then undoes the update
// that made H^k: dv_k (source_grad(k), read next by sublayer k-1) and dH^{k-1}.
//
// Dynamic (residual.hyper_dynamic, the paper's DHC): per sublayer also .w [d, n+2]
// (init 0), .s_a and .s_b (init 0.01). Per token, stream r's coefficients
// (A_m[r], A_r[r, :], B[r]) each add s * tanh(hbar_r @ w[:, c]) (s_a for A_m and A_r,
// s_b for B), hbar_r = h_r / sqrt(mean(h_r^2) + rms_eps). The norm is RMSNorm without a
// scale, not the paper's LayerNorm: the model normalises with RMSNorm everywhere (the
// routing keys too), and a learned scale or shift in front of the linear map w would
// only duplicate w (a scale) or add a per-stream bias the static coefficients already
// are. At init (w = 0) the coefficients are the static ones exactly. Site k computes C^k
// from H^k once (hyper_dynamic_coef); its mix and sublayer k's update read it. Backward:
// site k+1 fills the update's columns of dC^k, site k the mix's, then turns dC^k into
// the parameter gradients and dH^k's share through the norm. CPU reference and CUDA
// (cuda/hyper.cu), as the static ops.
//
// The stream ops are Backend::hyper_* (CPU reference, CUDA cuda/hyper.cu); the scheme
// asks the backend (check_hyper) when it is built, so a backend without them, or without
// this n or variant, is refused before any step runs.
#include "engine/model.h"
#include "engine/residual.h"

namespace mhar {

namespace {

class HyperScheme final : public ResidualScheme {
 public:
  explicit HyperScheme(const SchemeContext& ctx)
      : c_(ctx), n_(ctx.res.hyper_n), dyn_(ctx.res.hyper_dynamic) {
    c_.be.check_hyper(n_, dyn_);
    MHAR_CHECK(n_ >= 1, "residual.hyper_n ", n_);
  }

  const char* bucket() const override { return "hyper"; }
  void add_parameters(const AddParameter& add) override {
    for (int k = 0; k < 2 * c_.cfg.n_layers; ++k) {
      const std::string pre = "model.hyper." + std::to_string(k);
      a_m_.push_back(add(pre + ".a_m", n_, Init::OneHot, k % n_));
      a_r_.push_back(add(pre + ".a_r", int64_t(n_) * n_, Init::Identity, n_));
      b_.push_back(add(pre + ".b", n_, Init::One, 0));
      if (dyn_) {
        w_.push_back(add(pre + ".w", c_.cfg.d_model * (n_ + 2), Init::Zero, 0));
        s_a_.push_back(add(pre + ".s_a", 1, Init::HyperScale, 0));
        s_b_.push_back(add(pre + ".s_b", 1, Init::HyperScale, 0));
      }
    }
  }

  void plan(MemoryPlan& P, const Timeline& t, int64_t N, int history,
            std::vector<int>& site_x) override;
  void op_scratch_shapes(OpScratchShapes& shapes) const override {
    shapes.hyper_streams = n_;
    shapes.hyper_dynamic = dyn_;
  }

  void site_forward(int j) override {
    const int L2 = 2 * c_.cfg.n_layers;
    Tensor x = c_.act(site_x_[size_t(j)]), H = c_.act(streams_[size_t(j)]);
    if (j == 0)
      for (int i = 0; i < n_; ++i) c_.be.copy(H[i], c_.act(history_)[0]);
    if (j == L2 || !dyn_) {
      c_.be.hyper_mix(x, H, j < L2 ? p(a_m_, j) : Tensor());
      return;
    }
    Tensor C = c_.act(coef_[size_t(j)]);
    c_.be.hyper_dynamic_coef(C, c_.act(tanh_[size_t(j)]), c_.act(rstd_[size_t(j)]), H, p(w_, j),
                             p(a_m_, j), p(a_r_, j), p(b_, j), p(s_a_, j), p(s_b_, j),
                             c_.cfg.rms_eps);
    c_.be.hyper_mix_dynamic(x, H, C);
  }
  void sublayer_done(int j) override {
    Tensor out = c_.act(streams_[size_t(j + 1)]), in = c_.act(streams_[size_t(j)]),
           v = c_.act(history_)[j + 1];
    if (dyn_) c_.be.hyper_update_dynamic(out, in, v, c_.act(coef_[size_t(j)]));
    else c_.be.hyper_update(out, in, v, p(a_r_, j), p(b_, j));
  }

  void begin_backward() override {}
  Tensor site_grad(int j) override { return c_.act(site_dx_[size_t(j)]); }
  void site_backward(int j) override;
  Tensor source_grad(int i) override { return c_.act(source_dx_[size_t(i)]); }
  bool source_grad_held_through_site() const override { return true; }
  bool finish_backward() override { return true; }  // every coefficient's gradient is in

 private:
  Tensor p(const std::vector<int>& ids, int k) const { return c_.params[size_t(ids[size_t(k)])].value; }
  Tensor g(const std::vector<int>& ids, int k) const { return c_.params[size_t(ids[size_t(k)])].grad; }

  SchemeContext c_;
  int n_;
  bool dyn_;
  std::vector<int> a_m_, a_r_, b_;  // parameter indices, per sublayer
  std::vector<int> w_, s_a_, s_b_;  // dynamic only
  int history_ = -1;
  // Plan ids: streams H^k and their gradients, k = 0..2L; site inputs and their
  // gradients, per site; v_k's gradients, per source. Dynamic, per sublayer: the
  // per-token coefficients C^k and their gradient, tanh T^k and the streams' rstd.
  std::vector<int> streams_, dstreams_, site_x_, site_dx_, source_dx_;
  std::vector<int> coef_, dcoef_, tanh_, rstd_;
};

void HyperScheme::plan(MemoryPlan& P, const Timeline& t, int64_t N, int history,
                       std::vector<int>& site_x) {
  const int L2 = 2 * c_.cfg.n_layers, S = L2 + 1, last = t.last();
  const int64_t d = c_.cfg.d_model;
  const DType at = c_.be.act_dtype();
  history_ = history;
  for (auto* v : {&streams_, &dstreams_, &site_x_, &site_dx_, &source_dx_, &coef_, &dcoef_,
                  &tanh_, &rstd_})
    v->clear();
  for (int k = 0; k < S; ++k) {
    const std::string name = "hyper.streams." + std::to_string(k);
    // H^k is made by site 0 (k = 0) or sublayer k-1's update; site k's backward reads it
    // (A_m^k), and site k+1's backward (A_r^k, the update's input) before that. H^{2L}
    // has no coefficients to learn: it only feeds the head's sum.
    const int made = k == 0 ? t.site(0) : t.sublayer(k - 1);
    streams_.push_back(P.add(name, at, {n_, N, d}, made, k < L2 ? t.back(t.site(k)) : t.site(k)));
    // dH^k: made at site k+1's backward (site k's own for k = 2L), used up at site k's.
    const int from = k < L2 ? t.back(t.site(k + 1)) : t.back(t.site(k));
    dstreams_.push_back(P.add(name + ".grad", at, {n_, N, d}, from, t.back(t.site(k))));
  }
  for (int j = 0; j < S; ++j) {
    const std::string name = "site." + std::to_string(j);
    const int consumer = j < L2 ? t.sublayer(j) : t.head();
    site_x_.push_back(P.add(name + ".x", at, {N, d}, t.site(j), t.back(consumer)));
    site_dx_.push_back(P.add(name + ".x.grad", at, {N, d}, t.back(consumer), t.back(t.site(j))));
  }
  // v_i's gradient, made at site i's backward, read by the sublayer that wrote v_i (or,
  // for v_0, by the embedding's backward at the very end); it lives through site i-1's
  // backward (source_grad_held_through_site).
  for (int i = 0; i < S; ++i)
    source_dx_.push_back(P.add("source." + std::to_string(i) + ".grad", at, {N, d},
                               t.back(t.site(i)), i == 0 ? last : t.back(t.site(i - 1))));
  // Dynamic: C^k [N, n, n+2] is made at site k and read by the mix, the update (sublayer
  // k), the update's backward (site k+1's) and the mix's (site k's); its gradient is
  // filled by those two backwards, the update's columns first, then site k's reads it
  // with T^k and rstd^k.
  if (dyn_) {
    const DType st = c_.be.stat_dtype();
    for (int k = 0; k < L2; ++k) {
      const std::string name = "hyper.dynamic." + std::to_string(k);
      coef_.push_back(P.add(name + ".coef", st, {N, n_, n_ + 2}, t.site(k), t.back(t.site(k))));
      dcoef_.push_back(P.add(name + ".coef.grad", st, {N, n_, n_ + 2}, t.back(t.site(k + 1)),
                             t.back(t.site(k))));
      tanh_.push_back(P.add(name + ".tanh", st, {N, n_, n_ + 2}, t.site(k), t.back(t.site(k))));
      rstd_.push_back(P.add(name + ".rstd", st, {N, n_}, t.site(k), t.back(t.site(k))));
    }
  }
  site_x = site_x_;
}

void HyperScheme::site_backward(int j) {
  const int L2 = 2 * c_.cfg.n_layers;
  Tensor dx = site_grad(j), dH = c_.act(dstreams_[size_t(j)]);
  if (j == L2) {
    c_.be.hyper_mix_backward(dH, Tensor(), dx, Tensor(), Tensor(), false);
  } else if (!dyn_) {
    c_.be.hyper_mix_backward(dH, g(a_m_, j), dx, c_.act(streams_[size_t(j)]), p(a_m_, j), true);
  } else {
    // dC^j is complete once the mix's column is in (the update's came from site j+1).
    Tensor H = c_.act(streams_[size_t(j)]), dC = c_.act(dcoef_[size_t(j)]);
    c_.be.hyper_mix_dynamic_backward(dH, dC, dx, H, c_.act(coef_[size_t(j)]));
    c_.be.hyper_dynamic_coef_backward(dH, g(w_, j), g(a_m_, j), g(a_r_, j), g(b_, j), g(s_a_, j),
                                      g(s_b_, j), dC, H, p(w_, j), c_.act(tanh_[size_t(j)]),
                                      c_.act(rstd_[size_t(j)]), p(s_a_, j), p(s_b_, j));
  }
  if (j == 0) {
    // H^0 is n copies of v_0.
    c_.be.hyper_mix(source_grad(0), dH, Tensor());
    return;
  }
  const int k = j - 1;  // the update that made H^j
  if (dyn_) {
    c_.be.hyper_update_dynamic_backward(c_.act(dstreams_[size_t(k)]), source_grad(j),
                                        c_.act(dcoef_[size_t(k)]), dH, c_.act(streams_[size_t(k)]),
                                        c_.act(history_)[j], c_.act(coef_[size_t(k)]));
    return;
  }
  c_.be.hyper_update_backward(c_.act(dstreams_[size_t(k)]), source_grad(j), g(a_r_, k), g(b_, k),
                              dH, c_.act(streams_[size_t(k)]), c_.act(history_)[j], p(a_r_, k),
                              p(b_, k));
}

}  // namespace

std::unique_ptr<ResidualScheme> make_hyper_scheme(const SchemeContext& ctx) {
  return std::make_unique<HyperScheme>(ctx);
}

}  // namespace mhar
