// forwarding_backend.h: a Backend that passes every op to another one, for wrappers that
// watch or alter a few ops (derive and override those) while the rest run unchanged: the
// op profiler (engine/op_profile.h) and tests.
#pragma once
#include <string>

#include "engine/backend.h"

namespace mhar {

class ForwardingBackend : public Backend {
 public:
  explicit ForwardingBackend(Backend& inner) : in_(inner) {}

  std::string name() const override { return "forwarding(" + in_.name() + ")"; }
  DType act_dtype() const override { return in_.act_dtype(); }
  DType stat_dtype() const override { return in_.stat_dtype(); }
  DType grad_dtype() const override { return in_.grad_dtype(); }
  void* allocate(size_t bytes) override { return in_.allocate(bytes); }
  void release(void* p) override { in_.release(p); }
  void zero(Tensor t) override { in_.zero(t); }
  void copy(Tensor dst, Tensor src) override { in_.copy(dst, src); }
  void upload(Tensor dst, const double* host) override { in_.upload(dst, host); }
  void download(double* host, Tensor src) override { in_.download(host, src); }
  void upload_tokens(Tensor dst, const int32_t* host) override { in_.upload_tokens(dst, host); }
  void synchronize() override { in_.synchronize(); }
  int64_t peak_bytes_in_use() const override { return in_.peak_bytes_in_use(); }
  int64_t device_allocations() const override { return in_.device_allocations(); }
  std::string timed_choices() const override { return in_.timed_choices(); }
  int use_timed_choices(const std::string& text, std::string* why_not) override {
    return in_.use_timed_choices(text, why_not);
  }
  // The inner backend's ops run with the scratch bound here. A wrapper that runs an op as
  // the default sequence of smaller ops (this class forwards only the ops listed) still
  // fits: the inner backend sizes the scratch for every op a model can call, fused or not.
  size_t op_scratch_bytes(const OpScratchShapes& s) const override {
    return in_.op_scratch_bytes(s);
  }
  OpScratch bind_op_scratch(const OpScratch& s) override { return in_.bind_op_scratch(s); }
  int timing_mark() override { return in_.timing_mark(); }
  double timing_ms(int a, int b) override { return in_.timing_ms(a, b); }
  void timing_reset() override { in_.timing_reset(); }
  // side_work_begin/end/join are not forwarded: the inner backend sees every op in issue
  // order (Backend's default), which is what a wrapper that watches or alters ops expects.
  void embedding_forward(Tensor o, Tensor t, Tensor w) override { in_.embedding_forward(o, t, w); }
  void embedding_backward(Tensor d, Tensor o, Tensor t) override { in_.embedding_backward(d, o, t); }
  void rmsnorm_forward(Tensor y, Tensor r, Tensor x, Tensor w, double eps) override {
    in_.rmsnorm_forward(y, r, x, w, eps);
  }
  void rmsnorm_backward(Tensor dx, Tensor dw, Tensor dy, Tensor x, Tensor w, Tensor r,
                        bool acc) override {
    in_.rmsnorm_backward(dx, dw, dy, x, w, r, acc);
  }
  void matmul(Tensor c, Tensor a, Tensor b, bool ta, bool tb, bool acc) override {
    in_.matmul(c, a, b, ta, tb, acc);
  }
  void rope(Tensor x, double theta, bool bw) override { in_.rope(x, theta, bw); }
  void rope_at(Tensor x, double theta, int64_t first) override { in_.rope_at(x, theta, first); }
  void attention_cached(Tensor out, Tensor q, Tensor k, Tensor v) override {
    in_.attention_cached(out, q, k, v);
  }
  void attention_forward(Tensor out, Tensor lse, Tensor q, Tensor k, Tensor v) override {
    in_.attention_forward(out, lse, q, k, v);
  }
  void attention_backward(Tensor dq, Tensor dk, Tensor dv, Tensor dout, Tensor q, Tensor k,
                          Tensor v, Tensor out, Tensor lse) override {
    in_.attention_backward(dq, dk, dv, dout, q, k, v, out, lse);
  }
  void swiglu_forward(Tensor h, Tensor gu) override { in_.swiglu_forward(h, gu); }
  void swiglu_backward(Tensor dgu, Tensor h, Tensor dh, Tensor gu) override {
    in_.swiglu_backward(dgu, h, dh, gu);
  }
  void add(Tensor o, Tensor a, Tensor b) override { in_.add(o, a, b); }
  void add_inplace(Tensor y, Tensor x) override { in_.add_inplace(y, x); }
  void cross_entropy(Tensor l, Tensor lg, Tensor t, double s, bool g) override {
    in_.cross_entropy(l, lg, t, s, g);
  }
  void routing_source_logits(Tensor w, Tensor r, Tensor v, const RoutingParams& p,
                             const RoutingLayout& lay, int i, int heads, double eps) override {
    in_.routing_source_logits(w, r, v, p, lay, i, heads, eps);
  }
  void routing_mix(Tensor x, Tensor w, Tensor h, const RoutingLayout& lay, int site,
                   int heads) override {
    in_.routing_mix(x, w, h, lay, site, heads);
  }
  void routing_mix_tile(Tensor x, Tensor w, Tensor h, const RoutingLayout& lay, int site,
                        int count, int heads) override {
    in_.routing_mix_tile(x, w, h, lay, site, count, heads);
  }
  void routing_mix_tile_rmsnorm(Tensor x, Tensor y, Tensor r, Tensor w, Tensor h,
                                const RoutingLayout& lay, int site, int count, int heads,
                                Tensor norm_w, double eps) override {
    in_.routing_mix_tile_rmsnorm(x, y, r, w, h, lay, site, count, heads, norm_w, eps);
  }
  int routing_tile_sites(const RoutingLayout& lay, int64_t d, int heads) const override {
    return in_.routing_tile_sites(lay, d, heads);
  }
  std::vector<int> routing_tile_plan(const RoutingLayout& lay, int64_t d,
                                     int heads) const override {
    return in_.routing_tile_plan(lay, d, heads);
  }
  void routing_source_backward(Tensor dv, Tensor w, Tensor ub, Tensor gs,
                               const std::vector<Tensor>& dx, Tensor x,
                               Tensor v, Tensor r, const RoutingParams& p,
                               const RoutingLayout& lay, int i, int heads) override {
    in_.routing_source_backward(dv, w, ub, gs, dx, x, v, r, p, lay, i, heads);
  }
  void routing_source_backward_tile(Tensor dv, Tensor w, Tensor ub, Tensor gs,
                                    const std::vector<Tensor>& dx, Tensor x, Tensor h, Tensor r,
                                    const RoutingParams& p, const RoutingLayout& lay, int i,
                                    int count, int heads) override {
    in_.routing_source_backward_tile(dv, w, ub, gs, dx, x, h, r, p, lay, i, count, heads);
  }
  int routing_backward_tile_slots(const RoutingLayout& lay, int64_t d, int heads) const override {
    return in_.routing_backward_tile_slots(lay, d, heads);
  }
  void routing_param_grads(const RoutingParams& p, Tensor gs) override {
    in_.routing_param_grads(p, gs);
  }
  void routing_stats(Tensor stats, Tensor w, const RoutingLayout& lay, int site,
                     int heads) override {
    in_.routing_stats(stats, w, lay, site, heads);
  }
  bool has_hyper_ops() const override { return in_.has_hyper_ops(); }
  void check_hyper(int n, bool dynamic) const override {
    Backend::check_hyper(n, dynamic);  // this wrapper's own has_hyper_ops() (tests override it)
    in_.check_hyper(n, dynamic);
  }
  void hyper_mix(Tensor x, Tensor H, Tensor c) override { in_.hyper_mix(x, H, c); }
  void hyper_mix_backward(Tensor dH, Tensor dc, Tensor dx, Tensor H, Tensor c, bool acc) override {
    in_.hyper_mix_backward(dH, dc, dx, H, c, acc);
  }
  void hyper_update(Tensor out, Tensor in, Tensor v, Tensor Ar, Tensor B) override {
    in_.hyper_update(out, in, v, Ar, B);
  }
  void hyper_update_backward(Tensor din, Tensor dv, Tensor dAr, Tensor dB, Tensor dout, Tensor in,
                             Tensor v, Tensor Ar, Tensor B) override {
    in_.hyper_update_backward(din, dv, dAr, dB, dout, in, v, Ar, B);
  }
  void hyper_dynamic_coef(Tensor C, Tensor T, Tensor rstd, Tensor H, Tensor W, Tensor Am, Tensor Ar,
                          Tensor B, Tensor sa, Tensor sb, double eps) override {
    in_.hyper_dynamic_coef(C, T, rstd, H, W, Am, Ar, B, sa, sb, eps);
  }
  void hyper_mix_dynamic(Tensor x, Tensor H, Tensor C) override { in_.hyper_mix_dynamic(x, H, C); }
  void hyper_mix_dynamic_backward(Tensor dH, Tensor dC, Tensor dx, Tensor H, Tensor C) override {
    in_.hyper_mix_dynamic_backward(dH, dC, dx, H, C);
  }
  void hyper_update_dynamic(Tensor out, Tensor in, Tensor v, Tensor C) override {
    in_.hyper_update_dynamic(out, in, v, C);
  }
  void hyper_update_dynamic_backward(Tensor din, Tensor dv, Tensor dC, Tensor dout, Tensor in,
                                     Tensor v, Tensor C) override {
    in_.hyper_update_dynamic_backward(din, dv, dC, dout, in, v, C);
  }
  void hyper_dynamic_coef_backward(Tensor dH, Tensor dW, Tensor dAm, Tensor dAr, Tensor dB,
                                   Tensor dsa, Tensor dsb, Tensor dC, Tensor H, Tensor W, Tensor T,
                                   Tensor rstd, Tensor sa, Tensor sb) override {
    in_.hyper_dynamic_coef_backward(dH, dW, dAm, dAr, dB, dsa, dsb, dC, H, W, T, rstd, sa, sb);
  }

  bool has_delta_ops() const override { return in_.has_delta_ops(); }
  void delta_gate(Tensor x, Tensor base, Tensor alpha, Tensor r) override {
    in_.delta_gate(x, base, alpha, r);
  }
  void delta_gate_backward(Tensor dr, Tensor da, Tensor dx, Tensor r, Tensor alpha,
                           Tensor scratch) override {
    in_.delta_gate_backward(dr, da, dx, r, alpha, scratch);
  }
  void delta_null_forward(Tensor out, Tensor row) override { in_.delta_null_forward(out, row); }
  void delta_null_backward(Tensor drow, Tensor dout, Tensor scratch) override {
    in_.delta_null_backward(drow, dout, scratch);
  }
  double sum_squares(Tensor t) override { return in_.sum_squares(t); }
  void adamw(Tensor p, Tensor m, Tensor g, Tensor a, Tensor b, const AdamW& hp) override {
    in_.adamw(p, m, g, a, b, hp);
  }

 protected:
  Backend& in_;
};

}  // namespace mhar
