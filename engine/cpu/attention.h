// attention.h: CPU reference causal grouped-query attention.
// Layouts: q, out [B, T, Hq, hd]; k, v [B, T, Hkv, hd]; lse [B, Hq, T]. Query head h
// reads KV head h / (Hq/Hkv). Scale 1/sqrt(hd). The forward kernel also serves
// incremental decoding: with Tk >= Tq keys (a cached prefix, then the chunk's own), query
// t sits at position Tk - Tq + t and reads keys 0..Tk-Tq+t; Tk = Tq is the training case.
// The forward saves only the log-sum-exp (lse may be null when no backward follows);
// the backward recomputes the probabilities from it (as flash attention does):
//   p = exp(s - lse);  D_t = dout_t . out_t;  ds = p * (dout_t . v_u - D_t)
//   dq_t = scale * sum_u ds k_u;  dk_u += scale * ds q_t;  dv_u += p dout_t
// Work is split over (batch, KV head) so the dk/dv sums of a group never race.
#pragma once
#include "engine/cpu/parallel.h"
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

namespace mhar::cpu {

template <class T>
void attention_forward_offset(T* out, T* lse, const T* q, const T* k, const T* v, int64_t B,
                              int64_t Tq, int64_t Tk, int64_t Hq, int64_t Hkv, int64_t hd) {
  const int64_t group = Hq / Hkv, offset = Tk - Tq;
  const T scale = T(1.0 / std::sqrt(double(hd)));
#pragma omp parallel if (worth_parallel(B * Hq * Tq * Tk * hd))
  {
    std::vector<T> p(Tk);
#pragma omp for collapse(2)
    for (int64_t b = 0; b < B; ++b)
      for (int64_t h = 0; h < Hq; ++h) {
        const int64_t g = h / group;
        for (int64_t t = 0; t < Tq; ++t) {
          const int64_t last = offset + t;  // the query's own position
          const T* qt = q + ((b * Tq + t) * Hq + h) * hd;
          T mx = -std::numeric_limits<T>::infinity();
          for (int64_t u = 0; u <= last; ++u) {
            const T* ku = k + ((b * Tk + u) * Hkv + g) * hd;
            T s = 0;
            for (int64_t c = 0; c < hd; ++c) s += qt[c] * ku[c];
            p[u] = s * scale;
            if (p[u] > mx) mx = p[u];
          }
          T sum = 0;
          for (int64_t u = 0; u <= last; ++u) sum += (p[u] = std::exp(p[u] - mx));
          if (lse) lse[(b * Hq + h) * Tq + t] = mx + std::log(sum);
          T* ot = out + ((b * Tq + t) * Hq + h) * hd;
          std::memset(ot, 0, sizeof(T) * hd);
          for (int64_t u = 0; u <= last; ++u) {
            const T* vu = v + ((b * Tk + u) * Hkv + g) * hd;
            const T w = p[u] / sum;
            for (int64_t c = 0; c < hd; ++c) ot[c] += w * vu[c];
          }
        }
      }
  }
}

template <class T>
void attention_forward(T* out, T* lse, const T* q, const T* k, const T* v, int64_t B,
                       int64_t Tn, int64_t Hq, int64_t Hkv, int64_t hd) {
  attention_forward_offset(out, lse, q, k, v, B, Tn, Tn, Hq, Hkv, hd);
}

template <class T>
void attention_backward(T* dq, T* dk, T* dv, const T* dout, const T* q, const T* k, const T* v,
                        const T* out, const T* lse, int64_t B, int64_t Tn, int64_t Hq,
                        int64_t Hkv, int64_t hd) {
  const int64_t group = Hq / Hkv;
  const T scale = T(1.0 / std::sqrt(double(hd)));
#pragma omp parallel if (worth_parallel(B * Hq * Tn * Tn * hd))
  {
    std::vector<T> p(Tn), ds(Tn);
#pragma omp for collapse(2)
    for (int64_t b = 0; b < B; ++b)
      for (int64_t g = 0; g < Hkv; ++g) {
        for (int64_t t = 0; t < Tn; ++t) {
          std::memset(dk + ((b * Tn + t) * Hkv + g) * hd, 0, sizeof(T) * hd);
          std::memset(dv + ((b * Tn + t) * Hkv + g) * hd, 0, sizeof(T) * hd);
        }
        for (int64_t h = g * group; h < (g + 1) * group; ++h)
          for (int64_t t = 0; t < Tn; ++t) {
            const int64_t row = ((b * Tn + t) * Hq + h) * hd;
            const T* qt = q + row;
            const T* dot = dout + row;
            const T* ot = out + row;
            const T l = lse[(b * Hq + h) * Tn + t];
            T D = 0;
            for (int64_t c = 0; c < hd; ++c) D += dot[c] * ot[c];
            for (int64_t u = 0; u <= t; ++u) {
              const int64_t kv_row = ((b * Tn + u) * Hkv + g) * hd;
              T s = 0, dp = 0;
              for (int64_t c = 0; c < hd; ++c) {
                s += qt[c] * k[kv_row + c];
                dp += dot[c] * v[kv_row + c];
              }
              p[u] = std::exp(s * scale - l);
              ds[u] = p[u] * (dp - D);
            }
            T* dqt = dq + row;
            std::memset(dqt, 0, sizeof(T) * hd);
            for (int64_t u = 0; u <= t; ++u) {
              const int64_t kv_row = ((b * Tn + u) * Hkv + g) * hd;
              for (int64_t c = 0; c < hd; ++c) {
                dqt[c] += scale * ds[u] * k[kv_row + c];
                dk[kv_row + c] += scale * ds[u] * qt[c];
                dv[kv_row + c] += p[u] * dot[c];
              }
            }
          }
      }
  }
}

}  // namespace mhar::cpu
