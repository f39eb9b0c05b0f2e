// hyper.h: CPU reference of the Hyper-Connections stream ops (backend.h, DESIGN.md
// section 2), static and dynamic (per-token coefficients, at the end). Streams are n contiguous [M] rows (M = N * d elements each); coefficient
// matrices are row-major, A_r[r * n + i] = the share of stream r in new stream i.
// Every element is accumulated in double and rounded once. With n = 1 and coefficients
// 1 each result is then exactly the sum the standard residual computes (x + y rounded
// once), which the n = 1 identity test relies on.
#pragma once
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

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

// ---- Dynamic Hyper-Connections (residual.hyper_dynamic). Per token t and stream r,
// Q = n + 2 coefficient columns: c = 0 the mix (A_m[r]), c = 1..n the update's row
// (A_r[r, c-1]), c = n+1 the output's share (B[r]). C, T [N, n, Q]; rstd [N, n].
//   hbar = h_r[t] * rstd[t, r],  rstd = 1 / sqrt(mean_c h_r[t, c]^2 + eps)
//   T[t, r, c] = tanh(hbar . W[:, c])     (W [d, Q] row-major)
//   C[t, r, c] = base_c + s_c T[t, r, c]  (s_c = s_a for c <= n, s_b for c = n + 1)
template <class T>
void hyper_dynamic_coef(T* C, T* Tt, T* rstd, const T* H, const T* W, const T* Am, const T* Ar,
                        const T* B, T sa, T sb, int n, int64_t N, int64_t d, double eps) {
  const int Q = n + 2;
  const int64_t M = N * d;
#pragma omp parallel for if (worth_parallel(M * n))
  for (int64_t t = 0; t < N; ++t) {
    std::vector<double> z(static_cast<size_t>(Q));
    for (int r = 0; r < n; ++r) {
      const T* h = H + r * M + t * d;
      double ss = 0;
      for (int64_t c = 0; c < d; ++c) ss += double(h[c]) * double(h[c]);
      const double rs = 1.0 / std::sqrt(ss / double(d) + eps);
      rstd[t * n + r] = T(rs);
      std::fill(z.begin(), z.end(), 0.0);
      for (int64_t c = 0; c < d; ++c) {
        const double hb = double(h[c]) * rs;
        for (int q = 0; q < Q; ++q) z[size_t(q)] += hb * double(W[c * Q + q]);
      }
      T* ct = C + (t * n + r) * Q;
      T* tt = Tt + (t * n + r) * Q;
      for (int q = 0; q < Q; ++q) {
        const double th = std::tanh(z[size_t(q)]);
        tt[q] = T(th);
        const double base = q == 0 ? double(Am[r]) : q <= n ? double(Ar[r * n + q - 1]) : double(B[r]);
        ct[q] = T(base + (q <= n ? double(sa) : double(sb)) * th);
      }
    }
  }
}

// x[t] = sum_r C[t, r, 0] h_r[t]
template <class T>
void hyper_mix_dynamic(T* x, const T* H, const T* C, int n, int64_t N, int64_t d) {
  const int Q = n + 2;
  const int64_t M = N * d;
#pragma omp parallel for if (worth_parallel(M * n))
  for (int64_t t = 0; t < N; ++t)
    for (int64_t c = 0; c < d; ++c) {
      double acc = 0;
      for (int r = 0; r < n; ++r) acc += double(C[(t * n + r) * Q]) * double(H[r * M + t * d + c]);
      x[t * d + c] = T(acc);
    }
}

// dH_r[t] += C[t, r, 0] dx[t];  dC[t, r, 0] = <dx[t], h_r[t]>
template <class T>
void hyper_mix_dynamic_backward(T* dH, T* dC, const T* dx, const T* H, const T* C, int n,
                                int64_t N, int64_t d) {
  const int Q = n + 2;
  const int64_t M = N * d;
#pragma omp parallel for if (worth_parallel(M * n))
  for (int64_t t = 0; t < N; ++t)
    for (int r = 0; r < n; ++r) {
      const double cr = double(C[(t * n + r) * Q]);
      double g = 0;
      for (int64_t c = 0; c < d; ++c) {
        const int64_t e = r * M + t * d + c;
        g += double(dx[t * d + c]) * double(H[e]);
        dH[e] = T(double(dH[e]) + cr * double(dx[t * d + c]));
      }
      dC[(t * n + r) * Q] = T(g);
    }
}

// out_i[t] = C[t, i, n+1] v[t] + sum_r C[t, r, 1+i] in_r[t]
template <class T>
void hyper_update_dynamic(T* out, const T* in, const T* v, const T* C, int n, int64_t N,
                          int64_t d) {
  const int Q = n + 2;
  const int64_t M = N * d;
#pragma omp parallel for if (worth_parallel(M * n))
  for (int64_t t = 0; t < N; ++t)
    for (int i = 0; i < n; ++i)
      for (int64_t c = 0; c < d; ++c) {
        double acc = double(C[(t * n + i) * Q + n + 1]) * double(v[t * d + c]);
        for (int r = 0; r < n; ++r)
          acc += double(C[(t * n + r) * Q + 1 + i]) * double(in[r * M + t * d + c]);
        out[i * M + t * d + c] = T(acc);
      }
}

// din_r[t] = sum_i C[t, r, 1+i] dout_i[t];  dv[t] = sum_i C[t, i, n+1] dout_i[t];
// dC[t, r, 1+i] = <dout_i[t], in_r[t]>;  dC[t, i, n+1] = <dout_i[t], v[t]>
template <class T>
void hyper_update_dynamic_backward(T* din, T* dv, T* dC, const T* dout, const T* in, const T* v,
                                   const T* C, int n, int64_t N, int64_t d) {
  const int Q = n + 2;
  const int64_t M = N * d;
#pragma omp parallel for if (worth_parallel(M * n))
  for (int64_t t = 0; t < N; ++t) {
    for (int64_t c = 0; c < d; ++c) {
      double acc = 0;
      for (int i = 0; i < n; ++i)
        acc += double(C[(t * n + i) * Q + n + 1]) * double(dout[i * M + t * d + c]);
      dv[t * d + c] = T(acc);
      for (int r = 0; r < n; ++r) {
        double a = 0;
        for (int i = 0; i < n; ++i)
          a += double(C[(t * n + r) * Q + 1 + i]) * double(dout[i * M + t * d + c]);
        din[r * M + t * d + c] = T(a);
      }
    }
    for (int i = 0; i < n; ++i) {
      const T* g = dout + i * M + t * d;
      double gb = 0;
      for (int64_t c = 0; c < d; ++c) gb += double(g[c]) * double(v[t * d + c]);
      dC[(t * n + i) * Q + n + 1] = T(gb);
      for (int r = 0; r < n; ++r) {
        const T* h = in + r * M + t * d;
        double ga = 0;
        for (int64_t c = 0; c < d; ++c) ga += double(g[c]) * double(h[c]);
        dC[(t * n + r) * Q + 1 + i] = T(ga);
      }
    }
  }
}

// The coefficients' backward, from dC (every column written by the two ops above):
//   dA_m[r] += sum_t dC[t,r,0], dA_r[r,i] += sum_t dC[t,r,1+i], dB[r] += sum_t dC[t,r,n+1]
//   ds_a += sum dC T over c <= n, ds_b += sum dC T over c = n + 1
//   dz = dC s_c (1 - T^2);  dW[:, c] += sum_{t,r} hbar dz_c;  dhbar = sum_c dz_c W[:, c]
//   dh_r += rstd (dhbar - hbar mean(dhbar hbar))     (RMSNorm without scale)
// Sums over tokens in double, serially in token order (deterministic).
template <class T>
void hyper_dynamic_coef_backward(T* dH, T* dW, T* dAm, T* dAr, T* dB, T* dsa, T* dsb,
                                 const T* dC, const T* H, const T* W, const T* Tt,
                                 const T* rstd, T sa, T sb, int n, int64_t N, int64_t d) {
  const int Q = n + 2;
  const int64_t M = N * d;
  std::vector<double> gW(size_t(d * Q), 0.0), gbase(size_t(n * Q), 0.0), dz(static_cast<size_t>(Q)),
      dhb(static_cast<size_t>(d));
  double gsa = 0, gsb = 0;
  for (int64_t t = 0; t < N; ++t)
    for (int r = 0; r < n; ++r) {
      const T* h = H + r * M + t * d;
      const double rs = double(rstd[t * n + r]);
      for (int q = 0; q < Q; ++q) {
        const double g = double(dC[(t * n + r) * Q + q]), th = double(Tt[(t * n + r) * Q + q]);
        const double s = q <= n ? double(sa) : double(sb);
        gbase[size_t(r * Q + q)] += g;
        (q <= n ? gsa : gsb) += g * th;
        dz[size_t(q)] = g * s * (1 - th * th);
      }
      double dot = 0;
      for (int64_t c = 0; c < d; ++c) {
        const double hb = double(h[c]) * rs;
        double a = 0;
        for (int q = 0; q < Q; ++q) {
          gW[size_t(c * Q + q)] += hb * dz[size_t(q)];
          a += dz[size_t(q)] * double(W[c * Q + q]);
        }
        dhb[size_t(c)] = a;
        dot += a * hb;
      }
      dot /= double(d);
      T* g = dH + r * M + t * d;
      for (int64_t c = 0; c < d; ++c)
        g[c] = T(double(g[c]) + rs * (dhb[size_t(c)] - double(h[c]) * rs * dot));
    }
  for (int64_t e = 0; e < d * Q; ++e) dW[e] = T(double(dW[e]) + gW[size_t(e)]);
  for (int r = 0; r < n; ++r) {
    dAm[r] = T(double(dAm[r]) + gbase[size_t(r * Q)]);
    for (int i = 0; i < n; ++i)
      dAr[r * n + i] = T(double(dAr[r * n + i]) + gbase[size_t(r * Q + 1 + i)]);
    dB[r] = T(double(dB[r]) + gbase[size_t(r * Q + n + 1)]);
  }
  dsa[0] = T(double(dsa[0]) + gsa);
  dsb[0] = T(double(dsb[0]) + gsb);
}

}  // namespace mhar::cpu
