// residual_standard.cpp: the `standard` residual scheme (DESIGN.md section 2), the
// ordinary residual stream x_0 = v_0, x_j = x_{j-1} + v_j, and the factory of every
// scheme. No parameters.
// Forward: site j >= 1 writes x_j and its consumer's normed input in one pass
// (Backend::add_rmsnorm_forward: the same bits as the add and the norm in turn, one read
// of x_j fewer); site 0 is a copy of v_0, normalised by the model.
// Backward: one running gradient dresid, which after site j's consumer has run is
// sum_{k >= j} dx_k, the gradient of v_j. Each consumer's norm backward adds its dx_j
// straight into dresid (site_grad_accumulates), the head's (the first) overwrites it, so
// there is neither a separate dx_j buffer nor an add per site. On the CPU the sums are
// the same, in the same order, as dx_j into its own buffer followed by dresid += dx_j
// (rmsnorm_backward's "+=" adds the finished dx_j value to the old one; the head's
// overwrite gives 0 + dx_j, which differs from dx_j only in the sign of a zero). On CUDA
// the "+=" rounds dx_j to bf16 before adding, as the two-op path stores it, so there too
// the bits are the two-op path's (tests/residual_fusion_test.cpp, NormParity in
// tests/norm_cudatest.cpp, cuda/NOTES.md).
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
    dresid_ = P.add("residual.grad", at, {N, d}, t.back(t.head()), t.last());
    for (int j = 0; j < S; ++j) {
      const int consumer = j < 2 * L ? t.sublayer(j) : t.head();  // the event that reads x_j
      site_x_.push_back(P.add("site." + std::to_string(j) + ".x", at, {N, d}, t.site(j),
                              t.back(consumer)));
    }
    site_x = site_x_;
  }

  void site_forward(int j) override {
    Tensor hist = c_.act(history_), x = c_.act(site_x_[size_t(j)]);
    if (j == 0) c_.be.copy(x, hist[0]);
    else c_.be.add(x, c_.act(site_x_[size_t(j - 1)]), hist[j]);
  }
  bool site_forward_normed(int j, const SiteNorm& n) override {
    if (j == 0) {
      site_forward(j);
      return false;
    }
    c_.be.add_rmsnorm_forward(c_.act(site_x_[size_t(j)]), n.y, n.rstd,
                              c_.act(site_x_[size_t(j - 1)]), c_.act(history_)[j], n.w, n.eps);
    return true;
  }

  // dresid is written first by the head's norm backward (site 2L), so nothing zeroes it.
  void begin_backward() override {}
  Tensor site_grad(int) override { return c_.act(dresid_); }
  bool site_grad_accumulates(int j) const override { return j < 2 * c_.cfg.n_layers; }
  void site_backward(int) override {}  // dx_j is already in dresid
  // The running sum, read by sublayer i-1's backward after site i's consumer added dx_i:
  // at that point exactly sum_{k >= i} dx_k.
  Tensor source_grad(int) override { return c_.act(dresid_); }
  bool finish_backward() override { return false; }

 private:
  SchemeContext c_;
  int history_ = -1, dresid_ = -1;
  std::vector<int> site_x_;
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
