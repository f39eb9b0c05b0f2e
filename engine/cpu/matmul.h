// matmul.h: CPU reference matrix product through OpenBLAS, row-major:
// C [M, N] = op(A) op(B) (beta = 1 when accumulating). float and double dispatch to
// sgemm and dgemm, so the fp64 gradient checks run the same code path.
#pragma once
#include <cblas.h>

#include <omp.h>

#include <cstdint>

#include "engine/cpu/parallel.h"

extern "C" void openblas_set_num_threads(int);

namespace mhar::cpu {

// OpenBLAS's thread team costs more than it saves on small products, and on a loaded
// machine its spinning threads can slow them a hundredfold, so small products run on one
// thread. Called from the (single) thread that drives the backend.
inline void gemm_threads_for(int64_t M, int64_t N, int64_t K) {
  static int current = -1;
  const int want = worth_parallel(M * N * K / 64) ? omp_get_max_threads() : 1;
  if (want != current) openblas_set_num_threads(current = want);
}

inline void gemm(bool ta, bool tb, int64_t M, int64_t N, int64_t K, const float* A, int64_t lda,
                 const float* B, int64_t ldb, float beta, float* C, int64_t ldc) {
  gemm_threads_for(M, N, K);
  cblas_sgemm(CblasRowMajor, ta ? CblasTrans : CblasNoTrans, tb ? CblasTrans : CblasNoTrans,
              int(M), int(N), int(K), 1.0f, A, int(lda), B, int(ldb), beta, C, int(ldc));
}

inline void gemm(bool ta, bool tb, int64_t M, int64_t N, int64_t K, const double* A,
                 int64_t lda, const double* B, int64_t ldb, double beta, double* C, int64_t ldc) {
  gemm_threads_for(M, N, K);
  cblas_dgemm(CblasRowMajor, ta ? CblasTrans : CblasNoTrans, tb ? CblasTrans : CblasNoTrans,
              int(M), int(N), int(K), 1.0, A, int(lda), B, int(ldb), beta, C, int(ldc));
}

}  // namespace mhar::cpu
