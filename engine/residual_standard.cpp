// residual_standard.cpp: the `standard` residual scheme (DESIGN.md section 2), the
// ordinary residual stream x_0 = v_0, x_j = x_{j-1} + v_j, and the factory of every
// scheme. No parameters. The backward keeps one running gradient
// dresid = sum_{k >= j} dx_k, which is the gradient of v_j once site j's dx_j is added,
// and a short-lived dx_j per site.
#include "engine/model.h"
#include "engine/residual.h"

namespace mhar {

std::unique_ptr<ResidualScheme> make_routed_scheme(const SchemeContext& ctx);  // residual_routed.cpp
std::unique_ptr<ResidualScheme> make_hyper_scheme(const SchemeContext& ctx);   // residual_hyper.cpp
std::unique_ptr<ResidualScheme> make_delta_scheme(const SchemeContext& ctx);   // residual_delta.cpp

namespace {

class StandardScheme final : public ResidualScheme {
 public:
  explicit StandardScheme(const SchemeContext& ctx) : c_(ctx) {}

  void plan(MemoryPlan& P, const Timeline& t, int64_t N, int history,
            std::vector<int>& site_x) override {
    const int L = c_.cfg.n_layers, S = c_.cfg.n_sites();
    const int64_t d = c_.cfg.d_model;
    const DType at = c_.be.act_dtype();
    history_ = history;
    site_x_.clear();
    site_dx_.clear();
    dresid_ = P.add("residual.grad", at, {N, d}, t.back(t.head()), t.last());
    for (int j = 0; j < S; ++j) {
      const std::string name = "site." + std::to_string(j);
      const int consumer = j < 2 * L ? t.sublayer(j) : t.head();  // the event that reads x_j
      site_x_.push_back(P.add(name + ".x", at, {N, d}, t.site(j), t.back(consumer)));
      site_dx_.push_back(
          P.add(name + ".x.grad", at, {N, d}, t.back(consumer), t.back(t.site(j))));
    }
    site_x = site_x_;
  }

  void site_forward(int j) override {
    Tensor hist = c_.act(history_), x = c_.act(site_x_[size_t(j)]);
    if (j == 0) c_.be.copy(x, hist[0]);
    else c_.be.add(x, c_.act(site_x_[size_t(j - 1)]), hist[j]);
  }

  void begin_backward() override { c_.be.zero(c_.act(dresid_)); }
  Tensor site_grad(int j) override { return c_.act(site_dx_[size_t(j)]); }
  void site_backward(int j) override { c_.be.add_inplace(c_.act(dresid_), site_grad(j)); }
  // The running sum, read by sublayer i-1's backward right after site i's backward: at
  // that point exactly sum_{k >= i} dx_k.
  Tensor source_grad(int) override { return c_.act(dresid_); }
  bool finish_backward() override { return false; }

 private:
  SchemeContext c_;
  int history_ = -1, dresid_ = -1;
  std::vector<int> site_x_, site_dx_;
};

}  // namespace

int ResidualScheme::site_sources(int) const {
  fail("routing exists only in routed modes (attnres, mhar)");
}
std::vector<double> ResidualScheme::routing_weights(int) const {
  fail("routing weights exist only in routed modes (attnres, mhar)");
}
void ResidualScheme::routing_stats(int, Tensor) {
  fail("routing statistics exist only in routed modes (attnres, mhar)");
}

std::unique_ptr<ResidualScheme> make_residual_scheme(const SchemeContext& ctx) {
  switch (ctx.res.mode) {
    case ResidualMode::Standard: return std::make_unique<StandardScheme>(ctx);
    case ResidualMode::AttnRes:
    case ResidualMode::Mhar: return make_routed_scheme(ctx);
    case ResidualMode::Hyper: return make_hyper_scheme(ctx);
    case ResidualMode::Delta: return make_delta_scheme(ctx);
  }
  fail("unknown residual mode ", int(ctx.res.mode));
}

}  // namespace mhar
