// cpu_backend.cpp: the CPU reference backend, CpuBackend<T> for T = float or double.
// Every op checks its tensors' dtypes and shapes and forwards to the templated kernel in
// engine/cpu/<op>.h. Memory is host memory; act, stat and grad dtypes are all T.
#include <cstdlib>
#include <cstring>

#include "engine/backend.h"
#include "engine/cpu/attention.h"
#include "engine/cpu/classifier.h"
#include "engine/cpu/embedding.h"
#include "engine/cpu/delta.h"
#include "engine/cpu/hyper.h"
#include "engine/cpu/matmul.h"
#include "engine/cpu/optimizer.h"
#include "engine/cpu/rmsnorm.h"
#include "engine/cpu/rope.h"
#include "engine/cpu/routing.h"
#include "engine/cpu/swiglu.h"

namespace mhar {

namespace {

void expect_shape(const Tensor& t, std::initializer_list<int64_t> dims, const char* what) {
  Tensor want(nullptr, t.dtype, dims);
  bool same = want.ndim == t.ndim;
  for (int i = 0; same && i < t.ndim; ++i) same = want.shape[i] == t.shape[i];
  MHAR_CHECK(same, what, " has shape ", t.shape_str(), ", expected ", want.shape_str());
}

template <class T>
class CpuBackend final : public Backend {
 public:
  std::string name() const override {
    return dtype_of<T>() == DType::F32 ? "cpu-fp32" : "cpu-fp64";
  }
  DType act_dtype() const override { return dtype_of<T>(); }
  DType stat_dtype() const override { return dtype_of<T>(); }
  DType grad_dtype() const override { return dtype_of<T>(); }

  void* allocate(size_t bytes) override {
    void* p = std::aligned_alloc(256, (bytes + 255) / 256 * 256);
    if (!p) fail("out of host memory allocating ", bytes, " bytes");
    std::memset(p, 0, bytes);
    return p;
  }
  void release(void* p) override { std::free(p); }
  void zero(Tensor t) override { std::memset(t.data, 0, t.bytes()); }
  void copy(Tensor dst, Tensor src) override {
    MHAR_CHECK(dst.dtype == src.dtype && dst.numel() == src.numel(), "copy mismatch");
    std::memmove(dst.data, src.data, src.bytes());
  }
  // F64 tensors are accepted whatever T is: small fp64 buffers such as the routing
  // probe's sums (Backend::routing_stats) live in any backend's memory.
  void upload(Tensor dst, const double* host) override {
    if (dst.dtype == DType::F64) {
      std::memcpy(dst.data, host, dst.bytes());
      return;
    }
    T* p = dst.ptr<T>();
    for (int64_t i = 0; i < dst.numel(); ++i) p[i] = T(host[i]);
  }
  void download(double* host, Tensor src) override {
    if (src.dtype == DType::F64) {
      std::memcpy(host, src.data, src.bytes());
      return;
    }
    const T* p = src.ptr<T>();
    for (int64_t i = 0; i < src.numel(); ++i) host[i] = double(p[i]);
  }
  void upload_tokens(Tensor dst, const int32_t* host) override {
    std::memcpy(dst.ptr<int32_t>(), host, dst.bytes());
  }

  void embedding_forward(Tensor out, Tensor tokens, Tensor table) override {
    const int64_t N = tokens.numel(), d = table.dim(1);
    expect_shape(out, {N, d}, "embedding out");
    cpu::embedding_forward(out.ptr<T>(), tokens.ptr<int32_t>(), table.ptr<T>(), N, table.dim(0), d);
  }
  void embedding_backward(Tensor dtable, Tensor dout, Tensor tokens) override {
    const int64_t N = tokens.numel(), d = dtable.dim(1);
    expect_shape(dout, {N, d}, "embedding dout");
    cpu::embedding_backward(dtable.ptr<T>(), dout.ptr<T>(), tokens.ptr<int32_t>(), N, d);
  }

  void rmsnorm_forward(Tensor y, Tensor rstd, Tensor x, Tensor w, double eps) override {
    const int64_t D = w.numel(), R = x.numel() / D;
    MHAR_CHECK(x.numel() == R * D && y.numel() == x.numel() && rstd.numel() == R, "rmsnorm shapes");
    cpu::rmsnorm_forward(y.ptr<T>(), rstd.ptr<T>(), x.ptr<T>(), w.ptr<T>(), R, D, eps);
  }
  void rmsnorm_backward(Tensor dx, Tensor dw, Tensor dy, Tensor x, Tensor w, Tensor rstd,
                        bool accumulate_dx) override {
    const int64_t D = w.numel(), R = x.numel() / D;
    MHAR_CHECK(dx.numel() == x.numel() && dy.numel() == x.numel() && dw.numel() == D &&
                   rstd.numel() == R, "rmsnorm backward shapes");
    cpu::rmsnorm_backward(dx.ptr<T>(), dw.ptr<T>(), dy.ptr<T>(), x.ptr<T>(), w.ptr<T>(),
                          rstd.ptr<T>(), R, D, accumulate_dx);
  }

  void matmul(Tensor c, Tensor a, Tensor b, bool trans_a, bool trans_b, bool accumulate) override {
    MHAR_CHECK(a.ndim == 2 && b.ndim == 2 && c.ndim == 2, "matmul wants 2-D tensors");
    const int64_t M = trans_a ? a.dim(1) : a.dim(0), K = trans_a ? a.dim(0) : a.dim(1);
    const int64_t N = trans_b ? b.dim(0) : b.dim(1), Kb = trans_b ? b.dim(1) : b.dim(0);
    MHAR_CHECK(K == Kb && c.dim(0) == M && c.dim(1) == N, "matmul shapes ", a.shape_str(),
               b.shape_str(), "->", c.shape_str());
    cpu::gemm(trans_a, trans_b, M, N, K, a.ptr<T>(), a.dim(1), b.ptr<T>(), b.dim(1),
              accumulate ? T(1) : T(0), c.ptr<T>(), N);
  }

  void rope(Tensor x, double theta, bool backward) override {
    MHAR_CHECK(x.ndim == 4, "rope wants [B, T, heads, hd]");
    cpu::rope(x.ptr<T>(), x.dim(0), x.dim(1), x.dim(2), x.dim(3), theta, backward);
  }

  void rope_at(Tensor x, double theta, int64_t first_position) override {
    MHAR_CHECK(x.ndim == 4 && x.dim(0) == 1, "rope_at wants [1, T, heads, hd], got ",
               x.shape_str());
    MHAR_CHECK(first_position >= 0, "rope_at position ", first_position);
    cpu::rope_at(x.ptr<T>(), 1, x.dim(1), x.dim(2), x.dim(3), theta, false, first_position);
  }

  void attention_cached(Tensor out, Tensor q, Tensor k_cache, Tensor v_cache) override {
    MHAR_CHECK(q.ndim == 4 && q.dim(0) == 1, "attention_cached q ", q.shape_str());
    const int64_t Tq = q.dim(1), Hq = q.dim(2), hd = q.dim(3);
    const int64_t Tk = k_cache.dim(1), Hkv = k_cache.dim(2);
    MHAR_CHECK(Tk >= Tq, "attention_cached: ", Tk, " cached keys for ", Tq, " queries");
    expect_shape(k_cache, {1, Tk, Hkv, hd}, "attention_cached k_cache");
    expect_shape(v_cache, {1, Tk, Hkv, hd}, "attention_cached v_cache");
    expect_shape(out, {1, Tq, Hq, hd}, "attention_cached out");
    MHAR_CHECK(Hq % Hkv == 0, "GQA heads");
    cpu::attention_forward_offset(out.ptr<T>(), static_cast<T*>(nullptr), q.ptr<T>(),
                                  k_cache.ptr<T>(), v_cache.ptr<T>(), 1, Tq, Tk, Hq, Hkv, hd);
  }

  void attention_forward(Tensor out, Tensor lse, Tensor q, Tensor k, Tensor v) override {
    const int64_t B = q.dim(0), Tn = q.dim(1), Hq = q.dim(2), hd = q.dim(3), Hkv = k.dim(2);
    expect_shape(k, {B, Tn, Hkv, hd}, "attention k");
    expect_shape(v, {B, Tn, Hkv, hd}, "attention v");
    expect_shape(out, {B, Tn, Hq, hd}, "attention out");
    expect_shape(lse, {B, Hq, Tn}, "attention lse");
    MHAR_CHECK(Hq % Hkv == 0, "GQA heads");
    cpu::attention_forward(out.ptr<T>(), lse.ptr<T>(), q.ptr<T>(), k.ptr<T>(), v.ptr<T>(), B,
                           Tn, Hq, Hkv, hd);
  }
  void attention_backward(Tensor dq, Tensor dk, Tensor dv, Tensor dout, Tensor q, Tensor k,
                          Tensor v, Tensor out, Tensor lse) override {
    const int64_t B = q.dim(0), Tn = q.dim(1), Hq = q.dim(2), hd = q.dim(3), Hkv = k.dim(2);
    MHAR_CHECK(dq.numel() == q.numel() && dk.numel() == k.numel() && dv.numel() == v.numel() &&
                   dout.numel() == q.numel(), "attention backward shapes");
    cpu::attention_backward(dq.ptr<T>(), dk.ptr<T>(), dv.ptr<T>(), dout.ptr<T>(), q.ptr<T>(),
                            k.ptr<T>(), v.ptr<T>(), out.ptr<T>(), lse.ptr<T>(), B, Tn, Hq, Hkv, hd);
  }

  void swiglu_forward(Tensor h, Tensor gate_up) override {
    const int64_t F = swiglu_width(h, gate_up, "swiglu_forward");
    cpu::swiglu_forward(h.ptr<T>(), gate_up.ptr<T>(), h.numel() / std::max<int64_t>(F, 1), F);
  }
  void swiglu_backward(Tensor d_gate_up, Tensor h, Tensor dh, Tensor gate_up) override {
    const int64_t F = swiglu_backward_width(d_gate_up, h, dh, gate_up, "swiglu_backward");
    cpu::swiglu_backward(d_gate_up.ptr<T>(), h.empty() ? nullptr : h.ptr<T>(), dh.ptr<T>(),
                         gate_up.ptr<T>(), dh.numel() / std::max<int64_t>(F, 1), F);
  }

  void add(Tensor out, Tensor a, Tensor b) override {
    MHAR_CHECK(out.numel() == a.numel() && b.numel() == a.numel(), "add shapes");
    T* o = out.ptr<T>();
    const T *x = a.ptr<T>(), *y = b.ptr<T>();
#pragma omp parallel for if (cpu::worth_parallel(out.numel()))
    for (int64_t i = 0; i < out.numel(); ++i) o[i] = x[i] + y[i];
  }
  void add_inplace(Tensor y, Tensor x) override {
    MHAR_CHECK(y.numel() == x.numel(), "add_inplace shapes");
    T* o = y.ptr<T>();
    const T* p = x.ptr<T>();
#pragma omp parallel for if (cpu::worth_parallel(y.numel()))
    for (int64_t i = 0; i < y.numel(); ++i) o[i] += p[i];
  }

  void cross_entropy(Tensor losses, Tensor logits, Tensor targets, double grad_scale,
                     bool compute_grad) override {
    const int64_t N = targets.numel(), V = logits.dim(-1);
    MHAR_CHECK(logits.numel() == N * V && losses.numel() == N, "cross_entropy shapes");
    cpu::cross_entropy(losses.ptr<T>(), logits.ptr<T>(), targets.ptr<int32_t>(), N, V,
                       grad_scale, compute_grad);
  }

  // Per-site parameter pointers for cpu::routing_*; a site's entries must exist and be [d].
  std::vector<cpu::RoutingSite<T>> routing_sites(const RoutingParams& p, int64_t d) {
    std::vector<cpu::RoutingSite<T>> sites;
    MHAR_CHECK(p.query.size() == p.gain.size(), "routing params: ", p.query.size(),
               " queries but ", p.gain.size(), " gains");
    for (int k = 0; k < p.sites(); ++k) {
      MHAR_CHECK(p.query[size_t(k)].numel() == d && p.gain[size_t(k)].numel() == d,
                 "routing params of site ", k, " must be [", d, "]");
      sites.push_back({p.query[size_t(k)].ptr<T>(), p.gain[size_t(k)].ptr<T>()});
    }
    return sites;
  }
  void check_layout(const RoutingLayout& lay, const RoutingParams& p, const char* what) {
    MHAR_CHECK(lay.sources >= 1 && lay.sites >= lay.sources && lay.block >= 1, what,
               ": routing layout of ", lay.sources, " sources, ", lay.sites, " sites, block ",
               lay.block);
    MHAR_CHECK(p.sites() == lay.sites, what, ": ", p.sites(), " sites' parameters for a layout of ",
               lay.sites, " sites");
  }
  void check_weights(Tensor weights, const RoutingLayout& lay, int64_t N, int heads, int64_t d) {
    MHAR_CHECK(heads >= 1 && d % heads == 0, "routing heads ", heads, " must divide d ", d);
    expect_shape(weights, {lay.pairs(), heads, N}, "routing weights");
  }
  void routing_source_logits(Tensor weights, Tensor inv_rms, Tensor v, const RoutingParams& p,
                             const RoutingLayout& lay, int source, int heads, double eps) override {
    check_layout(lay, p, "routing_source_logits");
    const int64_t N = inv_rms.numel(), d = N ? v.numel() / N : 0;
    MHAR_CHECK(v.numel() == N * d && source >= 0 && source < lay.sources,
               "routing_source_logits: v ", v.shape_str(), " inv_rms ", inv_rms.shape_str(),
               " source ", source, " of ", lay.sources);
    check_weights(weights, lay, N, heads, d);
    cpu::routing_source_logits(weights.ptr<T>(), inv_rms.ptr<T>(), v.ptr<T>(),
                               routing_sites(p, d), N, d, lay, source, heads, eps);
  }
  void routing_mix(Tensor x, Tensor weights, Tensor history, const RoutingLayout& lay, int site,
                   int heads) override {
    const int64_t N = history.dim(1), d = history.dim(2);
    MHAR_CHECK(history.ndim == 3 && history.dim(0) == lay.sources, "routing_mix: history ",
               history.shape_str(), " for ", lay.sources, " sources");
    MHAR_CHECK(site >= 0 && site < lay.sites, "routing_mix: site ", site, " of ", lay.sites);
    check_weights(weights, lay, N, heads, d);
    expect_shape(x, {N, d}, "routing x");
    cpu::routing_mix(x.ptr<T>(), weights.ptr<T>(), history.ptr<T>(), N, d, lay, site, heads);
  }
  void routing_source_backward(Tensor dv, Tensor weights, Tensor ubar, Tensor gsum,
                               const std::vector<Tensor>& site_dx, Tensor x, Tensor v,
                               Tensor inv_rms, const RoutingParams& p, const RoutingLayout& lay,
                               int source, int heads) override {
    check_layout(lay, p, "routing_source_backward");
    const int S = lay.sites;
    const int64_t N = inv_rms.numel(), d = N ? v.numel() / N : 0;
    MHAR_CHECK(source >= 0 && source < lay.sources, "routing_source_backward: source ", source,
               " of ", lay.sources);
    check_weights(weights, lay, N, heads, d);
    MHAR_CHECK(int(site_dx.size()) == S, "routing site_dx: ", site_dx.size(), " sites' gradients for ",
               S, " sites");
    std::vector<const T*> dx(size_t(S), nullptr);
    for (int k = source; k <= lay.last_site(source); ++k) {
      expect_shape(site_dx[size_t(k)], {N, d}, "routing site_dx row");
      dx[size_t(k)] = site_dx[size_t(k)].ptr<T>();
    }
    expect_shape(ubar, {S, heads, N}, "routing ubar");
    MHAR_CHECK(gsum.ndim == 3 && gsum.dim(1) == S && gsum.dim(2) == d,
               "routing gsum must be [C, ", S, ", ", d, "], got ", gsum.shape_str());
    MHAR_CHECK(v.numel() == N * d && x.numel() == N * d && dv.numel() == N * d,
               "routing_source_backward: v/x/dv must be [", N, ", ", d, "]");
    cpu::routing_source_backward(dv.ptr<T>(), weights.ptr<T>(), ubar.ptr<T>(), gsum.ptr<T>(),
                                 dx, x.ptr<T>(), v.ptr<T>(), inv_rms.ptr<T>(),
                                 routing_sites(p, d), N, d, lay, source, heads);
  }
  void routing_stats(Tensor stats, Tensor weights, const RoutingLayout& lay, int site,
                     int heads) override {
    const int64_t N = weights.dim(2);
    MHAR_CHECK(weights.ndim == 3 && weights.dim(0) == lay.pairs() && weights.dim(1) == heads &&
                   site >= 0 && site < lay.sites,
               "routing_stats shapes");
    const int src = lay.site_sources(site);
    MHAR_CHECK(stats.numel() == int64_t(heads) * (src + 1) + 1, "routing_stats buffer of ", stats.numel());
    const T* w = weights.ptr<T>();
    cpu::routing_stats(stats.ptr<double>(),
                       [&](int t) { return w + lay.pair(lay.site_source(site, t), site) * heads * N; },
                       src, heads, N);
  }
  void routing_param_grads(const RoutingParams& p, Tensor gsum) override {
    const int S = p.sites();
    const int64_t C = gsum.dim(0), d = gsum.dim(2);
    MHAR_CHECK(gsum.ndim == 3 && gsum.dim(1) == S, "routing gsum ", gsum.shape_str());
    MHAR_CHECK(int(p.dquery.size()) == S && int(p.dgain.size()) == S,
               "routing_param_grads needs dquery and dgain of every site");
    const auto sites = routing_sites(p, d);
    for (int k = 0; k < S; ++k) {
      T* dq = p.dquery[size_t(k)].ptr<T>();
      T* dg = p.dgain[size_t(k)].ptr<T>();
      for (int64_t c = 0; c < d; ++c) {
        double G = 0;
        for (int64_t r = 0; r < C; ++r) G += double(gsum.ptr<T>()[(r * S + k) * d + c]);
        dq[c] += T(double(sites[size_t(k)].g[c]) * G);
        dg[c] += T(double(sites[size_t(k)].q[c]) * G);
      }
    }
  }

  // Hyper-Connections: streams [n, N, d] (or [n, M]); coefficients [n] and [n * n].
  bool has_hyper_ops() const override { return true; }
  static int hyper_streams(const Tensor& H, int64_t M, const char* what) {
    MHAR_CHECK(H.ndim >= 2 && M > 0 && H.numel() % M == 0 && H.dim(0) * M == H.numel(), what,
               ": streams ", H.shape_str(), " are not [n, ", M, " elements]");
    return int(H.dim(0));
  }
  static void hyper_coef(const Tensor& c, int64_t want, const char* what) {
    MHAR_CHECK(c.numel() == want, what, " has ", c.numel(), " elements, expected ", want);
  }
  void hyper_mix(Tensor x, Tensor H, Tensor coef) override {
    const int n = hyper_streams(H, x.numel(), "hyper_mix");
    if (!coef.empty()) hyper_coef(coef, n, "hyper_mix coef");
    cpu::hyper_mix(x.ptr<T>(), H.ptr<T>(), coef.empty() ? nullptr : coef.ptr<T>(), n, x.numel());
  }
  void hyper_mix_backward(Tensor dH, Tensor dcoef, Tensor dx, Tensor H, Tensor coef,
                          bool accumulate) override {
    const int n = hyper_streams(dH, dx.numel(), "hyper_mix_backward");
    if (!coef.empty()) {
      hyper_coef(coef, n, "hyper_mix_backward coef");
      hyper_coef(dcoef, n, "hyper_mix_backward dcoef");
      MHAR_CHECK(H.numel() == dH.numel(), "hyper_mix_backward: H ", H.shape_str(), " dH ",
                 dH.shape_str());
    }
    cpu::hyper_mix_backward(dH.ptr<T>(), coef.empty() ? nullptr : dcoef.ptr<T>(), dx.ptr<T>(),
                            coef.empty() ? nullptr : H.ptr<T>(),
                            coef.empty() ? nullptr : coef.ptr<T>(), n, dx.numel(), accumulate);
  }
  void hyper_update(Tensor out, Tensor in, Tensor v, Tensor Ar, Tensor B) override {
    const int n = hyper_streams(out, v.numel(), "hyper_update");
    MHAR_CHECK(in.numel() == out.numel() && in.data != out.data,
               "hyper_update: in ", in.shape_str(), " must be a buffer of out's shape ",
               out.shape_str(), " other than out");
    hyper_coef(Ar, int64_t(n) * n, "hyper_update A_r");
    hyper_coef(B, n, "hyper_update B");
    cpu::hyper_update(out.ptr<T>(), in.ptr<T>(), v.ptr<T>(), Ar.ptr<T>(), B.ptr<T>(), n,
                      v.numel());
  }
  void hyper_update_backward(Tensor din, Tensor dv, Tensor dAr, Tensor dB, Tensor dout,
                             Tensor in, Tensor v, Tensor Ar, Tensor B) override {
    const int n = hyper_streams(dout, v.numel(), "hyper_update_backward");
    MHAR_CHECK(din.numel() == dout.numel() && in.numel() == dout.numel() &&
                   dv.numel() == v.numel() && din.data != dout.data,
               "hyper_update_backward shapes: din ", din.shape_str(), " dout ",
               dout.shape_str(), " in ", in.shape_str(), " dv ", dv.shape_str());
    hyper_coef(Ar, int64_t(n) * n, "hyper_update_backward A_r");
    hyper_coef(dAr, int64_t(n) * n, "hyper_update_backward dA_r");
    hyper_coef(B, n, "hyper_update_backward B");
    hyper_coef(dB, n, "hyper_update_backward dB");
    cpu::hyper_update_backward(din.ptr<T>(), dv.ptr<T>(), dAr.ptr<T>(), dB.ptr<T>(),
                               dout.ptr<T>(), in.ptr<T>(), v.ptr<T>(), Ar.ptr<T>(), B.ptr<T>(),
                               n, v.numel());
  }  // Dynamic: C, T [N, n, n+2], rstd [N, n]; N and d from H [n, N, d].
  struct DynShape {
    int n;
    int64_t N, d;
  };
  static DynShape dyn_shape(const Tensor& H, const Tensor& C, const char* what) {
    MHAR_CHECK(H.ndim == 3 && C.numel() == H.dim(1) * H.dim(0) * (H.dim(0) + 2), what,
               ": streams ", H.shape_str(), " coefficients ", C.shape_str());
    return DynShape{int(H.dim(0)), H.dim(1), H.dim(2)};
  }
  void hyper_dynamic_coef(Tensor C, Tensor Tt, Tensor rstd, Tensor H, Tensor W, Tensor Am,
                          Tensor Ar, Tensor B, Tensor s_a, Tensor s_b, double eps) override {
    const DynShape s = dyn_shape(H, C, "hyper_dynamic_coef");
    MHAR_CHECK(Tt.numel() == C.numel() && rstd.numel() == s.N * s.n &&
                   W.numel() == s.d * (s.n + 2) && Am.numel() == s.n &&
                   Ar.numel() == int64_t(s.n) * s.n && B.numel() == s.n && s_a.numel() == 1 &&
                   s_b.numel() == 1,
               "hyper_dynamic_coef: shapes");
    cpu::hyper_dynamic_coef(C.ptr<T>(), Tt.ptr<T>(), rstd.ptr<T>(), H.ptr<T>(), W.ptr<T>(),
                            Am.ptr<T>(), Ar.ptr<T>(), B.ptr<T>(), s_a.ptr<T>()[0],
                            s_b.ptr<T>()[0], s.n, s.N, s.d, eps);
  }
  void hyper_mix_dynamic(Tensor x, Tensor H, Tensor C) override {
    const DynShape s = dyn_shape(H, C, "hyper_mix_dynamic");
    MHAR_CHECK(x.numel() == s.N * s.d, "hyper_mix_dynamic: x ", x.shape_str());
    cpu::hyper_mix_dynamic(x.ptr<T>(), H.ptr<T>(), C.ptr<T>(), s.n, s.N, s.d);
  }
  void hyper_mix_dynamic_backward(Tensor dH, Tensor dC, Tensor dx, Tensor H, Tensor C) override {
    const DynShape s = dyn_shape(H, C, "hyper_mix_dynamic_backward");
    MHAR_CHECK(dH.numel() == H.numel() && dC.numel() == C.numel() && dx.numel() == s.N * s.d,
               "hyper_mix_dynamic_backward: shapes");
    cpu::hyper_mix_dynamic_backward(dH.ptr<T>(), dC.ptr<T>(), dx.ptr<T>(), H.ptr<T>(),
                                    C.ptr<T>(), s.n, s.N, s.d);
  }
  void hyper_update_dynamic(Tensor out, Tensor in, Tensor v, Tensor C) override {
    const DynShape s = dyn_shape(in, C, "hyper_update_dynamic");
    MHAR_CHECK(out.numel() == in.numel() && out.data != in.data && v.numel() == s.N * s.d,
               "hyper_update_dynamic: out ", out.shape_str(), " must be another buffer of in's shape ",
               in.shape_str());
    cpu::hyper_update_dynamic(out.ptr<T>(), in.ptr<T>(), v.ptr<T>(), C.ptr<T>(), s.n, s.N, s.d);
  }
  void hyper_update_dynamic_backward(Tensor din, Tensor dv, Tensor dC, Tensor dout, Tensor in,
                                     Tensor v, Tensor C) override {
    const DynShape s = dyn_shape(in, C, "hyper_update_dynamic_backward");
    MHAR_CHECK(din.numel() == in.numel() && dout.numel() == in.numel() && din.data != dout.data &&
                   dv.numel() == s.N * s.d && v.numel() == s.N * s.d && dC.numel() == C.numel(),
               "hyper_update_dynamic_backward: shapes");
    cpu::hyper_update_dynamic_backward(din.ptr<T>(), dv.ptr<T>(), dC.ptr<T>(), dout.ptr<T>(),
                                       in.ptr<T>(), v.ptr<T>(), C.ptr<T>(), s.n, s.N, s.d);
  }
  void hyper_dynamic_coef_backward(Tensor dH, Tensor dW, Tensor dAm, Tensor dAr, Tensor dB,
                                   Tensor ds_a, Tensor ds_b, Tensor dC, Tensor H, Tensor W,
                                   Tensor Tt, Tensor rstd, Tensor s_a, Tensor s_b) override {
    const DynShape s = dyn_shape(H, dC, "hyper_dynamic_coef_backward");
    MHAR_CHECK(dH.numel() == H.numel() && dW.numel() == W.numel() &&
                   W.numel() == s.d * (s.n + 2) && dAm.numel() == s.n &&
                   dAr.numel() == int64_t(s.n) * s.n && dB.numel() == s.n &&
                   ds_a.numel() == 1 && ds_b.numel() == 1 && Tt.numel() == dC.numel() &&
                   rstd.numel() == s.N * s.n,
               "hyper_dynamic_coef_backward: shapes");
    cpu::hyper_dynamic_coef_backward(dH.ptr<T>(), dW.ptr<T>(), dAm.ptr<T>(), dAr.ptr<T>(),
                                     dB.ptr<T>(), ds_a.ptr<T>(), ds_b.ptr<T>(), dC.ptr<T>(),
                                     H.ptr<T>(), W.ptr<T>(), Tt.ptr<T>(), rstd.ptr<T>(),
                                     s_a.ptr<T>()[0], s_b.ptr<T>()[0], s.n, s.N, s.d);
  }


  // Delta mode: alpha [1], the null row [d]; the CPU needs no scratch.
  bool has_delta_ops() const override { return true; }
  void delta_gate(Tensor x, Tensor base, Tensor alpha, Tensor r) override {
    MHAR_CHECK(x.numel() == base.numel() && r.numel() == x.numel() && alpha.numel() == 1,
               "delta_gate: x ", x.shape_str(), " base ", base.shape_str(), " r ", r.shape_str(),
               " alpha ", alpha.shape_str());
    cpu::delta_gate(x.ptr<T>(), base.ptr<T>(), double(alpha.ptr<T>()[0]), r.ptr<T>(), x.numel());
  }
  void delta_gate_backward(Tensor dr, Tensor dalpha, Tensor dx, Tensor r, Tensor alpha,
                           Tensor) override {
    MHAR_CHECK(dr.numel() == dx.numel() && r.numel() == dx.numel() && alpha.numel() == 1 &&
                   dalpha.numel() == 1,
               "delta_gate_backward: dr ", dr.shape_str(), " dx ", dx.shape_str(), " r ",
               r.shape_str());
    const double g =
        cpu::delta_gate_backward(dr.ptr<T>(), dx.ptr<T>(), r.ptr<T>(), double(alpha.ptr<T>()[0]),
                                 dx.numel());
    dalpha.ptr<T>()[0] = T(double(dalpha.ptr<T>()[0]) + g);
  }
  void delta_null_forward(Tensor out, Tensor row) override {
    MHAR_CHECK(out.ndim == 2 && row.numel() == out.dim(1), "delta_null_forward: out ",
               out.shape_str(), " row ", row.shape_str());
    cpu::delta_null_forward(out.ptr<T>(), row.ptr<T>(), out.dim(0), out.dim(1));
  }
  void delta_null_backward(Tensor drow, Tensor dout, Tensor) override {
    MHAR_CHECK(dout.ndim == 2 && drow.numel() == dout.dim(1), "delta_null_backward: dout ",
               dout.shape_str(), " drow ", drow.shape_str());
    cpu::delta_null_backward(drow.ptr<T>(), dout.ptr<T>(), dout.dim(0), dout.dim(1));
  }

  double sum_squares(Tensor t) override { return cpu::sum_squares(t.ptr<T>(), t.numel()); }
  void adamw(Tensor param, Tensor master, Tensor grad, Tensor m, Tensor v,
             const AdamW& hp) override {
    MHAR_CHECK(master.empty(), "the CPU backend keeps no separate master weights");
    MHAR_CHECK(grad.numel() == param.numel() && m.numel() == param.numel() &&
                   v.numel() == param.numel(), "adamw shapes");
    cpu::adamw(param.ptr<T>(), grad.ptr<T>(), m.ptr<T>(), v.ptr<T>(), param.numel(), hp.lr,
               hp.beta1, hp.beta2, hp.eps, hp.weight_decay, hp.grad_scale, hp.step);
  }
};

}  // namespace

std::unique_ptr<Backend> make_cpu_backend(DType dtype) {
  switch (dtype) {
    case DType::F32: return std::make_unique<CpuBackend<float>>();
    case DType::F64: return std::make_unique<CpuBackend<double>>();
    default: fail("the CPU backend runs in F32 or F64, not ", dtype_name(dtype));
  }
}

}  // namespace mhar
