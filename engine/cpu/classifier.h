// classifier.h: CPU reference softmax cross-entropy over logits [N, V].
// losses[n] = logsumexp(logits[n]) - logits[n, target]; with compute_grad the logits row
// is overwritten by grad_scale * (softmax - onehot(target)), the gradient of
// grad_scale * sum_n losses[n]. Sums run in double so fp32 rows of 150k entries stay exact
// to rounding.
#pragma once
#include "engine/cpu/parallel.h"
#include <cmath>
#include <cstdint>

#include "engine/error.h"

namespace mhar::cpu {

template <class T>
void cross_entropy(T* losses, T* logits, const int32_t* targets, int64_t N, int64_t V,
                   double grad_scale, bool compute_grad) {
  for (int64_t n = 0; n < N; ++n)
    MHAR_CHECK(targets[n] >= 0 && targets[n] < V, "target ", targets[n], " outside [0, ", V, ")");
#pragma omp parallel for if (worth_parallel(N * V))
  for (int64_t n = 0; n < N; ++n) {
    T* row = logits + n * V;
    double mx = row[0];
    for (int64_t c = 1; c < V; ++c) mx = row[c] > mx ? double(row[c]) : mx;
    double sum = 0;
    for (int64_t c = 0; c < V; ++c) sum += std::exp(double(row[c]) - mx);
    const double lse = mx + std::log(sum);
    losses[n] = T(lse - double(row[targets[n]]));
    if (!compute_grad) continue;
    for (int64_t c = 0; c < V; ++c) row[c] = T(grad_scale * std::exp(double(row[c]) - lse));
    row[targets[n]] -= T(grad_scale);
  }
}

}  // namespace mhar::cpu
