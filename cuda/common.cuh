// common.cuh: shared device helpers for the CUDA backend's kernels (internal to cuda/).
// - Scalars: kernels are templated on storage types (__nv_bfloat16 or float) and do all
//   arithmetic in fp32: load() widens, store<T>() rounds to nearest even.
// - Dispatch: dispatch_float(dtype, f) calls f with a value of the matching storage type,
//   so one generic host lambda launches the right template instance; other dtypes fail
//   with a message naming the op. dispatch_int<Lo, Hi>(n, f) does the same for an int.
// - Warp reductions assume a full warp (32 active lanes).
// - Vectors of 8: the memory-bound kernels move 16-byte bf16x8 (or 2 x float4) vectors;
//   load8/store8 widen to / round from fp32 exactly as load()/store<T>() do per element,
//   so a vector path computes the same bits as the scalar one. The caller checks 16-byte
//   alignment (aligned16) and that the element offset is a multiple of 8.
#pragma once
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>
#include <type_traits>

#include "cuda/check.h"
#include "engine/tensor.h"

namespace mhar::cuda {

using bf16 = __nv_bfloat16;

__device__ __forceinline__ float load(float x) { return x; }
__device__ __forceinline__ float load(bf16 x) { return __bfloat162float(x); }

template <class T> __device__ __forceinline__ T store(float x);
template <> __device__ __forceinline__ float store<float>(float x) { return x; }
template <> __device__ __forceinline__ bf16 store<bf16>(float x) { return __float2bfloat16_rn(x); }
// What x reads back as once stored in T: the rounding an unfused op sequence does where it
// stores an intermediate (fused kernels that must give the sequence's bits apply it).
template <class T> __device__ __forceinline__ float stored(float x) { return load(store<T>(x)); }

// 2^x on the special-function unit, denormal inputs and results flushed to zero (exp2f
// and __expf add a fix-up of four instructions around the same instruction for denormal
// results). For probabilities and rescale factors (at most 1, summed with values near 1 or
// rounded to bf16), a result below 2^-126 is zero to every digit kept. fast_exp(x) is
// __expf's bits wherever the result is normal (the same multiply by float(log2 e)).
__device__ __forceinline__ float fast_exp2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
}
constexpr float kLog2e = 1.44269502f;  // float(log2 e)
__device__ __forceinline__ float fast_exp(float x) { return fast_exp2(x * kLog2e); }

// 8 consecutive elements <-> fp32 (p 16-byte aligned). bf16: one 16-byte access; the
// lower half of each 32-bit word is the lower-addressed element.
__device__ __forceinline__ void unpack8(const uint4& u, float (&f)[8]) {
  const uint32_t w[4] = {u.x, u.y, u.z, u.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    f[2 * i] = __uint_as_float(w[i] << 16);
    f[2 * i + 1] = __uint_as_float(w[i] & 0xffff0000u);
  }
}
__device__ __forceinline__ uint4 pack8(const float (&f)[8]) {
  uint32_t w[4];
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const __nv_bfloat162 h = __floats2bfloat162_rn(f[2 * i], f[2 * i + 1]);  // .x low half
    w[i] = *reinterpret_cast<const uint32_t*>(&h);
  }
  return make_uint4(w[0], w[1], w[2], w[3]);
}
// Two fp32 values as bf16 hi + lo parts, hi = bf16(x), lo = bf16(x - hi) (x to ~2^-16
// relative), each part a bf16x2 word (the low half the first value's): the fp32 operand
// of a bf16 mma as two mmas (routing's tensor-core kernels).
__device__ __forceinline__ void split_bf16x2(float x0, float x1, uint32_t& hi, uint32_t& lo) {
  const __nv_bfloat162 h = __floats2bfloat162_rn(x0, x1);
  const float2 hf = __bfloat1622float2(h);
  const __nv_bfloat162 l = __floats2bfloat162_rn(x0 - hf.x, x1 - hf.y);
  hi = *reinterpret_cast<const uint32_t*>(&h);
  lo = *reinterpret_cast<const uint32_t*>(&l);
}
__device__ __forceinline__ void load8(const bf16* p, float (&f)[8]) {
  unpack8(*reinterpret_cast<const uint4*>(p), f);
}
__device__ __forceinline__ void load8(const float* p, float (&f)[8]) {
  const float4 a = reinterpret_cast<const float4*>(p)[0], b = reinterpret_cast<const float4*>(p)[1];
  f[0] = a.x; f[1] = a.y; f[2] = a.z; f[3] = a.w;
  f[4] = b.x; f[5] = b.y; f[6] = b.z; f[7] = b.w;
}
__device__ __forceinline__ void store8(bf16* p, const float (&f)[8]) {
  *reinterpret_cast<uint4*>(p) = pack8(f);
}
__device__ __forceinline__ void store8(float* p, const float (&f)[8]) {
  reinterpret_cast<float4*>(p)[0] = make_float4(f[0], f[1], f[2], f[3]);
  reinterpret_cast<float4*>(p)[1] = make_float4(f[4], f[5], f[6], f[7]);
}

// The 32-bit shared-memory address of a pointer into shared memory (the operand of PTX's
// shared-memory instructions).
__device__ __forceinline__ uint32_t smem_addr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// Asks L2 to fetch [p, p + bytes) from device memory without waiting for it (sm_90's bulk
// prefetch; p and bytes multiples of 16): the memory-bound kernels issue it for their
// next step's rows, so that more bytes are in flight than their registers hold and the
// next step's loads hit L2. No effect on results.
__device__ __forceinline__ void prefetch_l2(const void* p, uint32_t bytes) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  // No "memory" clobber: a hint, so the compiler may move loads and stores across it.
  asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(p), "r"(bytes));
#else
  (void)p, (void)bytes;
#endif
}

// Asks L1 to fetch the 128-byte line holding p, without a register or a wait: for a load
// that must follow a dependent step but whose address is known now. No effect on results.
__device__ __forceinline__ void prefetch_l1(const void* p) {
  asm volatile("prefetch.global.L1 [%0];" ::"l"(p));
}

// RoPE's cos/sin (rope.cu; also the fused QK-norm + RoPE in norm.cu): inv_freq_i =
// base^i with base = theta^(-2/head_dim) from the host (fp64, by squaring), angle
// t * inv_freq in fp64 reduced to [-pi, pi], then fp32 sincosf. backward negates sin.
__device__ __forceinline__ double ipow(double base, int i) {
  double r = 1.0;
  while (i) {
    if (i & 1) r *= base;
    base *= base;
    i >>= 1;
  }
  return r;
}
__device__ __forceinline__ void rope_cos_sin(double inv_freq, int64_t t, bool backward,
                                             float& cs, float& sn) {
  constexpr double kTwoPi = 6.283185307179586476925286766559;
  const double a = double(t) * inv_freq;
  const double r = fma(-rint(a * (1.0 / kTwoPi)), kTwoPi, a);
  sincosf(float(r), &sn, &cs);
  if (backward) sn = -sn;
}

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

// Calls f(std::integral_constant<int, n>{}) for a run-time n in [Lo, Hi], so that a launch
// picks the instantiation of a kernel templated on that width or count; false, without a
// call, for any other n.
template <int Lo, int Hi, class F>
bool dispatch_int(int n, F&& f) {
  if constexpr (Lo > Hi) {
    return false;
  } else {
    if (n != Lo) return dispatch_int<Lo + 1, Hi>(n, f);
    f(std::integral_constant<int, Lo>{});
    return true;
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

inline bool aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15u) == 0; }

// A one-kernel lab choice (cross_entropy_set_version, embedding_backward_set_version): sets
// `current` to `version` (1 .. versions; 0 for `default_version`) and returns the version it
// replaces; any other value fails, naming `setter`, and sets nothing.
inline int set_lab_version(int& current, int version, int versions, int default_version,
                           const char* setter) {
  MHAR_CHECK(version >= 0 && version <= versions, setter, ": ", version,
             " (0 for the default, or 1 .. ", versions, ")");
  const int previous = current;
  current = version == 0 ? default_version : version;
  return previous;
}

// Blocks of `threads` threads of `kernel` resident per SM at once (the occupancy API),
// at least 1: sizes persistent grids that loop over their work.
template <class K> int resident_blocks_per_sm(K kernel, int threads, size_t smem = 0) {
  int n = 0;
  CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, kernel, threads, smem));
  return n < 1 ? 1 : n;
}
int sm_count();

// Enough blocks to fill the device a few times over for grid-stride loops.
int grid_stride_blocks(int64_t work_items, int threads);

}  // namespace mhar::cuda
