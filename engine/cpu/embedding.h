// embedding.h: CPU reference token embedding. out [N, d] = table [V, d] rows picked by
// tokens [N]; the backward scatters rows of dout back into dtable (+=). Token ids were
// validated by the data loader; an id outside [0, V) here is an engine bug.
#pragma once
#include "engine/cpu/parallel.h"
#include <cstdint>
#include <cstring>

#include "engine/error.h"

namespace mhar::cpu {

template <class T>
void embedding_forward(T* out, const int32_t* tokens, const T* table, int64_t N, int64_t V,
                       int64_t d) {
  // Checked before the parallel loop: an exception must not escape an OpenMP region.
  for (int64_t n = 0; n < N; ++n)
    MHAR_CHECK(tokens[n] >= 0 && tokens[n] < V, "token id ", tokens[n], " outside [0, ", V, ")");
#pragma omp parallel for if (worth_parallel(N * d))
  for (int64_t n = 0; n < N; ++n) {
    std::memcpy(out + n * d, table + int64_t(tokens[n]) * d, sizeof(T) * d);
  }
}

// Serial over tokens: two rows of the same id accumulate into the same row of dtable.
template <class T>
void embedding_backward(T* dtable, const T* dout, const int32_t* tokens, int64_t N, int64_t d) {
  for (int64_t n = 0; n < N; ++n) {
    T* row = dtable + int64_t(tokens[n]) * d;
    const T* g = dout + n * d;
    for (int64_t c = 0; c < d; ++c) row[c] += g[c];
  }
}

}  // namespace mhar::cpu
