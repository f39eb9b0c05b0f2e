// reductions.cu: elementwise add, in-place accumulate, and the sum of squares behind the
// global gradient norm.
// - add: out = a + b (overwritten; any mix of BF16/F32 storage, fp32 math).
// - add_inplace: y += x (y and x may differ in dtype, e.g. fp32 y += bf16 x).
// - sum_squares: fp64 per-thread and per-block sums (a billion fp32 squares stay exact to
//   rounding), one fp64 atomic per block into a device scratch double, then copied to the
//   host: synchronises the stream.
// add and add_inplace move 8 elements per thread per step with 16-byte accesses when every
// pointer is 16-byte aligned (bf16x8 or 2 x float4; the n % 8 tail by scalar code in the
// same launch), the same fp32 arithmetic per element as the scalar kernels.
// (zero and copy are cudaMemsetAsync / cudaMemcpyAsync in cuda_backend.cu.)
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

template <class T>
__global__ void sum_squares_kernel(double* result, const T* x, int64_t n) {
  double acc = 0.0;
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += int64_t(gridDim.x) * blockDim.x) {
    const double v = load(x[i]);
    acc += v * v;
  }
  acc = block_sum(acc);
  if (threadIdx.x == 0) atomicAdd(result, acc);
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
  CUDA_CHECK(cudaMemsetAsync(scratch, 0, sizeof(double), s));
  if (n > 0) {
    dispatch_float(t.dtype, "sum_squares", [&](auto tag) {
      using T = decltype(tag);
      sum_squares_kernel<T><<<grid_stride_blocks(n, 256), 256, 0, s>>>(
          scratch, static_cast<const T*>(t.data), n);
      CUDA_CHECK_LAUNCH();
    });
  }
  double host = 0.0;
  CUDA_CHECK(cudaMemcpyAsync(&host, scratch, sizeof(double), cudaMemcpyDeviceToHost, s));
  CUDA_CHECK(cudaStreamSynchronize(s));
  return host;
}

}  // namespace mhar::cuda
