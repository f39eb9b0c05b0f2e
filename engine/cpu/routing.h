// routing.h: CPU reference depth routing (DESIGN.md section 2), one site at a time.
// Layouts: history [S, N, d] (slot i = source v_i), inv_rms [S, N], query and gain [d],
// weights [N, H, n_src]. Head h owns features [h*d/H, (h+1)*d/H). Only slots < n_src are
// read, so a site never sees a future source.
//
// Forward, per token n and head h:
//   s_i = inv_rms_i * sum_{c in h} q[c] g[c] v_i[c];  a = softmax_i(s);  x[c] = sum_i a_i v_i[c]
// Backward, with u_i = sum_{c in h} dx[c] v_i[c] and ds_i = a_i (u_i - sum_k a_k u_k):
//   value path:  dv_i[c] += a_i dx[c]
//   query/gain:  dq[c] += ds_i g[c] v_i[c] r_i;   dg[c] += ds_i q[c] v_i[c] r_i
//   key path:    with w_i[c] = ds_{i,head(c)} q[c] g[c] (all heads) and r_i = inv_rms_i,
//                dv_i[c] += r_i w_i[c] - r_i^3 v_i[c] (sum_c' w_i[c'] v_i[c']) / d
//                (the second term is the gradient through the RMS over the full d).
#pragma once
#include "engine/cpu/parallel.h"
#include <cmath>
#include <cstdint>
#include <vector>

#include <omp.h>

namespace mhar::cpu {

template <class T>
void routing_source_stats(T* inv_rms, const T* v, int64_t N, int64_t d, double eps) {
#pragma omp parallel for if (worth_parallel(N * d))
  for (int64_t n = 0; n < N; ++n) {
    double ss = 0;
    for (int64_t c = 0; c < d; ++c) ss += double(v[n * d + c]) * v[n * d + c];
    inv_rms[n] = T(1.0 / std::sqrt(ss / double(d) + eps));
  }
}

template <class T>
void routing_forward(T* x, T* weights, const T* history, const T* inv_rms, const T* query,
                     const T* gain, int64_t N, int64_t d, int n_src, int H) {
  const int64_t hs = d / H;
#pragma omp parallel if (worth_parallel(N * d * n_src))
  {
    std::vector<double> s(n_src);
#pragma omp for
    for (int64_t n = 0; n < N; ++n)
      for (int h = 0; h < H; ++h) {
        double mx = -INFINITY;
        for (int i = 0; i < n_src; ++i) {
          const T* v = history + (int64_t(i) * N + n) * d + h * hs;
          double dot = 0;
          for (int64_t c = 0; c < hs; ++c) dot += double(query[h * hs + c]) * gain[h * hs + c] * v[c];
          s[i] = dot * inv_rms[int64_t(i) * N + n];
          mx = s[i] > mx ? s[i] : mx;
        }
        double sum = 0;
        for (int i = 0; i < n_src; ++i) sum += (s[i] = std::exp(s[i] - mx));
        T* w = weights + (n * H + h) * n_src;
        for (int i = 0; i < n_src; ++i) w[i] = T(s[i] / sum);
        T* xo = x + n * d + h * hs;
        for (int64_t c = 0; c < hs; ++c) {
          double acc = 0;
          for (int i = 0; i < n_src; ++i) acc += double(w[i]) * history[(int64_t(i) * N + n) * d + h * hs + c];
          xo[c] = T(acc);
        }
      }
  }
}

template <class T>
void routing_backward(T* dhistory, T* dquery, T* dgain, const T* dx, const T* history,
                      const T* inv_rms, const T* weights, const T* query, const T* gain,
                      int64_t N, int64_t d, int n_src, int H) {
  const int64_t hs = d / H;
  const int threads = omp_get_max_threads();
  // Per-thread partial sums for the site's query and gain: tokens run in parallel.
  std::vector<T> dq_part(size_t(threads) * d, T(0)), dg_part(size_t(threads) * d, T(0));
#pragma omp parallel if (worth_parallel(N * d * n_src))
  {
    T* dq = dq_part.data() + size_t(omp_get_thread_num()) * d;
    T* dg = dg_part.data() + size_t(omp_get_thread_num()) * d;
    std::vector<T> ds(size_t(n_src) * H);  // [i, h]
    std::vector<double> u(n_src);
#pragma omp for
    for (int64_t n = 0; n < N; ++n) {
      const T* g_n = dx + n * d;
      for (int h = 0; h < H; ++h) {
        const T* a = weights + (n * H + h) * n_src;
        double mean_u = 0;
        for (int i = 0; i < n_src; ++i) {
          const T* v = history + (int64_t(i) * N + n) * d + h * hs;
          double acc = 0;
          for (int64_t c = 0; c < hs; ++c) acc += double(g_n[h * hs + c]) * v[c];
          u[i] = acc;
          mean_u += double(a[i]) * acc;
        }
        for (int i = 0; i < n_src; ++i) ds[size_t(i) * H + h] = T(double(a[i]) * (u[i] - mean_u));
      }
      for (int i = 0; i < n_src; ++i) {
        const T* v = history + (int64_t(i) * N + n) * d;
        T* dv = dhistory + (int64_t(i) * N + n) * d;
        const T r = inv_rms[int64_t(i) * N + n];
        double wv = 0;  // sum_c w_i[c] v_i[c]
        for (int64_t c = 0; c < d; ++c) {
          const int h = int(c / hs);
          const T dsih = ds[size_t(i) * H + h];
          wv += double(dsih) * query[c] * gain[c] * v[c];
          dq[c] += dsih * gain[c] * v[c] * r;
          dg[c] += dsih * query[c] * v[c] * r;
        }
        const T radial = T(double(r) * r * r * wv / double(d));
        for (int64_t c = 0; c < d; ++c) {
          const int h = int(c / hs);
          const T a_ih = weights[(n * H + h) * n_src + i];
          const T w = ds[size_t(i) * H + h] * query[c] * gain[c];
          dv[c] += a_ih * g_n[c] + r * w - radial * v[c];
        }
      }
    }
  }
  for (int t = 0; t < threads; ++t)
    for (int64_t c = 0; c < d; ++c) {
      dquery[c] += dq_part[size_t(t) * d + c];
      dgain[c] += dg_part[size_t(t) * d + c];
    }
}

}  // namespace mhar::cpu
