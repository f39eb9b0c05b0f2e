// hyper.h: CPU reference of the Hyper-Connections stream ops (backend.h, DESIGN.md
// section 2). Streams are n contiguous [M] rows (M = N * d elements each); coefficient
// matrices are row-major, A_r[r * n + i] = the share of stream r in new stream i.
// Every element is accumulated in double and rounded once. With n = 1 and coefficients
// 1 each result is then exactly the sum the standard residual computes (x + y rounded
// once), which the n = 1 identity test relies on.
#pragma once
#include <cstdint>

#include "engine/cpu/parallel.h"

namespace mhar::cpu {

// x = sum_i c_i H[i]; c == nullptr: all ones.
template <class T>
void hyper_mix(T* x, const T* H, const T* c, int n, int64_t M) {
#pragma omp parallel for if (worth_parallel(M * n))
  for (int64_t e = 0; e < M; ++e) {
    double acc = 0;
    for (int i = 0; i < n; ++i) acc += (c ? double(c[i]) : 1.0) * double(H[i * M + e]);
    x[e] = T(acc);
  }
}

// dH[i] (+)= c_i dx; dc[i] += <dx, H[i]>. c == nullptr: ones, no dc.
template <class T>
void hyper_mix_backward(T* dH, T* dc, const T* dx, const T* H, const T* c, int n, int64_t M,
                        bool accumulate) {
  for (int i = 0; i < n; ++i) {
    const double ci = c ? double(c[i]) : 1.0;
    T* d = dH + i * M;
#pragma omp parallel for if (worth_parallel(M))
    for (int64_t e = 0; e < M; ++e)
      d[e] = T((accumulate ? double(d[e]) : 0.0) + ci * double(dx[e]));
    if (c && dc) {
      double g = 0;
      const T* h = H + i * M;
      for (int64_t e = 0; e < M; ++e) g += double(dx[e]) * double(h[e]);
      dc[i] = T(double(dc[i]) + g);
    }
  }
}

// out[i] = B_i v + sum_r A_r[r, i] in[r]
template <class T>
void hyper_update(T* out, const T* in, const T* v, const T* Ar, const T* B, int n, int64_t M) {
  for (int i = 0; i < n; ++i) {
    T* o = out + i * M;
#pragma omp parallel for if (worth_parallel(M * n))
    for (int64_t e = 0; e < M; ++e) {
      double acc = double(B[i]) * double(v[e]);
      for (int r = 0; r < n; ++r) acc += double(Ar[r * n + i]) * double(in[r * M + e]);
      o[e] = T(acc);
    }
  }
}

// din[r] = sum_i A_r[r, i] dout[i]; dv = sum_i B_i dout[i];
// dAr[r, i] += <dout[i], in[r]>; dB[i] += <dout[i], v>.
template <class T>
void hyper_update_backward(T* din, T* dv, T* dAr, T* dB, const T* dout, const T* in, const T* v,
                           const T* Ar, const T* B, int n, int64_t M) {
#pragma omp parallel for if (worth_parallel(M * n))
  for (int64_t e = 0; e < M; ++e) {
    double acc = 0;
    for (int i = 0; i < n; ++i) acc += double(B[i]) * double(dout[i * M + e]);
    dv[e] = T(acc);
  }
  for (int r = 0; r < n; ++r) {
    T* d = din + r * M;
#pragma omp parallel for if (worth_parallel(M * n))
    for (int64_t e = 0; e < M; ++e) {
      double acc = 0;
      for (int i = 0; i < n; ++i) acc += double(Ar[r * n + i]) * double(dout[i * M + e]);
      d[e] = T(acc);
    }
  }
  for (int i = 0; i < n; ++i) {
    const T* g = dout + i * M;
    double gb = 0;
    for (int64_t e = 0; e < M; ++e) gb += double(g[e]) * double(v[e]);
    dB[i] = T(double(dB[i]) + gb);
    for (int r = 0; r < n; ++r) {
      double ga = 0;
      const T* h = in + r * M;
      for (int64_t e = 0; e < M; ++e) ga += double(g[e]) * double(h[e]);
      dAr[r * n + i] = T(double(dAr[r * n + i]) + ga);
    }
  }
}

}  // namespace mhar::cpu
