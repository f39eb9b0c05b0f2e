// delta.h: CPU reference of the delta-mode ops (backend.h, DESIGN.md section 2): the gated
// add of the routed term, its backward, and the null source's broadcast and column sum.
// Every element is computed in double and rounded once, so with alpha = 0 the gated add
// returns base exactly (base + 0 * r, r finite): the conversion identity rests on it.
#pragma once
#include <cstdint>

#include "engine/cpu/parallel.h"

namespace mhar::cpu {

// x = base + alpha r
template <class T>
void delta_gate(T* x, const T* base, double alpha, const T* r, int64_t M) {
#pragma omp parallel for if (worth_parallel(M))
  for (int64_t e = 0; e < M; ++e) x[e] = T(double(base[e]) + alpha * double(r[e]));
}

// dr = alpha dx; returns sum dx r (in a fixed order: deterministic)
template <class T>
double delta_gate_backward(T* dr, const T* dx, const T* r, double alpha, int64_t M) {
  double g = 0;
  for (int64_t e = 0; e < M; ++e) {
    dr[e] = T(alpha * double(dx[e]));
    g += double(dx[e]) * double(r[e]);
  }
  return g;
}

// out[n, :] = row
template <class T>
void delta_null_forward(T* out, const T* row, int64_t N, int64_t d) {
#pragma omp parallel for if (worth_parallel(N * d))
  for (int64_t n = 0; n < N; ++n)
    for (int64_t c = 0; c < d; ++c) out[n * d + c] = row[c];
}

// drow += sum_n dout[n, :]
template <class T>
void delta_null_backward(T* drow, const T* dout, int64_t N, int64_t d) {
#pragma omp parallel for if (worth_parallel(N * d))
  for (int64_t c = 0; c < d; ++c) {
    double s = 0;
    for (int64_t n = 0; n < N; ++n) s += double(dout[n * d + c]);
    drow[c] = T(double(drow[c]) + s);
  }
}

}  // namespace mhar::cpu
