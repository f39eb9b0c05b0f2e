// residual_delta.cpp: the `delta` residual scheme (DESIGN.md section 2), the mode a trained
// `standard` model is converted into (`mhar convert`). Site j's input is the standard
// residual input plus a gated routed term:
//
//   x_j = (v_0 + ... + v_j) + alpha_j * route_j(null, block sums)
//
// with a scalar gate alpha_j per site (init 0), a learned null source n [d] (init 0,
// broadcast over the tokens) and, as the other sources, the block sums of the sublayer
// outputs over blocks of residual.block_layers layers (s = 2 * block_layers sublayers),
// mixed by MHAR routing with residual.heads heads (queries init 0, gains init 1).
// Parameters, in the gradient bucket "delta": model.delta.<j>.alpha [1],
// model.delta.<j>.query [d], model.delta.<j>.gain [d] per site and model.delta.null [d].
//
// The routed term reuses the block routing of residual_routed.cpp unchanged: backend.h's
// RoutingLayout::blocks(S, s) over the model's history, whose slot j (j >= 1) becomes the
// current block's sum up to v_j as site j starts, and whose slot 0 holds the null
// source instead of v_0 (materialised as [N, d] rows when site 0 runs, after v_0 has been
// copied into the running standard stream: the routing ops read a slot as [N, d]).
// The current partial block IS a source (the layout's own choice, kept): it lets a site
// weigh the newest outputs of its block against the closed blocks and the null, and it
// needs no layout and no kernel beyond the ones block routing already has. At init it
// makes no difference: alpha = 0 multiplies the whole routed term.
//
// The conversion identity: with every alpha_j = 0 the gated add computes std_j + 0 * r_j,
// which is std_j exactly in floating point (r_j is finite), and std_j is the running sum
// of the standard scheme, made by the same additions in the same order; so logits and
// losses equal a standard model's bit for bit, and so do the gradients of the shared
// weights (the routed term's backward then only adds zeros).
//
// Backward: dresid = sum_{k >= j} dx_k is the standard part of v_j's gradient (as in
// residual_standard.cpp). Site j's backward also makes dr_j = alpha_j dx_j (the routed
// term's input gradient) and alpha_j's gradient, then runs slot j's source-stationary
// routing backward (as residual_routed.cpp); v_j's gradient is dresid plus the slot
// gradients of the slots that hold v_j (the running block sum); slot 0's gradient summed
// over the tokens is the null's.
//
// Traffic per site (R = one [N, d] act-dtype row read or written: 42 MB at 1B on the GPU;
// standard's is 3R forward and 3R backward per site, one add each). "Continuing": slot
// j+1 continues slot j's block (forward) / slot j+1 exists and continues the block
// (backward): 7 of every 8 sites at block_layers 4. The routing ops (cuda/routing_*.cu) are
// counted apart: logits 1R, mix (sources + 1)R untiled, source backward
// (3 + sites reading the slot)R.
//                          before (unfused)            now (fused)
//   forward  gate          3R                          3R
//            advance       std += v: 3R,               delta_stream_advance: 5R
//                          slot += prev: 3R            (3R when not continuing)
//            total         9R / 6R, 3 / 2 launches     8R / 6R, 2 launches
//   backward dresid, gate  dresid += dx: 3R,           delta_resid_gate_backward: 5R
//                          gate backward: 3R           (+ the one-block dalpha sum)
//            source grad   slot += next: 3R,           delta_source_grad: 5R
//                          out = dresid + slot: 3R     (3R without next)
//            total         12R / 9R, 5 / 4 launches    10R / 8R, 3 launches
// Per block of 8 sites: 162R before, 140R now (standard: 48R); beyond standard 114R ->
// 92R. Every delta kernel now moves 16-byte vectors (before: the gate's forward and
// backward used 2-byte scalar loads). What remains beyond standard is either required by
// the scheme (the running stream and the block sums, written once each; x = std + alpha r
// needs r, which only the mix has) or sits across a routing op.
// The backward of a site whose slot only it reads (the partial block sums: 64 of the 1B
// model's 73 sites) is one op, delta_site_backward (backend.h): the gate backward, the
// slot's routing backward and its gradient gathered. On the GPU it is one pass
// (cuda/routing_backward.cu, DELTA), which reads dx, r, dresid, v and next once and writes dresid,
// dr, the slot and out: 9R where the three ops moved 14R (gate 5R, the slot's backward
// 4R, source grad 5R), plus the key gradients' 1R either way. Measured at 1B (tenth
// session, OpTiming.DISABLED_DeltaRouting1B): 11.2 ms a step against 13.8 ms.
// Forward: site j >= 1 runs as one op, delta_site_forward (backend.h): the stream advance by v_j,
// the slot's logits, the mix and the gate. Where the slot is read by site j alone the GPU runs it
// as one pass (cuda/routing_delta_forward.cu): the stream, v and prev read once, the new slot's
// logits and the mix's own source taken from registers, r and x written together: 7R (5R when the
// slot starts its block) plus the closed slots, where the four ops moved 11R (9R) plus the closed
// slots.
#include "engine/model.h"
#include "engine/residual.h"

namespace mhar {

namespace {

class DeltaScheme final : public ResidualScheme {
 public:
  explicit DeltaScheme(const SchemeContext& ctx)
      : c_(ctx),
        layout_(RoutingLayout::blocks(ctx.cfg.n_sites(), ctx.res.delta_block())),
        H_(ctx.res.heads),
        back_tile_(ctx.be.routing_backward_tile_slots(layout_, ctx.cfg.d_model, H_)) {
    if (!c_.be.has_delta_ops()) delta_unsupported(c_.be.name());
    MHAR_CHECK(H_ >= 1 && c_.cfg.d_model % H_ == 0, "delta routing heads ", H_);
    MHAR_CHECK(c_.res.block_layers >= 1 && c_.res.block_layers <= c_.cfg.n_layers,
               "residual.block_layers ", c_.res.block_layers);
  }

  const char* bucket() const override { return "delta"; }
  void add_parameters(const AddParameter& add) override {
    const int64_t d = c_.cfg.d_model;
    for (int j = 0; j < layout_.sites; ++j) {
      const std::string pre = "model.delta." + std::to_string(j);
      alpha_.push_back(add(pre + ".alpha", 1, Init::Zero, 0));
      query_.push_back(add(pre + ".query", d, Init::Zero, 0));
      gain_.push_back(add(pre + ".gain", d, Init::One, 0));
    }
    null_ = add("model.delta.null", d, Init::Zero, 0);
  }
  void bind_parameters() override { params_ = bind_routing_params(c_, query_, gain_); }

  void plan(MemoryPlan& P, const Timeline& t, int64_t N, int history,
            std::vector<int>& site_x) override;
  // The routing ops of block routing: the mix untiled, the closed slots' backward in
  // depth tiles where the backend wants them (site_backward).
  void op_scratch_shapes(OpScratchShapes& shapes) const override {
    shapes.routing = layout_;
    shapes.routing_heads = H_;
    shapes.backward_tile_slots = back_tile_;
  }
  // Site j >= 1 also advances the stream by v_j (sublayer j-1's output), as its first step
  // (Backend::delta_site_forward), so sublayer_done has nothing to do.
  void site_forward(int j) override;

  void begin_backward() override {
    c_.be.zero(c_.act(dresid_));
    c_.be.zero(c_.act(gsum_));
  }
  Tensor site_grad(int j) override { return c_.act(site_dx_[size_t(j)]); }
  void site_backward(int j) override;
  Tensor source_grad(int i) override {
    return i == 0 ? c_.act(dresid_) : c_.act(source_dx_[size_t(i)]);
  }
  // source_grad(j+1) for j >= 0 is v_{j+1}'s own buffer (dresid is source_grad(0) only).
  bool source_grad_held_through_site() const override { return true; }
  bool finish_backward() override {
    c_.be.routing_param_grads(params_, c_.act(gsum_));
    return true;  // the gates and the null were done at their sites' backward
  }

 private:
  bool continues_block(int i) const { return i >= 2 && (i - 1) % layout_.block != 0; }
  Tensor p(int id) const { return c_.params[size_t(id)].value; }
  Tensor g(int id) const { return c_.params[size_t(id)].grad; }

  static constexpr int kKeyGradSlabs = 64;  // as residual_routed.cpp
  static constexpr int kScratchRows = 64;   // the gate and null reductions' partial sums

  SchemeContext c_;
  RoutingLayout layout_;
  int H_;
  int back_tile_;  // backward depth tile in slots (routing_backward_tile_slots)
  std::vector<int> alpha_, query_, gain_;  // parameter indices, per site
  int null_ = -1;
  RoutingParams params_;
  // Plan ids.
  int history_ = -1, std_ = -1, dresid_ = -1, inv_rms_ = -1, route_w_ = -1, ubar_ = -1,
      gsum_ = -1, scratch_ = -1;
  std::vector<int> site_x_, site_dx_, route_x_, route_dx_, slot_dx_, source_dx_;
};

void DeltaScheme::plan(MemoryPlan& P, const Timeline& t, int64_t N, int history,
                       std::vector<int>& site_x) {
  const int S = layout_.sites, L2 = 2 * c_.cfg.n_layers, last = t.last();
  const int64_t d = c_.cfg.d_model;
  const DType at = c_.be.act_dtype(), st = c_.be.stat_dtype(), gt = c_.be.grad_dtype();
  history_ = history;
  for (auto* v : {&site_x_, &site_dx_, &route_x_, &route_dx_, &slot_dx_, &source_dx_}) v->clear();
  // The running standard stream std_j, advanced as each sublayer finishes.
  std_ = P.add("delta.stream", at, {N, d}, t.site(0), t.site(L2));
  dresid_ = P.add("delta.stream.grad", at, {N, d}, t.back(t.head()), last);
  inv_rms_ = P.add("delta.inv_rms", st, {layout_.sources, N}, 0, last);
  route_w_ = P.add("delta.weights", st, {layout_.pairs(), H_, N}, 0, last);
  ubar_ = P.add("delta.ubar", st, {S, H_, N}, t.back(t.head()), last);
  gsum_ = P.add("delta.key_grad", gt, {kKeyGradSlabs, S, d}, t.back(t.head()), last);
  scratch_ = P.add("delta.scratch", gt, {kScratchRows, d}, t.back(t.head()), last);
  for (int j = 0; j < S; ++j) {
    const std::string name = "site." + std::to_string(j);
    const int consumer = j < L2 ? t.sublayer(j) : t.head();
    site_x_.push_back(P.add(name + ".x", at, {N, d}, t.site(j), t.back(consumer)));
    site_dx_.push_back(P.add(name + ".x.grad", at, {N, d}, t.back(consumer), t.back(t.site(j))));
    // The routed term r_j: slot j's backward reads it (ubar_j).
    route_x_.push_back(P.add(name + ".route", at, {N, d}, t.site(j), t.back(t.site(j))));
    // dr_j: read by the backward of every slot site j reads, slot 0's the last.
    route_dx_.push_back(P.add(name + ".route.grad", at, {N, d}, t.back(t.site(j)), last));
  }
  for (int i = 0; i < layout_.sources; ++i) {
    const std::string name = "source." + std::to_string(i);
    // Slot i's routing gradient; inside a block slot i-1's backward adds it to its own.
    slot_dx_.push_back(P.add(name + ".slot.grad", at, {N, d}, t.back(t.site(i)),
                             continues_block(i) ? t.back(t.site(i - 1)) : t.back(t.site(i))));
    // v_i's whole gradient (i >= 1; v_0's is dresid), read by the sublayer that wrote it;
    // it lives through site i-1's backward (source_grad_held_through_site).
    source_dx_.push_back(
        i == 0 ? -1 : P.add(name + ".grad", at, {N, d}, t.back(t.site(i)), t.back(t.site(i - 1))));
  }
  site_x = site_x_;
}

void DeltaScheme::site_forward(int j) {
  Tensor hist = c_.act(history_), w = c_.act(route_w_), r = c_.act(route_x_[size_t(j)]);
  if (j >= 1) {
    // v_j joins the standard stream first, then its slot becomes the block's sum; then the
    // slot's logits, the mix and the gate: one op (one pass where the slot is read by
    // site j alone, backend.h).
    DeltaSiteForward a;
    a.stream = c_.act(std_), a.history = hist, a.x = c_.act(site_x_[size_t(j)]), a.r = r;
    a.alpha = p(alpha_[size_t(j)]), a.weights = w, a.inv_rms = c_.act(inv_rms_)[j];
    a.params = &params_, a.layout = layout_, a.site = j, a.heads = H_;
    a.continues = continues_block(j), a.eps = c_.cfg.rms_eps;
    c_.be.delta_site_forward(a);
    return;
  }
  // v_0 starts the standard stream; its slot then holds the null source.
  c_.be.copy(c_.act(std_), hist[0]);
  c_.be.delta_null_forward(hist[0], p(null_));
  c_.be.routing_source_logits(w, c_.act(inv_rms_)[0], hist[0], params_, layout_, 0, H_,
                              c_.cfg.rms_eps);
  c_.be.routing_mix(r, w, hist, layout_, 0, H_);
  c_.be.delta_gate(c_.act(site_x_[0]), c_.act(std_), p(alpha_[0]), r);
}

void DeltaScheme::site_backward(int j) {
  Tensor dx = site_grad(j), dresid = c_.act(dresid_), scratch = c_.act(scratch_);
  Tensor r = c_.act(route_x_[size_t(j)]), slot = c_.act(slot_dx_[size_t(j)]);
  std::vector<Tensor> dr;
  for (int id : route_dx_) dr.push_back(c_.act(id));
  // Slot j's gradient gathers the later slots of its block (slot j+1's, already gathered).
  const Tensor next = j + 1 < layout_.sources && continues_block(j + 1)
                          ? c_.act(slot_dx_[size_t(j + 1)])
                          : Tensor();
  if (j >= 1 && layout_.last_site(j) == j) {
    // Slot j is read by site j alone (a partial block sum): the steps below as one op,
    // which the CUDA backend runs as one pass over the rows (backend.h).
    DeltaSiteBackward a;
    a.dresid = dresid, a.dr = dr[size_t(j)], a.dalpha = g(alpha_[size_t(j)]), a.dx = dx, a.r = r;
    a.alpha = p(alpha_[size_t(j)]), a.scratch = scratch;
    a.slot = slot, a.weights = c_.act(route_w_), a.ubar = c_.act(ubar_), a.gsum = c_.act(gsum_);
    a.v = c_.act(history_)[j], a.inv_rms = c_.act(inv_rms_)[j];
    a.site_dx = &dr, a.params = &params_, a.layout = layout_, a.site = j, a.heads = H_;
    a.out = c_.act(source_dx_[size_t(j)]), a.next = next;
    c_.be.delta_site_backward(a);
    return;
  }
  c_.be.delta_resid_gate_backward(dresid, dr[size_t(j)], g(alpha_[size_t(j)]), dx, r,
                                  p(alpha_[size_t(j)]), scratch);
  // A closed slot: where a backward depth tile starts (RoutingLayout::back_tile_count:
  // with tiles of 2, (8, 0), (24, 16), ... at block 8), the backend streams the site
  // gradients >= j once for it and the older closed slot j - block, whose own call,
  // 8 sites later, then reads only its sites before j.
  if (const int count = layout_.back_tile_count(j, back_tile_); count > 0)
    c_.be.routing_source_backward_tile(slot, c_.act(route_w_), c_.act(ubar_), c_.act(gsum_), dr,
                                       r, c_.act(history_), c_.act(inv_rms_), params_, layout_,
                                       j, count, H_);
  else
    c_.be.routing_source_backward(slot, c_.act(route_w_), c_.act(ubar_), c_.act(gsum_), dr, r,
                                  c_.act(history_)[j], c_.act(inv_rms_)[j], params_, layout_, j,
                                  H_);
  if (j == 0) {
    MHAR_CHECK(next.empty(), "slot 1 starts a block");  // slot 0 is the null, alone
    c_.be.delta_null_backward(g(null_), slot, scratch);
  } else {
    c_.be.delta_source_grad(c_.act(source_dx_[size_t(j)]), dresid, slot, next);
  }
}

}  // namespace

std::unique_ptr<ResidualScheme> make_delta_scheme(const SchemeContext& ctx) {
  return std::make_unique<DeltaScheme>(ctx);
}

}  // namespace mhar
