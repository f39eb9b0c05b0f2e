// check.h: error checking for CUDA runtime, cuBLAS and kernel launches. Every CUDA call
// in cuda/ goes through one of these macros; a failure throws mhar::Error naming the
// call, the file and line, and the library's own message.
#pragma once
#include <cublas_v2.h>
#include <cuda_runtime.h>

#include "engine/error.h"

#define CUDA_CHECK(call)                                                                  \
  do {                                                                                    \
    cudaError_t err_ = (call);                                                            \
    if (err_ != cudaSuccess)                                                              \
      ::mhar::fail("CUDA error in ", #call, " at ", __FILE__, ":", __LINE__, ": ",        \
                   cudaGetErrorString(err_));                                             \
  } while (0)

#define CUBLAS_CHECK(call)                                                                \
  do {                                                                                    \
    cublasStatus_t st_ = (call);                                                          \
    if (st_ != CUBLAS_STATUS_SUCCESS)                                                     \
      ::mhar::fail("cuBLAS error in ", #call, " at ", __FILE__, ":", __LINE__, ": ",      \
                   cublasGetStatusString(st_));                                           \
  } while (0)

// After a kernel launch: catches bad launch configurations immediately.
#define CUDA_CHECK_LAUNCH() CUDA_CHECK(cudaGetLastError())
