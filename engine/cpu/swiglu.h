// swiglu.h: CPU reference SwiGLU gate: h = silu(gate) * up, silu(z) = z * sigmoid(z).
// Backward: dgate = dh * up * sigmoid(z) * (1 + z * (1 - sigmoid(z))), dup = dh * silu(z),
// and h again (the forward's expression, so the same bits) where h is not null.
#pragma once
#include "engine/cpu/parallel.h"
#include <cmath>
#include <cstdint>

namespace mhar::cpu {

template <class T>
void swiglu_forward(T* h, const T* gate, const T* up, int64_t n) {
#pragma omp parallel for if (worth_parallel(n))
  for (int64_t i = 0; i < n; ++i) {
    T z = gate[i];
    T sig = T(1) / (T(1) + std::exp(-z));
    h[i] = z * sig * up[i];
  }
}

template <class T>
void swiglu_backward(T* dgate, T* dup, T* h, const T* dh, const T* gate, const T* up, int64_t n) {
#pragma omp parallel for if (worth_parallel(n))
  for (int64_t i = 0; i < n; ++i) {
    T z = gate[i];
    T sig = T(1) / (T(1) + std::exp(-z));
    dgate[i] = dh[i] * up[i] * sig * (T(1) + z * (T(1) - sig));
    dup[i] = dh[i] * z * sig;
    if (h) h[i] = z * sig * up[i];
  }
}

}  // namespace mhar::cpu
