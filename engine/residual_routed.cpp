// residual_routed.cpp: the routed residual schemes, `attnres` (H = 1) and `mhar`
// (H = residual.heads), full or block routing (residual.block_size), DESIGN.md
// sections 2-3. Parameters: a query (init 0) and a gain (init 1) [d] per site, in the
// gradient bucket "routing".
//
// History slot j is the scheme's source slot j (backend.h's RoutingLayout with block s):
// v_0 for j = 0; for j >= 1 the sum of the current block's outputs up to v_j, made once
// as sublayer j-1 finishes (its output GEMM writes v_j into the slot, then the slot
// before it is added when v_j continues a block), so a block sum is never re-summed.
// With s = 1 (full routing) slot j is v_j itself and nothing is added.
//
// Forward: when site j runs, slot j has just been written: its RMS and its logits for
// every later site that reads it are computed once (routing_source_logits; the queries
// are parameters), then site j's sources are mixed (routing_mix_rmsnorm, with the
// consumer's input norm, which a backend may fuse into the mix's pass; at the start of
// each depth tile of the backend's plan routing_mix_tile_rmsnorm, the same with the
// tile's promise). The
// backward is source-stationary: site j's backward event builds the whole gradient of
// slot j from the input gradients of the sites that read it (at the start of each
// backward depth tile, routing_source_backward_tile, when the backend tiles: the backend
// may then read them once for the tile's slots), so every site's input gradient stays
// alive until the end of the backward (one [N, d] buffer per site, each planned from its
// site's backward on) and each slot's gradient is written once. A sublayer output v_j is
// in every slot from j to the end of its block, so its gradient is slot j's plus
// v_{j+1}'s when v_{j+1} continues the block (added at site j's backward: a running sum
// from the block's end down).
#include <algorithm>

#include "engine/model.h"
#include "engine/residual.h"

namespace mhar {

namespace {

// The count of the plan's tile that starts at each site (0 inside a tile), after checking
// that the plan covers the sites in order.
std::vector<int> tile_starts(const std::vector<int>& plan, const RoutingLayout& layout) {
  std::vector<int> at(size_t(std::max(layout.sites, 1)), 0);
  int j = 0;
  for (int count : plan) {
    MHAR_CHECK(count >= 1 && j + count <= layout.sites, "routing tile plan: a tile of ", count,
               " sites at site ", j, " of ", layout.sites);
    at[size_t(j)] = count;
    j += count;
  }
  MHAR_CHECK(j == layout.sites, "routing tile plan: its tiles cover ", j, " of ", layout.sites,
             " sites");
  return at;
}

class RoutedScheme final : public ResidualScheme {
 public:
  explicit RoutedScheme(const SchemeContext& ctx)
      : c_(ctx),
        layout_(RoutingLayout::blocks(ctx.cfg.n_sites(), ctx.res.routing_block())),
        H_(ctx.res.heads),
        tile_at_(tile_starts(ctx.be.routing_tile_plan(layout_, ctx.cfg.d_model, H_), layout_)),
        back_tile_(ctx.be.routing_backward_tile_slots(layout_, ctx.cfg.d_model, H_)) {
    MHAR_CHECK(H_ >= 1 && c_.cfg.d_model % H_ == 0, "routing heads ", H_);
  }

  const char* bucket() const override { return "routing"; }
  void add_parameters(const AddParameter& add) override {
    for (int j = 0; j < layout_.sites; ++j) {
      const std::string pre = "model.routing." + std::to_string(j);
      query_.push_back(add(pre + ".query", c_.cfg.d_model, Init::Zero, 0));
      gain_.push_back(add(pre + ".gain", c_.cfg.d_model, Init::One, 0));
    }
  }
  void bind_parameters() override { params_ = bind_routing_params(c_, query_, gain_); }

  void plan(MemoryPlan& P, const Timeline& t, int64_t N, int history,
            std::vector<int>& site_x) override;
  void op_scratch_shapes(OpScratchShapes& shapes) const override {
    shapes.routing = layout_;
    shapes.routing_heads = H_;
    shapes.mix_tile_sites = std::max(1, *std::max_element(tile_at_.begin(), tile_at_.end()));
    shapes.backward_tile_slots = back_tile_;
  }
  void site_forward(int j) override { mix(j, nullptr); }
  bool site_forward_normed(int j, const SiteNorm& norm) override { return mix(j, &norm); }
  void sublayer_done(int j) override {
    // Slot j+1 holds v_{j+1}; inside a block it becomes the block's sum so far.
    if (continues_block(j + 1)) c_.be.add_inplace(c_.act(history_)[j + 1], c_.act(history_)[j]);
  }

  void begin_backward() override { c_.be.zero(c_.act(gsum_)); }
  Tensor site_grad(int j) override { return c_.act(site_dx_[size_t(j)]); }
  void site_backward(int j) override;
  Tensor source_grad(int i) override { return c_.act(source_dx_[size_t(i)]); }
  bool source_grad_held_through_site() const override { return true; }
  bool finish_backward() override {
    c_.be.routing_param_grads(params_, c_.act(gsum_));
    return true;
  }

  int site_sources(int j) const override { return layout_.site_sources(j); }
  std::vector<double> routing_weights(int j) const override;
  void routing_stats(int j, Tensor stats) override {
    MHAR_CHECK(j >= 0 && j < layout_.sites, "routing site ", j);
    c_.be.routing_stats(stats, c_.act(route_w_), layout_, j, H_);
  }

 private:
  // Site j's logits and mix; with `norm`, the consumer's norm in the same call
  // (Backend::routing_mix_rmsnorm, routing_mix_tile_rmsnorm at a tile's first site): true
  // when written.
  bool mix(int j, const SiteNorm* norm);
  // Whether sublayer output v_i (i >= 1) joins the block of v_{i-1}.
  bool continues_block(int i) const { return i >= 2 && (i - 1) % layout_.block != 0; }

  // Slabs of the routing key-gradient scratch (Backend::routing_source_backward): enough
  // token slabs for the CUDA reduction to fill the GPU without atomics.
  static constexpr int kKeyGradSlabs = 64;

  SchemeContext c_;
  RoutingLayout layout_;
  int H_;
  // The depth tiles (backend.h, routing_tile_plan): the count of the tile that starts at
  // site j, 0 where site j is inside one; 1 is a site mixed on its own.
  std::vector<int> tile_at_;
  int back_tile_;  // backward depth tile in slots (routing_backward_tile_slots)
  std::vector<int> query_, gain_;  // parameter indices, per site
  RoutingParams params_;           // their tensors and gradients
  int history_ = -1, inv_rms_ = -1, route_w_ = -1, ubar_ = -1, gsum_ = -1;
  std::vector<int> site_x_, site_dx_, source_dx_;
};

void RoutedScheme::plan(MemoryPlan& P, const Timeline& t, int64_t N, int history,
                        std::vector<int>& site_x) {
  const int S = layout_.sites, last = t.last();
  const int64_t d = c_.cfg.d_model;
  const DType at = c_.be.act_dtype(), st = c_.be.stat_dtype();
  history_ = history;
  site_x_.clear();
  site_dx_.clear();
  source_dx_.clear();
  // Per-pair logits/weights (backend.h), ubar, the key-gradient scratch, one short-lived
  // gradient per slot, and the input gradient of every site: each from the backward of
  // the site's consumer to the end (slot 0's backward, the last, reads them all: the
  // backward is source-stationary). Planned one by one, they take the place of the
  // forward activations the backward frees as it goes, instead of one [S, N, d] buffer
  // alive from the head's backward, when every forward activation still is.
  inv_rms_ = P.add("routing.inv_rms", st, {layout_.sources, N}, 0, last);
  route_w_ = P.add("routing.weights", st, {layout_.pairs(), H_, N}, 0, last);
  for (int j = 0; j < S; ++j) {
    const int consumer = j < 2 * c_.cfg.n_layers ? t.sublayer(j) : t.head();
    site_dx_.push_back(P.add("site." + std::to_string(j) + ".x.grad", at, {N, d},
                             t.back(consumer), last));
  }
  ubar_ = P.add("routing.ubar", st, {S, H_, N}, t.back(t.head()), last);
  gsum_ = P.add("routing.key_grad", c_.be.grad_dtype(), {kKeyGradSlabs, S, d},
                t.back(t.head()), last);
  // Slot i's gradient becomes v_i's, read by the sublayer that wrote v_i (i = 0: the
  // embedding) and, inside a block, by slot i-1's backward right after it; it lives
  // through slot i-1's backward in any case (source_grad_held_through_site).
  for (int i = 0; i < layout_.sources; ++i)
    source_dx_.push_back(P.add("source." + std::to_string(i) + ".grad", at, {N, d},
                               t.back(t.site(i)), i == 0 ? last : t.back(t.site(i - 1))));
  // A site input lives until its slot's backward, which needs x_j for ubar_j.
  for (int j = 0; j < S; ++j)
    site_x_.push_back(P.add("site." + std::to_string(j) + ".x", at, {N, d}, t.site(j),
                            t.back(t.site(j))));
  site_x = site_x_;
}

bool RoutedScheme::mix(int j, const SiteNorm* norm) {
  Tensor hist = c_.act(history_), w = c_.act(route_w_), x = c_.act(site_x_[size_t(j)]);
  c_.be.routing_source_logits(w, c_.act(inv_rms_)[j], hist[j], params_, layout_, j, H_,
                              c_.cfg.rms_eps);
  // A depth tile of the backend's plan starts here: the backend reads the slots <= j once
  // for the tile's sites (backend.h, routing_mix_tile).
  if (tile_at_[size_t(j)] > 1) {
    if (!norm) {
      c_.be.routing_mix_tile(x, w, hist, layout_, j, tile_at_[size_t(j)], H_);
      return false;
    }
    c_.be.routing_mix_tile_rmsnorm(x, norm->y, norm->rstd, w, hist, layout_, j, tile_at_[size_t(j)],
                                   H_, norm->w, norm->eps);
    return true;
  }
  if (!norm) {
    c_.be.routing_mix(x, w, hist, layout_, j, H_);
    return false;
  }
  c_.be.routing_mix_rmsnorm(x, norm->y, norm->rstd, w, hist, layout_, j, H_, norm->w, norm->eps);
  return true;
}

void RoutedScheme::site_backward(int j) {
  // Every site that reads slot j has its input gradient now.
  std::vector<Tensor> dx;
  for (int id : site_dx_) dx.push_back(c_.act(id));
  // Backward depth tiles start where RoutingLayout::back_tile_count says (full routing:
  // slots S-1, S-1-k, ...): the backend streams the site gradients >= j once for the
  // tile's slots (backend.h, routing_source_backward_tile).
  if (const int count = layout_.back_tile_count(j, back_tile_); count > 0)
    c_.be.routing_source_backward_tile(c_.act(source_dx_[size_t(j)]), c_.act(route_w_),
                                       c_.act(ubar_), c_.act(gsum_), dx,
                                       c_.act(site_x_[size_t(j)]), c_.act(history_),
                                       c_.act(inv_rms_), params_, layout_, j, count, H_);
  else
    c_.be.routing_source_backward(c_.act(source_dx_[size_t(j)]), c_.act(route_w_),
                                  c_.act(ubar_), c_.act(gsum_), dx, c_.act(site_x_[size_t(j)]),
                                  c_.act(history_)[j], c_.act(inv_rms_)[j], params_, layout_, j,
                                  H_);
  // v_j is also in slots j+1 .. (end of its block): their gradients, already summed into
  // v_{j+1}'s.
  if (j + 1 < layout_.sources && continues_block(j + 1))
    c_.be.add_inplace(c_.act(source_dx_[size_t(j)]), c_.act(source_dx_[size_t(j + 1)]));
}

std::vector<double> RoutedScheme::routing_weights(int site) const {
  MHAR_CHECK(site >= 0 && site < layout_.sites, "routing site ", site, " of ", layout_.sites);
  const int64_t N = c_.act(route_w_).dim(2);
  const int src = layout_.site_sources(site);
  const Tensor all = c_.act(route_w_);
  std::vector<double> pair(size_t(H_) * size_t(N)), out(size_t(N) * H_ * src);
  for (int t = 0; t < src; ++t) {
    c_.be.download(pair.data(), all[layout_.pair(layout_.site_source(site, t), site)]);
    for (int64_t n = 0; n < N; ++n)
      for (int h = 0; h < H_; ++h) out[(size_t(n) * H_ + h) * src + t] = pair[size_t(h) * N + n];
  }
  return out;
}

}  // namespace

RoutingParams bind_routing_params(const SchemeContext& c, const std::vector<int>& query,
                                  const std::vector<int>& gain) {
  RoutingParams p;
  for (size_t j = 0; j < query.size(); ++j) {
    p.query.push_back(c.params[size_t(query[j])].value);
    p.gain.push_back(c.params[size_t(gain[j])].value);
    p.dquery.push_back(c.params[size_t(query[j])].grad);
    p.dgain.push_back(c.params[size_t(gain[j])].grad);
  }
  return p;
}

std::unique_ptr<ResidualScheme> make_routed_scheme(const SchemeContext& ctx) {
  return std::make_unique<RoutedScheme>(ctx);
}

}  // namespace mhar
