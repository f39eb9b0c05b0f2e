// rmsnorm.h: CPU reference RMSNorm over the last dimension of x [R, D] with a learned
// weight [D]: y = x * rstd * w, rstd = 1/sqrt(mean(x^2) + eps), saved for the backward.
// Also used for the per-head QK-norm with R = tokens * heads, D = head_dim.
// Backward, with xhat = x * rstd:
//   dw += sum_r dy * xhat
//   dx  = rstd * (dy*w - xhat * mean(dy*w*xhat))
#pragma once
#include "engine/cpu/parallel.h"
#include <cmath>
#include <cstdint>
#include <vector>

#include <omp.h>

namespace mhar::cpu {

template <class T>
void rmsnorm_forward(T* y, T* rstd, const T* x, const T* w, int64_t R, int64_t D, double eps) {
#pragma omp parallel for if (worth_parallel(R * D))
  for (int64_t r = 0; r < R; ++r) {
    const T* xr = x + r * D;
    double ss = 0;
    for (int64_t c = 0; c < D; ++c) ss += double(xr[c]) * xr[c];
    T s = T(1.0 / std::sqrt(ss / D + eps));
    rstd[r] = s;
    T* yr = y + r * D;
    for (int64_t c = 0; c < D; ++c) yr[c] = xr[c] * s * w[c];
  }
}

template <class T>
void rmsnorm_backward(T* dx, T* dw, const T* dy, const T* x, const T* w, const T* rstd,
                      int64_t R, int64_t D, bool accumulate_dx) {
  const int threads = omp_get_max_threads();
  std::vector<T> dw_partial(size_t(threads) * D, T(0));  // per-thread, no races on dw
#pragma omp parallel if (worth_parallel(R * D))
  {
    T* my_dw = dw_partial.data() + size_t(omp_get_thread_num()) * D;
#pragma omp for
    for (int64_t r = 0; r < R; ++r) {
      const T* xr = x + r * D;
      const T* gr = dy + r * D;
      const T s = rstd[r];
      double dot = 0;  // sum_c dy*w*xhat
      for (int64_t c = 0; c < D; ++c) {
        T xhat = xr[c] * s;
        dot += double(gr[c]) * w[c] * xhat;
        my_dw[c] += gr[c] * xhat;
      }
      const T mean = T(dot / D);
      T* dxr = dx + r * D;
      for (int64_t c = 0; c < D; ++c) {
        T v = s * (gr[c] * w[c] - xr[c] * s * mean);
        dxr[c] = accumulate_dx ? dxr[c] + v : v;
      }
    }
  }
  for (int t = 0; t < threads; ++t)
    for (int64_t c = 0; c < D; ++c) dw[c] += dw_partial[size_t(t) * D + c];
}

}  // namespace mhar::cpu
