// matmul.h: CPU reference matrix product through OpenBLAS, row-major:
// C [M, N] = op(A) op(B) (beta = 1 when accumulating). float and double dispatch to
// sgemm and dgemm, so the fp64 gradient checks run the same code path.
#pragma once
#include <cblas.h>

#include <cstdint>

namespace mhar::cpu {

inline void gemm(bool ta, bool tb, int64_t M, int64_t N, int64_t K, const float* A, int64_t lda,
                 const float* B, int64_t ldb, float beta, float* C, int64_t ldc) {
  cblas_sgemm(CblasRowMajor, ta ? CblasTrans : CblasNoTrans, tb ? CblasTrans : CblasNoTrans,
              int(M), int(N), int(K), 1.0f, A, int(lda), B, int(ldb), beta, C, int(ldc));
}

inline void gemm(bool ta, bool tb, int64_t M, int64_t N, int64_t K, const double* A,
                 int64_t lda, const double* B, int64_t ldb, double beta, double* C, int64_t ldc) {
  cblas_dgemm(CblasRowMajor, ta ? CblasTrans : CblasNoTrans, tb ? CblasTrans : CblasNoTrans,
              int(M), int(N), int(K), 1.0, A, int(lda), B, int(ldb), beta, C, int(ldc));
}

}  // namespace mhar::cpu
