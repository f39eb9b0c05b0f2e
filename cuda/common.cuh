// common.cuh: shared device helpers for the CUDA backend's kernels (internal to cuda/).
// - Scalars: kernels are templated on storage types (__nv_bfloat16 or float) and do all
//   arithmetic in fp32: load() widens, store<T>() rounds to nearest even.
// - Dispatch: dispatch_float(dtype, f) calls f with a value of the matching storage type,
//   so one generic host lambda launches the right template instance; other dtypes fail
//   with a message naming the op.
// - Warp reductions assume a full warp (32 active lanes).
#pragma once
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>

#include "cuda/check.h"
#include "engine/tensor.h"

namespace mhar::cuda {

using bf16 = __nv_bfloat16;

__device__ __forceinline__ float load(float x) { return x; }
__device__ __forceinline__ float load(bf16 x) { return __bfloat162float(x); }

template <class T> __device__ __forceinline__ T store(float x);
template <> __device__ __forceinline__ float store<float>(float x) { return x; }
template <> __device__ __forceinline__ bf16 store<bf16>(float x) { return __float2bfloat16_rn(x); }

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}
__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}
__device__ __forceinline__ double warp_sum(double v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

// Sum of v over the block, valid in thread 0 (warp sums, then warp 0 sums those in
// warp order: a fixed order, so the same bits every run). blockDim.x a multiple of 32;
// every thread must call it, once per kernel (its shared array is not reset for reuse).
template <class T>
__device__ __forceinline__ T block_sum(T v) {
  __shared__ T warp_sums[32];
  v = warp_sum(v);
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  if (lane == 0) warp_sums[warp] = v;
  __syncthreads();
  if (warp == 0) v = warp_sum(lane < int(blockDim.x >> 5) ? warp_sums[lane] : T(0));
  return v;
}

__host__ __device__ inline int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// Calls f(T{}) with T the storage type of dtype (BF16 or F32).
template <class F> void dispatch_float(DType t, const char* what, F&& f) {
  switch (t) {
    case DType::BF16: f(bf16{}); return;
    case DType::F32: f(float{}); return;
    default: ::mhar::fail("CUDA ", what, ": unsupported dtype ", dtype_name(t), " (BF16 or F32)");
  }
}

inline void check_dtype(const Tensor& t, DType want, const char* what, const char* name) {
  if (t.dtype != want)
    ::mhar::fail("CUDA ", what, ": ", name, " is ", dtype_name(t.dtype), ", expected ",
                 dtype_name(want));
}
inline void check_numel(const Tensor& t, int64_t n, const char* what, const char* name) {
  if (t.numel() != n)
    ::mhar::fail("CUDA ", what, ": ", name, " has ", t.numel(), " elements ", t.shape_str(),
                 ", expected ", n);
}

// Enough blocks to fill the device a few times over for grid-stride loops.
int grid_stride_blocks(int64_t work_items, int threads);

}  // namespace mhar::cuda
