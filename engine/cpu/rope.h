// rope.h: CPU reference rotary position embedding, in place on x [B, T, heads, hd],
// Hugging Face's rotate-half layout: feature i pairs with i + hd/2, angle p * theta^(-2i/hd)
// where p = first_position + t (first_position > 0 only in incremental decoding, where a
// chunk continues a cached prefix).
// The rotation is orthogonal, so the backward is the inverse rotation (angle negated).
// Angles are computed in double whatever T is, so fp32 and fp64 runs see the same cos/sin.
#pragma once
#include "engine/cpu/parallel.h"
#include <cmath>
#include <cstdint>

namespace mhar::cpu {

template <class T>
void rope_at(T* x, int64_t B, int64_t Tn, int64_t heads, int64_t hd, double theta,
             bool inverse, int64_t first_position) {
  const int64_t half = hd / 2;
#pragma omp parallel for collapse(2) if (worth_parallel(B * Tn * heads * hd))
  for (int64_t b = 0; b < B; ++b)
    for (int64_t t = 0; t < Tn; ++t)
      for (int64_t i = 0; i < half; ++i) {
        double inv_freq = std::pow(theta, -2.0 * double(i) / double(hd));
        double angle = double(first_position + t) * inv_freq;
        T c = T(std::cos(angle)), s = T(inverse ? -std::sin(angle) : std::sin(angle));
        for (int64_t h = 0; h < heads; ++h) {
          T* row = x + ((b * Tn + t) * heads + h) * hd;
          T x1 = row[i], x2 = row[i + half];
          row[i] = x1 * c - x2 * s;
          row[i + half] = x2 * c + x1 * s;
        }
      }
}

template <class T>
void rope(T* x, int64_t B, int64_t Tn, int64_t heads, int64_t hd, double theta, bool inverse) {
  rope_at(x, B, Tn, heads, hd, theta, inverse, 0);
}

}  // namespace mhar::cpu
