// op_profile.cpp: the op profiler (see op_profile.h).
#include "engine/op_profile.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <sstream>
#include <utility>

namespace mhar {

const char* op_family_name(OpFamily f) {
  switch (f) {
    case OpFamily::Matmul: return "matmul";
    case OpFamily::AttentionForward: return "attention forward";
    case OpFamily::AttentionBackward: return "attention backward";
    case OpFamily::Norms: return "RMSNorm";
    case OpFamily::Rope: return "RoPE";
    case OpFamily::Swiglu: return "SwiGLU";
    case OpFamily::Elementwise: return "residual adds";
    case OpFamily::Embedding: return "embedding";
    case OpFamily::Routing: return "routing";
    case OpFamily::Classifier: return "classifier (cross-entropy)";
    case OpFamily::Optimizer: return "optimizer (norm, AdamW)";
    case OpFamily::Memory: return "zero / copy";
    case OpFamily::kCount: break;
  }
  return "?";
}

bool op_family_counts_flops(OpFamily f) {
  return f == OpFamily::Matmul || f == OpFamily::AttentionForward || f == OpFamily::AttentionBackward;
}

namespace {

double bytes_of(std::initializer_list<Tensor> ts) {
  double b = 0;
  for (const Tensor& t : ts) b += double(t.bytes());
  return b;
}

// 2 M N K for C [M, N] = A [M, K] B [K, N] in any transposition: K^2 = |A| |B| / |C|.
double matmul_flops(const Tensor& c, const Tensor& a, const Tensor& b) {
  const double mn = double(c.numel());
  if (mn == 0) return 0;
  return 2 * mn * std::sqrt(double(a.numel()) * double(b.numel()) / mn);
}

// Causal attention forward, q [B, T, Hq, hd]: QK^T and PV, 2 FLOPs per multiply-add,
// half of the T x T scores.
double attention_forward_flops(const Tensor& q) {
  const double B = double(q.dim(0)), T = double(q.dim(1)), H = double(q.dim(2)), hd = double(q.dim(3));
  return 4 * B * H * T * T * hd / 2;
}

// One adamw call's bytes: it reads grad, m, v and the master (or the parameter) and
// writes m, v, the master and the parameter.
double adamw_bytes(const Tensor& param, const Tensor& master, const Tensor& grad,
                   const Tensor& m, const Tensor& v) {
  return bytes_of({grad, m, v, master, m, v, master, param}) +
         (master.data ? 0 : bytes_of({param}));
}

}  // namespace

OpProfiler::Span::Span(OpProfiler& p, const char* op, OpFamily f, double work, int product)
    : p_(p), f_(f), work_(work), product_(product) {
  if (!p_.armed_) return;
  op_ = p_.part_index(p_.ops_, f, op);
  mark_ = p_.in_.timing_mark();
  if (mark_ < 0) t0_ = std::chrono::steady_clock::now();
}

OpProfiler::Span::~Span() {
  if (!p_.armed_) return;
  if (mark_ >= 0) {
    p_.pending_.push_back({f_, mark_, p_.in_.timing_mark(), 0, work_, product_, op_});
  } else {
    const double ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0_).count();
    p_.pending_.push_back({f_, -1, -1, ms, work_, product_, op_});
  }
}

void OpProfiler::begin_step() {
  pending_.clear();
  in_.timing_reset();
  armed_ = true;
}

void OpProfiler::finish_step(double wall_ms) {
  armed_ = false;
  in_.synchronize();
  for (const Pending& p : pending_) {
    const double ms = p.a >= 0 ? in_.timing_ms(p.a, p.b) : p.host_ms;
    for (OpFamilyTotals* t : {&totals_[size_t(p.family)], &ops_[size_t(p.op)].totals,
                              p.product >= 0 ? &products_[size_t(p.product)].totals : nullptr}) {
      if (!t) continue;
      t->ms += ms;
      t->work += p.work;
      ++t->calls;
    }
  }
  pending_.clear();
  in_.timing_reset();
  wall_ms_ += wall_ms;
  ++steps_;
}

nlohmann::json OpProfiler::report(double peak_tflops, double peak_tbps) const {
  const double n = std::max(1, steps_), wall = wall_ms_ / n;
  // A row's rate (TFLOP/s or TB/s) and its share of the roofline, per step.
  auto add_rate = [&](nlohmann::json& row, OpFamily f, const OpFamilyTotals& t) {
    const double ms = t.ms / n;
    if (ms <= 0) return;
    const double rate = t.work / n / (ms * 1e-3) / 1e12;
    row[op_family_counts_flops(f) ? "tflops" : "tbps"] = rate;
    row["roofline_share"] = rate / (op_family_counts_flops(f) ? peak_tflops : peak_tbps);
  };
  nlohmann::json families = nlohmann::json::array();
  double ops_ms = 0;
  for (size_t i = 0; i < totals_.size(); ++i) {
    const OpFamilyTotals& t = totals_[i];
    if (t.calls == 0) continue;
    const auto f = OpFamily(i);
    const double ms = t.ms / n;
    ops_ms += ms;
    nlohmann::json row = {{"family", op_family_name(f)}, {"ms", ms}, {"share", wall > 0 ? ms / wall : 0},
                          {"calls", double(t.calls) / n}};
    add_rate(row, f, t);
    families.push_back(row);
  }
  // The splits, slowest first; `key` names a row's label ("op" or "product").
  auto split = [&](const std::vector<Part>& parts, const char* key, bool with_family) {
    std::vector<const Part*> by_time;
    for (const Part& p : parts)
      if (p.totals.calls > 0) by_time.push_back(&p);
    std::stable_sort(by_time.begin(), by_time.end(),
                     [](const Part* x, const Part* y) { return x->totals.ms > y->totals.ms; });
    nlohmann::json rows = nlohmann::json::array();
    for (const Part* p : by_time) {
      nlohmann::json row = {{key, p->label}, {"ms", p->totals.ms / n}, {"calls", double(p->totals.calls) / n}};
      if (with_family) row["family"] = op_family_name(p->family);
      add_rate(row, p->family, p->totals);
      rows.push_back(row);
    }
    return rows;
  };
  return {{"steps", steps_}, {"wall_ms", wall}, {"families", families}, {"other_ms", wall - ops_ms},
          {"other_share", wall > 0 ? (wall - ops_ms) / wall : 0}, {"peak_tflops", peak_tflops},
          {"peak_tbps", peak_tbps}, {"ops", split(ops_, "op", true)},
          {"matmul_products", split(products_, "product", false)}};
}

namespace {
// A report row's "achieved" and "of peak" columns ("-" where it has no time).
std::pair<std::string, std::string> rate_columns(const nlohmann::json& row) {
  std::pair<std::string, std::string> cols{"-", "-"};
  char b[64];
  if (row.contains("tflops")) {
    std::snprintf(b, sizeof b, "%.1f TFLOP/s", row["tflops"].get<double>());
    cols.first = b;
  } else if (row.contains("tbps")) {
    std::snprintf(b, sizeof b, "%.2f TB/s", row["tbps"].get<double>());
    cols.first = b;
  }
  if (row.contains("roofline_share")) {
    std::snprintf(b, sizeof b, "%.0f%%", 100 * row["roofline_share"].get<double>());
    cols.second = b;
  }
  return cols;
}
}  // namespace

std::string OpProfiler::table(double peak_tflops, double peak_tbps) const {
  const nlohmann::json r = report(peak_tflops, peak_tbps);
  std::ostringstream o;
  char line[200];
  std::snprintf(line, sizeof line, "%-28s %10s %7s %7s %16s %9s\n", "op family", "ms/step", "share", "calls",
                "achieved", "of peak");
  o << line;
  for (const auto& f : r["families"]) {
    const auto [rate, of_peak] = rate_columns(f);
    std::snprintf(line, sizeof line, "%-28s %10.2f %6.1f%% %7.0f %16s %9s\n", f["family"].get<std::string>().c_str(),
                  f["ms"].get<double>(), 100 * f["share"].get<double>(), f["calls"].get<double>(), rate.c_str(),
                  of_peak.c_str());
    o << line;
  }
  std::snprintf(line, sizeof line, "%-28s %10.2f %6.1f%%\n%-28s %10.2f\n", "other / idle", r["other_ms"].get<double>(),
                100 * r["other_share"].get<double>(), "step (profiled)", r["wall_ms"].get<double>());
  o << line;
  if (!r["ops"].empty()) {
    std::snprintf(line, sizeof line, "\n%-28s %-28s %10s %7s %16s %9s\n", "by op: family", "op", "ms/step",
                  "calls", "achieved", "of peak");
    o << line;
    for (const auto& op : r["ops"]) {
      if (op["family"] == op_family_name(OpFamily::Matmul)) continue;  // by product, below
      const auto [rate, of_peak] = rate_columns(op);
      std::snprintf(line, sizeof line, "%-28s %-28s %10.2f %7.0f %16s %9s\n",
                    op["family"].get<std::string>().c_str(), op["op"].get<std::string>().c_str(),
                    op["ms"].get<double>(), op["calls"].get<double>(), rate.c_str(), of_peak.c_str());
      o << line;
    }
  }
  if (!r["matmul_products"].empty()) {
    std::snprintf(line, sizeof line, "\n%-44s %10s %7s %16s\n", "matmul by product", "ms/step", "calls",
                  "achieved");
    o << line;
    for (const auto& p : r["matmul_products"]) {
      std::snprintf(line, sizeof line, "%-44s %10.2f %7.0f %11.1f TFLOP/s\n",
                    p["product"].get<std::string>().c_str(), p["ms"].get<double>(),
                    p["calls"].get<double>(), p.value("tflops", 0.0));
      o << line;
    }
  }
  return o.str();
}

// ---- the ops: each one timed, with its work.

void OpProfiler::embedding_forward(Tensor out, Tensor tokens, Tensor table) {
  Span s(*this, __func__, OpFamily::Embedding, 2 * bytes_of({out}) + bytes_of({tokens}));  // rows read, rows written
  in_.embedding_forward(out, tokens, table);
}
void OpProfiler::embedding_backward(Tensor dtable, Tensor dout, Tensor tokens) {
  Span s(*this, __func__, OpFamily::Embedding, bytes_of({dout, tokens}) + 2.0 * double(dout.numel()) * dtype_size(dtable.dtype));
  in_.embedding_backward(dtable, dout, tokens);
}
void OpProfiler::rmsnorm_forward(Tensor y, Tensor rstd, Tensor x, Tensor w, double eps) {
  Span s(*this, __func__, OpFamily::Norms, bytes_of({y, rstd, x, w}));
  in_.rmsnorm_forward(y, rstd, x, w, eps);
}
void OpProfiler::rmsnorm_backward(Tensor dx, Tensor dw, Tensor dy, Tensor x, Tensor w, Tensor rstd, bool acc) {
  Span s(*this, __func__, OpFamily::Norms, bytes_of({dx, dw, dy, x, w, rstd}) + (acc ? bytes_of({dx}) : 0));
  in_.rmsnorm_backward(dx, dw, dy, x, w, rstd, acc);
}
void OpProfiler::add_rmsnorm_forward(Tensor x, Tensor y, Tensor rstd, Tensor a, Tensor b, Tensor w,
                                     double eps) {
  Span s(*this, __func__, OpFamily::Norms, bytes_of({x, y, rstd, a, b, w}));
  in_.add_rmsnorm_forward(x, y, rstd, a, b, w, eps);
}
int OpProfiler::part_index(std::vector<Part>& parts, OpFamily f, const std::string& label) {
  for (size_t i = 0; i < parts.size(); ++i)
    if (parts[i].family == f && parts[i].label == label) return int(i);
  parts.push_back({f, label, {}});
  return int(parts.size()) - 1;
}

void OpProfiler::matmul(Tensor c, Tensor a, Tensor b, bool ta, bool tb, bool acc) {
  int product = -1;
  if (armed_) {
    // Stored shapes, ^T where the operand enters transposed.
    char label[112];
    std::snprintf(label, sizeof label, "C[%lld,%lld] %s A[%lld,%lld]%s B[%lld,%lld]%s",
                  static_cast<long long>(c.dim(0)), static_cast<long long>(c.dim(1)),
                  acc ? "+=" : "=", static_cast<long long>(a.dim(0)),
                  static_cast<long long>(a.dim(1)), ta ? "^T" : "",
                  static_cast<long long>(b.dim(0)), static_cast<long long>(b.dim(1)),
                  tb ? "^T" : "");
    product = part_index(products_, OpFamily::Matmul, label);
  }
  Span s(*this, __func__, OpFamily::Matmul, matmul_flops(c, a, b), product);
  in_.matmul(c, a, b, ta, tb, acc);
}
void OpProfiler::rope(Tensor x, double theta, bool backward) {
  Span s(*this, __func__, OpFamily::Rope, 2 * bytes_of({x}));
  in_.rope(x, theta, backward);
}
void OpProfiler::qk_norm_rope_forward(Tensor y, Tensor rstd, Tensor x, Tensor w, double eps,
                                      double theta, int64_t first_position) {
  Span s(*this, __func__, OpFamily::Rope, bytes_of({y, rstd, x, w}));
  in_.qk_norm_rope_forward(y, rstd, x, w, eps, theta, first_position);
}
void OpProfiler::qk_norm_rope_backward(Tensor dx, Tensor dw, Tensor dy, Tensor x, Tensor w,
                                       Tensor rstd, double theta, bool acc) {
  Span s(*this, __func__, OpFamily::Rope, bytes_of({dx, dw, dy, x, w, rstd}) + (acc ? bytes_of({dx}) : 0));
  in_.qk_norm_rope_backward(dx, dw, dy, x, w, rstd, theta, acc);
}
void OpProfiler::qk_norm_rope_forward_qk(const QkNormRopeOperands& q, const QkNormRopeOperands& k,
                                         double eps, double theta, int64_t first_position) {
  Span s(*this, __func__, OpFamily::Rope,
         bytes_of({q.y, q.rstd, q.x, q.w}) + bytes_of({k.y, k.rstd, k.x, k.w}));
  in_.qk_norm_rope_forward_qk(q, k, eps, theta, first_position);
}
void OpProfiler::qk_norm_rope_backward_qk(const QkNormRopeGradOperands& q,
                                          const QkNormRopeGradOperands& k, double theta,
                                          bool acc) {
  const double dx_reads = acc ? bytes_of({q.dx}) + bytes_of({k.dx}) : 0;
  Span s(*this, __func__, OpFamily::Rope,
         bytes_of({q.dx, q.dw, q.dy, q.x, q.w, q.rstd}) +
             bytes_of({k.dx, k.dw, k.dy, k.x, k.w, k.rstd}) + dx_reads);
  in_.qk_norm_rope_backward_qk(q, k, theta, acc);
}
void OpProfiler::attention_forward(Tensor out, Tensor lse, Tensor q, Tensor k, Tensor v) {
  Span s(*this, __func__, OpFamily::AttentionForward, attention_forward_flops(q));
  in_.attention_forward(out, lse, q, k, v);
}
void OpProfiler::attention_backward(Tensor dq, Tensor dk, Tensor dv, Tensor dout, Tensor q, Tensor k, Tensor v,
                                    Tensor out, Tensor lse) {
  Span s(*this, __func__, OpFamily::AttentionBackward, 2.5 * attention_forward_flops(q));
  in_.attention_backward(dq, dk, dv, dout, q, k, v, out, lse);
}
void OpProfiler::swiglu_forward(Tensor h, Tensor gate_up) {
  Span s(*this, __func__, OpFamily::Swiglu, bytes_of({h, gate_up}));
  in_.swiglu_forward(h, gate_up);
}
void OpProfiler::swiglu_backward(Tensor d_gate_up, Tensor h, Tensor dh, Tensor gate_up) {
  Span s(*this, __func__, OpFamily::Swiglu, bytes_of({d_gate_up, h, dh, gate_up}));
  in_.swiglu_backward(d_gate_up, h, dh, gate_up);
}
void OpProfiler::add(Tensor out, Tensor a, Tensor b) {
  Span s(*this, __func__, OpFamily::Elementwise, bytes_of({out, a, b}));
  in_.add(out, a, b);
}
void OpProfiler::add_inplace(Tensor y, Tensor x) {
  Span s(*this, __func__, OpFamily::Elementwise, bytes_of({y, y, x}));
  in_.add_inplace(y, x);
}
void OpProfiler::cross_entropy(Tensor losses, Tensor logits, Tensor targets, double grad_scale, bool compute_grad) {
  Span s(*this, __func__, OpFamily::Classifier,
         bytes_of({losses, logits, targets}) + (compute_grad ? bytes_of({logits}) : 0));
  in_.cross_entropy(losses, logits, targets, grad_scale, compute_grad);
}
void OpProfiler::routing_source_logits(Tensor weights, Tensor inv_rms, Tensor v, const RoutingParams& params,
                                       const RoutingLayout& layout, int source, int heads, double eps) {
  // One read of the slot's row; one logit per later site that reads it, per head and token.
  const int sites = layout.last_site(source) - source + 1;
  const double logits = double(sites) * heads * double(inv_rms.numel()) * dtype_size(weights.dtype);
  Span s(*this, __func__, OpFamily::Routing, bytes_of({v, inv_rms}) + logits);
  in_.routing_source_logits(weights, inv_rms, v, params, layout, source, heads, eps);
}
double OpProfiler::mix_bytes(Tensor x, Tensor weights, const RoutingLayout& layout, int site,
                             int heads) {
  // Each of the site's sources read once, the mix written once, the weights read and
  // written back (softmax in place).
  // Inside a depth tile: the site's fp32 partial (two rows' bytes) and the slots after
  // the tile's first site instead of the older ones.
  const int src = layout.site_sources(site);
  const double row = double(x.bytes());
  const double w = 2.0 * src * heads * double(x.dim(0)) * dtype_size(weights.dtype);
  const bool tiled = site > tile_first_ && site < tile_end_;
  const double rows = tiled ? 2.0 + (site - tile_first_) + 1 : src + 1.0;
  if (site + 1 >= tile_end_) tile_first_ = tile_end_ = -1;
  return rows * row + w;
}
void OpProfiler::routing_mix(Tensor x, Tensor weights, Tensor history, const RoutingLayout& layout,
                             int site, int heads) {
  Span s(*this, __func__, OpFamily::Routing, mix_bytes(x, weights, layout, site, heads));
  in_.routing_mix(x, weights, history, layout, site, heads);
}
void OpProfiler::routing_mix_rmsnorm(Tensor x, Tensor y, Tensor rstd, Tensor weights,
                                     Tensor history, const RoutingLayout& layout, int site,
                                     int heads, Tensor norm_w, double eps) {
  // The mix's bytes plus the norm's outputs: the bytes a fused pass must move (the two
  // ops would also read x back). Counted as routing, the norm's time with it: inside the
  // pass where the backend fuses it, else its own launch inside this call (the CPU; on
  // CUDA, at some sites at the lab's MixNorm versions 1-3), which the profile cannot split.
  Span s(*this, __func__, OpFamily::Routing,
         mix_bytes(x, weights, layout, site, heads) + bytes_of({y, rstd, norm_w}));
  in_.routing_mix_rmsnorm(x, y, rstd, weights, history, layout, site, heads, norm_w, eps);
}
double OpProfiler::begin_tile_bytes(Tensor x, Tensor weights, const RoutingLayout& layout, int site,
                                    int count, int heads) {
  // The first site's mix (its sources read once) plus the fp32 partial sums (two rows'
  // bytes each) of the tile's count - 1 later sites over the same sources.
  const int src = layout.site_sources(site);
  const double row = double(x.bytes());
  const double w = 2.0 * src * heads * double(x.dim(0)) * dtype_size(weights.dtype) * count;
  tile_first_ = site;
  tile_end_ = site + count;
  return (src + 1 + 2.0 * (count - 1)) * row + w;
}
void OpProfiler::routing_mix_tile(Tensor x, Tensor weights, Tensor history,
                                  const RoutingLayout& layout, int site, int count, int heads) {
  Span s(*this, __func__, OpFamily::Routing,
         begin_tile_bytes(x, weights, layout, site, count, heads));
  in_.routing_mix_tile(x, weights, history, layout, site, count, heads);
}
void OpProfiler::routing_mix_tile_rmsnorm(Tensor x, Tensor y, Tensor rstd, Tensor weights,
                                          Tensor history, const RoutingLayout& layout, int site,
                                          int count, int heads, Tensor norm_w, double eps) {
  // routing_mix_tile's bytes plus the norm's outputs (as routing_mix_rmsnorm counts them).
  Span s(*this, __func__, OpFamily::Routing,
         begin_tile_bytes(x, weights, layout, site, count, heads) + bytes_of({y, rstd, norm_w}));
  in_.routing_mix_tile_rmsnorm(x, y, rstd, weights, history, layout, site, count, heads, norm_w,
                               eps);
}
void OpProfiler::routing_source_backward(Tensor dv, Tensor weights, Tensor ubar, Tensor gsum,
                                         const std::vector<Tensor>& site_dx, Tensor x, Tensor v, Tensor inv_rms,
                                         const RoutingParams& params, const RoutingLayout& layout, int source,
                                         int heads) {
  // The slot's row and gradient, and each later site's input gradient that reads it.
  // Inside a backward depth tile: its fp32 partial gradient (two rows' bytes) and the
  // sites before the tile's first slot instead of the later ones. (A backend that
  // declines a tile, as the CUDA one does for slots read by <= 8 sites, moves a few rows
  // more than this counts.)
  const bool tiled = source < back_first_ && source > back_end_ &&
                     (back_first_ - source) % layout.block == 0;
  const int sites = tiled ? back_first_ - source : layout.last_site(source) - source + 1;
  if (source <= back_end_ + layout.block) back_first_ = back_end_ = -1;
  Span s(*this, __func__, OpFamily::Routing, bytes_of({dv, v, x, inv_rms}) +
                                       (sites + (tiled ? 2.0 : 0.0)) * double(dv.bytes()));
  in_.routing_source_backward(dv, weights, ubar, gsum, site_dx, x, v, inv_rms, params, layout, source, heads);
}
void OpProfiler::routing_source_backward_tile(Tensor dv, Tensor weights, Tensor ubar, Tensor gsum,
                                              const std::vector<Tensor>& site_dx, Tensor x,
                                              Tensor history, Tensor inv_rms,
                                              const RoutingParams& params,
                                              const RoutingLayout& layout, int source, int count,
                                              int heads) {
  // The first slot's bytes, plus the rows of the count - 1 older slots and their fp32
  // partial gradients (two rows' bytes each), written for their later calls.
  const int sites = layout.last_site(source) - source + 1;
  const double row = double(dv.bytes());
  back_first_ = source;
  back_end_ = source - count * layout.block;
  Span s(*this, __func__, OpFamily::Routing,
         bytes_of({dv, x, inv_rms[source]}) + row + (sites + 3.0 * (count - 1)) * row);
  in_.routing_source_backward_tile(dv, weights, ubar, gsum, site_dx, x, history, inv_rms, params,
                                   layout, source, count, heads);
}
void OpProfiler::routing_param_grads(const RoutingParams& params, Tensor gsum) {
  Span s(*this, __func__, OpFamily::Routing, bytes_of({gsum}));
  in_.routing_param_grads(params, gsum);
}
void OpProfiler::hyper_mix(Tensor x, Tensor H, Tensor coef) {
  Span s(*this, __func__, OpFamily::Elementwise, bytes_of({x, H}));
  in_.hyper_mix(x, H, coef);
}
void OpProfiler::hyper_mix_backward(Tensor dH, Tensor dcoef, Tensor dx, Tensor H, Tensor coef,
                                    bool accumulate) {
  // dx read, dH written (and read when accumulating), H read for the coefficient sums.
  Span s(*this, __func__, OpFamily::Elementwise, bytes_of({dx, dH}) + (H.empty() ? 0 : bytes_of({H})) +
                                           (accumulate ? bytes_of({dH}) : 0));
  in_.hyper_mix_backward(dH, dcoef, dx, H, coef, accumulate);
}
void OpProfiler::hyper_update(Tensor out, Tensor in, Tensor v, Tensor Ar, Tensor B) {
  Span s(*this, __func__, OpFamily::Elementwise, bytes_of({out, in, v}));
  in_.hyper_update(out, in, v, Ar, B);
}
void OpProfiler::hyper_update_backward(Tensor din, Tensor dv, Tensor dAr, Tensor dB, Tensor dout,
                                       Tensor in, Tensor v, Tensor Ar, Tensor B) {
  Span s(*this, __func__, OpFamily::Elementwise, bytes_of({din, dv, dout, in, v}));
  in_.hyper_update_backward(din, dv, dAr, dB, dout, in, v, Ar, B);
}
void OpProfiler::delta_gate(Tensor x, Tensor base, Tensor alpha, Tensor r) {
  Span s(*this, __func__, OpFamily::Elementwise, bytes_of({x, base, r}));
  in_.delta_gate(x, base, alpha, r);
}
void OpProfiler::delta_gate_backward(Tensor dr, Tensor dalpha, Tensor dx, Tensor r, Tensor alpha,
                                     Tensor scratch) {
  Span s(*this, __func__, OpFamily::Elementwise, bytes_of({dr, dx, r}));
  in_.delta_gate_backward(dr, dalpha, dx, r, alpha, scratch);
}
void OpProfiler::delta_null_forward(Tensor out, Tensor row) {
  Span s(*this, __func__, OpFamily::Elementwise, bytes_of({out}));
  in_.delta_null_forward(out, row);
}
void OpProfiler::delta_null_backward(Tensor drow, Tensor dout, Tensor scratch) {
  Span s(*this, __func__, OpFamily::Elementwise, bytes_of({dout}));
  in_.delta_null_backward(drow, dout, scratch);
}
void OpProfiler::delta_stream_advance(Tensor stream, Tensor slot, Tensor prev) {
  // stream read and written, slot read (and written back and prev read when prev is given).
  Span s(*this, __func__, OpFamily::Elementwise,
         2 * bytes_of({stream}) + bytes_of({slot}) + (prev.empty() ? 0 : bytes_of({slot, prev})));
  in_.delta_stream_advance(stream, slot, prev);
}
void OpProfiler::delta_resid_gate_backward(Tensor dresid, Tensor dr, Tensor dalpha, Tensor dx,
                                           Tensor r, Tensor alpha, Tensor scratch) {
  Span s(*this, __func__, OpFamily::Elementwise, 2 * bytes_of({dresid}) + bytes_of({dr, dx, r}));
  in_.delta_resid_gate_backward(dresid, dr, dalpha, dx, r, alpha, scratch);
}
void OpProfiler::delta_source_grad(Tensor out, Tensor dresid, Tensor slot, Tensor next) {
  // slot read (and written back when next is given), next and dresid read, out written.
  Span s(*this, __func__, OpFamily::Elementwise,
         bytes_of({out, dresid, slot}) + (next.empty() ? 0 : bytes_of({slot, next})));
  in_.delta_source_grad(out, dresid, slot, next);
}
void OpProfiler::delta_site_forward(const DeltaSiteForward& a) {
  // As fused (one pass): read the stream, v and (continuing) the block's previous slot,
  // and the site's other sources; written: the stream, the slot (continuing), r and x; the
  // slot's logits written, the site's logits read and written back as weights.
  const Tensor slot = a.history[a.site];
  const int src = a.layout.site_sources(a.site);
  const double row = double(slot.bytes());
  const double heads_rows =
      (1.0 + 2.0 * src) * a.heads * double(a.inv_rms.numel()) * dtype_size(a.weights.dtype);
  Span s(*this, __func__, OpFamily::Routing,
         (2 + 1 + (a.continues ? 2 : 0) + (src - 1) + 2) * row + heads_rows);
  in_.delta_site_forward(a);
}
void OpProfiler::delta_site_backward(const DeltaSiteBackward& a) {
  // Read once each: dx, r, dresid, v (the value path and the key gradients), next; written:
  // dresid, dr, slot, out; and the slot's per-head rows (weights read and written, ubar).
  const double heads_rows = 3.0 * double(a.inv_rms.numel()) * a.heads * sizeof(float);
  Span s(*this, __func__, OpFamily::Routing,
         bytes_of({a.dx, a.r, a.dresid, a.v, a.dresid, a.dr, a.slot, a.out}) +
             (a.next.empty() ? 0 : bytes_of({a.next})) + heads_rows);
  in_.delta_site_backward(a);
}
double OpProfiler::sum_squares(Tensor t) {
  Span s(*this, __func__, OpFamily::Optimizer, bytes_of({t}));
  return in_.sum_squares(t);
}
void OpProfiler::adamw(Tensor param, Tensor master, Tensor grad, Tensor m, Tensor v, const AdamW& hp) {
  Span s(*this, __func__, OpFamily::Optimizer, adamw_bytes(param, master, grad, m, v));
  in_.adamw(param, master, grad, m, v, hp);
}
std::unique_ptr<Backend::AdamWGroup> OpProfiler::adamw_group(std::vector<AdamWSegment> segments) {
  return in_.adamw_group(std::move(segments));
}
void OpProfiler::adamw_step(const AdamWGroup& group, const AdamW& hp) {
  double bytes = 0;
  for (const AdamWSegment& g : group.segments())
    bytes += adamw_bytes(g.param, g.master, g.grad, g.m, g.v);
  Span s(*this, __func__, OpFamily::Optimizer, bytes);
  in_.adamw_step(group, hp);
}
void OpProfiler::zero(Tensor t) {
  Span s(*this, __func__, OpFamily::Memory, bytes_of({t}));
  in_.zero(t);
}
void OpProfiler::copy(Tensor dst, Tensor src) {
  Span s(*this, __func__, OpFamily::Memory, bytes_of({dst, src}));
  in_.copy(dst, src);
}

}  // namespace mhar
