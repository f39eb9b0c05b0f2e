// routing.h: CPU reference depth routing (DESIGN.md sections 2-3), organised by source
// as in backend.h: the logits of a source for every later site when it is written, one
// softmax-and-mix per site, one gradient per source that gathers every later site.
// Layouts (RoutingLayout `lay` in backend.h says which slots a site reads): history
// [sources, N, d], site_dx one [N, d] row pointer per site, inv_rms [N] (one slot), q/g
// one [d] vector per site, weights [lay.pairs(), H, N] with pair (i, k) at lay.pair(i, k),
// ubar [sites, H, N], gsum [C, sites, d] (only slab 0 is used here). Head h owns
// features [h*d/H, (h+1)*d/H). A site never reads a slot after it.
// Sums run in double whatever T is, so the fp32 reference rounds once per output.
#pragma once
#include <cmath>
#include <cstdint>
#include <vector>

#include "engine/backend.h"
#include "engine/cpu/parallel.h"

namespace mhar::cpu {

// Views of one source's rows and the per-site parameters, fixed for a call.
template <class T>
struct RoutingSite {
  const T* q;
  const T* g;
};

template <class T>
void routing_source_logits(T* weights, T* inv_rms, const T* v, const std::vector<RoutingSite<T>>& sites,
                           int64_t N, int64_t d, const RoutingLayout& lay, int source, int H,
                           double eps) {
  const int64_t hs = d / H;
  const int last = lay.last_site(source);
#pragma omp parallel for if (worth_parallel(N * d * (last + 1 - source)))
  for (int64_t n = 0; n < N; ++n) {
    const T* row = v + n * d;
    double ss = 0;
    for (int64_t c = 0; c < d; ++c) ss += double(row[c]) * row[c];
    const double r = 1.0 / std::sqrt(ss / double(d) + eps);
    inv_rms[n] = T(r);
    for (int k = source; k <= last; ++k) {
      const RoutingSite<T>& st = sites[size_t(k)];
      T* w = weights + lay.pair(source, k) * H * N;
      for (int h = 0; h < H; ++h) {
        double dot = 0;
        for (int64_t c = h * hs; c < (h + 1) * hs; ++c) dot += double(st.q[c]) * st.g[c] * row[c];
        w[h * N + n] = T(double(T(r)) * dot);
      }
    }
  }
}

template <class T>
void routing_mix(T* x, T* weights, const T* history, int64_t N, int64_t d,
                 const RoutingLayout& lay, int site, int H) {
  const int64_t hs = d / H;
  const int src = lay.site_sources(site);
  std::vector<const T*> rows(static_cast<size_t>(src));  // the site's history slots, oldest first
  std::vector<T*> pairs(static_cast<size_t>(src));      // their pairs' [H, N] statistics
  for (int t = 0; t < src; ++t) {
    rows[size_t(t)] = history + int64_t(lay.site_source(site, t)) * N * d;
    pairs[size_t(t)] = weights + lay.site_pair(site, t, site / lay.block) * H * N;
  }
#pragma omp parallel if (worth_parallel(N * d * src))
  {
    std::vector<double> a(static_cast<size_t>(src));
#pragma omp for
    for (int64_t n = 0; n < N; ++n)
      for (int h = 0; h < H; ++h) {
        auto w = [&](int t) -> T& { return pairs[size_t(t)][h * N + n]; };
        double mx = -INFINITY;
        for (int t = 0; t < src; ++t) mx = std::max(mx, double(w(t)));
        double sum = 0;
        for (int t = 0; t < src; ++t) sum += (a[size_t(t)] = std::exp(double(w(t)) - mx));
        for (int t = 0; t < src; ++t) w(t) = T(a[size_t(t)] / sum);
        for (int64_t c = h * hs; c < (h + 1) * hs; ++c) {
          double acc = 0;
          for (int t = 0; t < src; ++t) acc += double(w(t)) * rows[size_t(t)][n * d + c];
          x[n * d + c] = T(acc);
        }
      }
  }
}

template <class T>
void routing_source_backward(T* dv, T* weights, T* ubar, T* gsum,
                             const std::vector<const T*>& site_dx, const T* x,
                             const T* v, const T* inv_rms,
                             const std::vector<RoutingSite<T>>& sites, int64_t N, int64_t d,
                             const RoutingLayout& lay, int source, int H) {
  const int64_t hs = d / H;
  const int i = source, last = lay.last_site(source);
  // ubar of site i from its own input and input gradient: stored (rounded to T) for the
  // sources before i, used unrounded below (site 0 has one source: u == ubar there, so
  // its query and gain get exactly zero gradient, as in exact arithmetic).
  std::vector<double> own_ubar(static_cast<size_t>(N * H));
#pragma omp parallel for if (worth_parallel(N * d))
  for (int64_t n = 0; n < N; ++n)
    for (int h = 0; h < H; ++h) {
      double acc = 0;
      for (int64_t c = h * hs; c < (h + 1) * hs; ++c)
        acc += double(site_dx[size_t(i)][n * d + c]) * x[n * d + c];
      own_ubar[size_t(n * H + h)] = acc;
      ubar[(int64_t(i) * H + h) * N + n] = T(acc);
    }
  // dsr[k][h][n] kept apart until every token is done: gsum needs the rounded values
  // exactly as stored, and the parallel loop below owns tokens, not features.
#pragma omp parallel if (worth_parallel(N * d * (last + 1 - i)))
  {
    std::vector<double> acc(static_cast<size_t>(d));
#pragma omp for
    for (int64_t n = 0; n < N; ++n) {
      const T* vn = v + n * d;
      const double r = inv_rms[n];
      std::fill(acc.begin(), acc.end(), 0.0);
      double radial = 0;  // sum_k sum_c ds_k q_k g_k v
      for (int k = i; k <= last; ++k) {
        const T* dx = site_dx[size_t(k)] + n * d;
        const RoutingSite<T>& st = sites[size_t(k)];
        T* w = weights + lay.pair(i, k) * H * N;
        for (int h = 0; h < H; ++h) {
          double u = 0;
          for (int64_t c = h * hs; c < (h + 1) * hs; ++c) u += double(dx[c]) * vn[c];
          const double a = w[h * N + n];
          const double ub = k == i ? own_ubar[size_t(n * H + h)]
                                   : double(ubar[(int64_t(k) * H + h) * N + n]);
          const double ds = a * (u - ub);
          for (int64_t c = h * hs; c < (h + 1) * hs; ++c) {
            const double qg = double(st.q[c]) * st.g[c];
            acc[size_t(c)] += a * dx[c] + r * qg * ds;
            radial += ds * qg * vn[c];
          }
          w[h * N + n] = T(ds * r);
        }
      }
      const double scale = r * r * r / double(d) * radial;
      for (int64_t c = 0; c < d; ++c) dv[n * d + c] = T(acc[size_t(c)] - scale * vn[c]);
    }
  }
  // G_k[c] += sum_n dsr_k[head(c), n] v[n, c], into slab 0.
#pragma omp parallel for if (worth_parallel(N * d * (last + 1 - i)))
  for (int k = i; k <= last; ++k) {
    const T* w = weights + lay.pair(i, k) * H * N;
    T* G = gsum + int64_t(k) * d;
    for (int64_t c = 0; c < d; ++c) {
      const T* wh = w + (c / hs) * N;
      double acc = 0;
      for (int64_t n = 0; n < N; ++n) acc += double(wh[n]) * v[n * d + c];
      G[c] += T(acc);
    }
  }
}

// ---- routing probe statistics (Backend::routing_stats; engine/probe.h).
inline double entropy_nats(const double* p, int n) {
  double h = 0;
  for (int i = 0; i < n; ++i)
    if (p[i] > 0) h -= p[i] * std::log(p[i]);
  return h;
}

// JS(p, q) = (KL(p||m) + KL(q||m)) / 2, m = (p + q) / 2, natural log.
inline double js_divergence(const double* p, const double* q, int n) {
  double js = 0;
  for (int i = 0; i < n; ++i) {
    const double m = 0.5 * (p[i] + q[i]);
    if (p[i] > 0) js += 0.5 * p[i] * std::log(p[i] / m);
    if (q[i] > 0) js += 0.5 * q[i] * std::log(q[i] / m);
  }
  return js < 0 ? 0 : js;  // rounding can leave -1e-17 for equal distributions
}

// stats [H*src + H + 1] += the sums of backend.h's routing_stats over N tokens;
// pair_of(t) points at the [H, N] weights of the site's t-th source (t < src).
template <class PairFn>
void routing_stats(double* stats, PairFn pair_of, int src, int H, int64_t N) {
  std::vector<double> d(size_t(H) * size_t(src));  // one token: [h][i]
  for (int64_t n = 0; n < N; ++n) {
    for (int i = 0; i < src; ++i) {
      const auto* pair = pair_of(i);
      for (int h = 0; h < H; ++h) d[size_t(h) * src + i] = double(pair[int64_t(h) * N + n]);
    }
    for (int h = 0; h < H; ++h) {
      for (int i = 0; i < src; ++i) stats[size_t(h) * src + i] += d[size_t(h) * src + i];
      stats[size_t(H) * src + h] += entropy_nats(d.data() + size_t(h) * src, src);
    }
    if (H > 1) {
      double js = 0;
      for (int h = 0; h < H; ++h)
        for (int g = h + 1; g < H; ++g) js += js_divergence(d.data() + size_t(h) * src, d.data() + size_t(g) * src, src);
      stats[size_t(H) * (src + 1)] += js / (0.5 * H * (H - 1));
    }
  }
}

}  // namespace mhar::cpu
