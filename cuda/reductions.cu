// reductions.cu: elementwise add, in-place accumulate, and the sum of squares behind the
// global gradient norm.
// - add: out = a + b (overwritten; any mix of BF16/F32 storage, fp32 math).
// - add_inplace: y += x (y and x may differ in dtype, e.g. fp32 y += bf16 x).
// - sum_squares: fp64 per-thread and per-block sums (a billion fp32 squares stay exact to
//   rounding; each square of an fp32 value is exact in fp64), each block's sum into its
//   own slot of device scratch, then one block adds the slots in slot order and the result
//   is copied to the host: synchronises the stream. The grid is a fixed function of n and
//   the device (the blocks that fit at once), so the sum's order, and its bits, are the
//   same every run (a per-block fp64 atomic, before, added the blocks in arrival order).
//   Bytes it must move: the tensor, once (4.8 GB of fp32 gradients at 1B, ~1.1 ms at
//   4.3 TB/s); 16-byte loads, two 8-element vectors in flight per thread per step, the
//   unaligned head and the n % 8 tail scalar in the same launch.
// add and add_inplace move 8 elements per thread per step with 16-byte accesses when every
// pointer is 16-byte aligned (bf16x8 or 2 x float4; the n % 8 tail by scalar code in the
// same launch), the same fp32 arithmetic per element as the scalar kernels.
// (zero and copy are cudaMemsetAsync / cudaMemcpyAsync in cuda_backend.cu.)
#include <algorithm>

#include "cuda/common.cuh"
#include "cuda/kernels.h"

namespace mhar::cuda {
namespace {

template <class TO, class TA, class TB>
__global__ void add_kernel(TO* out, const TA* a, const TB* b, int64_t n) {
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += int64_t(gridDim.x) * blockDim.x)
    out[i] = store<TO>(load(a[i]) + load(b[i]));
}

template <class TO, class TA, class TB>
__global__ void add_vec_kernel(TO* out, const TA* a, const TB* b, int64_t n) {
  const int64_t nv = n / 8, stride = int64_t(gridDim.x) * blockDim.x;
  const int64_t tid = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  for (int64_t v = tid; v < nv; v += stride) {
    float x[8], y[8];
    load8(a + v * 8, x);
    load8(b + v * 8, y);
#pragma unroll
    for (int e = 0; e < 8; ++e) x[e] += y[e];
    store8(out + v * 8, x);
  }
  for (int64_t i = nv * 8 + tid; i < n; i += stride) out[i] = store<TO>(load(a[i]) + load(b[i]));
}

constexpr int kSumThreads = 256;

template <class T>
__device__ __forceinline__ double square(T x) {
  const double d = load(x);
  return d * d;
}

// Each block's fp64 sum into partials[blockIdx.x]. [head, vec_end): 8-element vectors,
// 16-byte aligned; the rest scalar.
template <class T>
__global__ void __launch_bounds__(kSumThreads)
    sum_squares_kernel(double* partials, const T* x, int64_t n, int64_t head, int64_t vec_end) {
  const int64_t tid = int64_t(blockIdx.x) * kSumThreads + threadIdx.x;
  const int64_t stride = int64_t(gridDim.x) * kSumThreads;
  const int64_t nv = (vec_end - head) / 8;
  const T* xv = x + head;
  double acc = 0.0;
  int64_t i = tid;
  for (; i + stride < nv; i += 2 * stride) {
    float a[8], b[8];
    load8(xv + i * 8, a);
    load8(xv + (i + stride) * 8, b);
#pragma unroll
    for (int e = 0; e < 8; ++e) acc += double(a[e]) * double(a[e]);
#pragma unroll
    for (int e = 0; e < 8; ++e) acc += double(b[e]) * double(b[e]);
  }
  if (i < nv) {
    float a[8];
    load8(xv + i * 8, a);
#pragma unroll
    for (int e = 0; e < 8; ++e) acc += double(a[e]) * double(a[e]);
  }
  if (tid < head) acc += square(x[tid]);
  if (tid < n - vec_end) acc += square(x[vec_end + tid]);
  acc = block_sum(acc);
  if (threadIdx.x == 0) partials[blockIdx.x] = acc;
}

// *result = the partials' sum, in a fixed order (one block).
__global__ void __launch_bounds__(kSumThreads)
    sum_squares_finish_kernel(double* result, const double* partials, int num) {
  double acc = 0.0;
  for (int i = threadIdx.x; i < num; i += kSumThreads) acc += partials[i];
  acc = block_sum(acc);
  if (threadIdx.x == 0) *result = acc;
}

}  // namespace

void add(cudaStream_t s, Tensor out, Tensor a, Tensor b) {
  const int64_t n = out.numel();
  check_numel(a, n, "add", "a");
  check_numel(b, n, "add", "b");
  if (n == 0) return;
  dispatch_float(out.dtype, "add", [&](auto to) {
    dispatch_float(a.dtype, "add", [&](auto ta) {
      dispatch_float(b.dtype, "add", [&](auto tb) {
        using TO = decltype(to);
        using TA = decltype(ta);
        using TB = decltype(tb);
        const bool vec = aligned16(out.data) && aligned16(a.data) && aligned16(b.data);
        auto kern = vec ? add_vec_kernel<TO, TA, TB> : add_kernel<TO, TA, TB>;
        kern<<<grid_stride_blocks(vec ? ceil_div(n, 8) : n, 256), 256, 0, s>>>(
            static_cast<TO*>(out.data), static_cast<const TA*>(a.data),
            static_cast<const TB*>(b.data), n);
        CUDA_CHECK_LAUNCH();
      });
    });
  });
}

void add_inplace(cudaStream_t s, Tensor y, Tensor x) {
  const int64_t n = y.numel();
  check_numel(x, n, "add_inplace", "x");
  if (n == 0) return;
  dispatch_float(y.dtype, "add_inplace", [&](auto ty) {
    dispatch_float(x.dtype, "add_inplace", [&](auto tx) {
      using TY = decltype(ty);
      using TX = decltype(tx);
      const bool vec = aligned16(y.data) && aligned16(x.data);
      // y = y + x: the add kernels with out = a (each element read, then written, by
      // the same thread).
      auto kern = vec ? add_vec_kernel<TY, TY, TX> : add_kernel<TY, TY, TX>;
      kern<<<grid_stride_blocks(vec ? ceil_div(n, 8) : n, 256), 256, 0, s>>>(
          static_cast<TY*>(y.data), static_cast<const TY*>(y.data), static_cast<const TX*>(x.data), n);
      CUDA_CHECK_LAUNCH();
    });
  });
}

double sum_squares(cudaStream_t s, Tensor t, double* scratch) {
  const int64_t n = t.numel();
  double host = 0.0;
  if (n > 0) {
    dispatch_float(t.dtype, "sum_squares", [&](auto tag) {
      using T = decltype(tag);
      const auto addr = reinterpret_cast<uintptr_t>(t.data);
      MHAR_CHECK(addr % sizeof(T) == 0, "sum_squares: tensor not aligned to its element");
      const int64_t head = std::min<int64_t>(n, int64_t((16 - addr % 16) % 16 / sizeof(T)));
      const int64_t vec_end = head + (n - head) / 8 * 8;
      // Two vectors a thread a step; no more blocks than fit at once (each then takes
      // several steps), nor than the scratch has slots.
      const int64_t want = std::max<int64_t>(1, ceil_div((vec_end - head) / 8, 2 * kSumThreads));
      const int64_t fit = int64_t(sm_count()) * resident_blocks_per_sm(sum_squares_kernel<T>, kSumThreads);
      const int blocks = int(std::min({want, fit, int64_t(kSumSquaresScratch - 1)}));
      sum_squares_kernel<T><<<blocks, kSumThreads, 0, s>>>(scratch + 1, static_cast<const T*>(t.data),
                                                           n, head, vec_end);
      CUDA_CHECK_LAUNCH();
      sum_squares_finish_kernel<<<1, kSumThreads, 0, s>>>(scratch, scratch + 1, blocks);
      CUDA_CHECK_LAUNCH();
    });
    CUDA_CHECK(cudaMemcpyAsync(&host, scratch, sizeof(double), cudaMemcpyDeviceToHost, s));
  }
  CUDA_CHECK(cudaStreamSynchronize(s));
  return host;
}

}  // namespace mhar::cuda
