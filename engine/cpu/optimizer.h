// optimizer.h: CPU reference AdamW step and sum of squares (for the global gradient
// norm). The CPU backend keeps no separate master copy: the parameter is the master.
#pragma once
#include "engine/cpu/parallel.h"
#include <cmath>
#include <cstdint>

namespace mhar::cpu {

template <class T>
double sum_squares(const T* x, int64_t n) {
  double s = 0;
#pragma omp parallel for reduction(+ : s) if (worth_parallel(n))
  for (int64_t i = 0; i < n; ++i) s += double(x[i]) * double(x[i]);
  return s;
}

template <class T>
void adamw(T* w, const T* grad, T* m, T* v, int64_t n, double lr, double b1, double b2,
           double eps, double wd, double grad_scale, long long step) {
  const double c1 = 1.0 - std::pow(b1, double(step)), c2 = 1.0 - std::pow(b2, double(step));
#pragma omp parallel for if (worth_parallel(n))
  for (int64_t i = 0; i < n; ++i) {
    const double g = double(grad[i]) * grad_scale;
    const double mi = b1 * double(m[i]) + (1 - b1) * g;
    const double vi = b2 * double(v[i]) + (1 - b2) * g * g;
    m[i] = T(mi);
    v[i] = T(vi);
    const double update = (mi / c1) / (std::sqrt(vi / c2) + eps) + wd * double(w[i]);
    w[i] = T(double(w[i]) - lr * update);
  }
}

}  // namespace mhar::cpu
