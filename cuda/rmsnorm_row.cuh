// rmsnorm_row.cuh: the RMSNorm forward's arithmetic on a row held in lanes, shared by
// norm.cu's vector kernel and the kernels that fuse the norm into their own last pass
// (routing_mix.cu's mix finish, store_row_normed), which must give rmsnorm_forward's bits.
// Sharing the code fixes what decides those bits: each lane adds its chunks' squares in
// element order, chunk after chunk, the lanes of a row add by one xor butterfly, rstd =
// rsqrtf(sum / d + eps), and y = (x rstd) w, rounded once when stored.
#pragma once
#include "cuda/common.cuh"

namespace mhar::cuda {

// The sum of v over a group of TPR lanes (8, 16 or 32: a shuffle group inside the warp),
// by an xor butterfly: every lane of the group gets the same bits.
template <int TPR>
__device__ __forceinline__ float group_sum(float v) {
#pragma unroll
  for (int o = TPR / 2; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

// acc += the squares of a chunk's 8 bf16 values, in element order.
__device__ __forceinline__ void add_squares8(float& acc, const uint4& chunk) {
  float f[8];
  unpack8(chunk, f);
#pragma unroll
  for (int e = 0; e < 8; ++e) acc += f[e] * f[e];
}

// The reciprocal RMS of a row of d values whose squares sum to sum_sq.
__device__ __forceinline__ float rms_rstd(float sum_sq, int d, float eps) {
  return rsqrtf(sum_sq / float(d) + eps);
}

// A chunk's x (in f) normed in place: f = (x rstd) w.
__device__ __forceinline__ void norm_chunk8(float (&f)[8], float rstd, const float (&w)[8]) {
#pragma unroll
  for (int e = 0; e < 8; ++e) f[e] = f[e] * rstd * w[e];
}

}  // namespace mhar::cuda
