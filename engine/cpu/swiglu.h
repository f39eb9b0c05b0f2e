// swiglu.h: CPU reference SwiGLU gate: h = silu(gate) * up, silu(z) = z * sigmoid(z), on
// the stacked gate/up projection's output gate_up [rows, 2F] (row i = [gate_i | up_i]).
// Backward: dgate = dh * up * sigmoid(z) * (1 + z * (1 - sigmoid(z))), dup = dh * silu(z),
// written in gate_up's layout, and h again (the forward's expression, so the same bits)
// where h is not null.
#pragma once
#include "engine/cpu/parallel.h"
#include <cmath>
#include <cstdint>

namespace mhar::cpu {

template <class T>
T swiglu_h(T z, T u) {
  return z * (T(1) / (T(1) + std::exp(-z))) * u;
}

template <class T>
void swiglu_forward(T* h, const T* gate_up, int64_t rows, int64_t F) {
#pragma omp parallel for if (worth_parallel(rows * F))
  for (int64_t r = 0; r < rows; ++r) {
    const T* g = gate_up + r * 2 * F;
    for (int64_t i = 0; i < F; ++i) h[r * F + i] = swiglu_h(g[i], g[F + i]);
  }
}

template <class T>
void swiglu_backward(T* d_gate_up, T* h, const T* dh, const T* gate_up, int64_t rows, int64_t F) {
#pragma omp parallel for if (worth_parallel(rows * F))
  for (int64_t r = 0; r < rows; ++r) {
    const T* g = gate_up + r * 2 * F;
    T* dg = d_gate_up + r * 2 * F;
    for (int64_t i = 0; i < F; ++i) {
      const T z = g[i], u = g[F + i], d = dh[r * F + i];
      const T sig = T(1) / (T(1) + std::exp(-z));
      dg[i] = d * u * sig * (T(1) + z * (T(1) - sig));
      dg[F + i] = d * z * sig;
      if (h) h[r * F + i] = swiglu_h(z, u);
    }
  }
}

}  // namespace mhar::cpu
