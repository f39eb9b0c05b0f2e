// norm.cu: RMSNorm over the last dimension, x [R, D] with weight w [D]; also the per-head
// QK-norm through a [N*heads, head_dim] view.
// - forward: y (overwritten) = x * rstd * w; rstd [R] (F32, overwritten) =
//   1/sqrt(mean(x^2) + eps). One warp per row, fp32 sums.
// - backward: with g = dy * w,  dx = rstd * (g - x * rstd^2 * mean(g * x)), overwritten or
//   added (accumulate_dx); dw [D] (F32) += sum_r dy * x * rstd, reduced per block over
//   a slab of rows and added with one fp32 atomic per column per block.
#include "cuda/common.cuh"
#include "cuda/kernels.h"

namespace mhar::cuda {
namespace {

constexpr int kWarpsPerBlock = 8;

template <class T, class W>
__global__ void rmsnorm_forward_kernel(T* y, float* rstd, const T* x, const W* w, int64_t R,
                                       int64_t D, float eps) {
  const int lane = threadIdx.x & 31;
  const int64_t row = int64_t(blockIdx.x) * kWarpsPerBlock + (threadIdx.x >> 5);
  if (row >= R) return;
  const T* xr = x + row * D;
  float ss = 0.f;
  for (int64_t c = lane; c < D; c += 32) {
    float v = load(xr[c]);
    ss += v * v;
  }
  ss = warp_sum(ss);
  const float r = rsqrtf(ss / float(D) + eps);
  if (lane == 0) rstd[row] = r;
  T* yr = y + row * D;
  for (int64_t c = lane; c < D; c += 32) yr[c] = store<T>(load(xr[c]) * r * load(w[c]));
}

template <class T, class W>
__global__ void rmsnorm_backward_dx_kernel(T* dx, const T* dy, const T* x, const W* w,
                                           const float* rstd, int64_t R, int64_t D,
                                           bool accumulate) {
  const int lane = threadIdx.x & 31;
  const int64_t row = int64_t(blockIdx.x) * kWarpsPerBlock + (threadIdx.x >> 5);
  if (row >= R) return;
  const T* xr = x + row * D;
  const T* dyr = dy + row * D;
  float gx = 0.f;
  for (int64_t c = lane; c < D; c += 32) gx += load(dyr[c]) * load(w[c]) * load(xr[c]);
  gx = warp_sum(gx);
  const float r = rstd[row];
  const float coef = r * r * gx / float(D);
  T* dxr = dx + row * D;
  for (int64_t c = lane; c < D; c += 32) {
    float v = r * (load(dyr[c]) * load(w[c]) - load(xr[c]) * coef);
    if (accumulate) v += load(dxr[c]);
    dxr[c] = store<T>(v);
  }
}

// Block (32 columns) x (8 row lanes); each block sums a slab of rows for its 32 columns.
template <class T>
__global__ void rmsnorm_backward_dw_kernel(float* dw, const T* dy, const T* x, const float* rstd,
                                           int64_t R, int64_t D, int64_t rows_per_block) {
  __shared__ float partial[8][33];
  const int64_t c = int64_t(blockIdx.x) * 32 + threadIdx.x;
  const int64_t r0 = int64_t(blockIdx.y) * rows_per_block;
  const int64_t r1 = min(R, r0 + rows_per_block);
  float acc = 0.f;
  if (c < D)
    for (int64_t r = r0 + threadIdx.y; r < r1; r += 8)
      acc += load(dy[r * D + c]) * load(x[r * D + c]) * rstd[r];
  partial[threadIdx.y][threadIdx.x] = acc;
  __syncthreads();
  if (threadIdx.y == 0 && c < D) {
    float t = 0.f;
#pragma unroll
    for (int i = 0; i < 8; ++i) t += partial[i][threadIdx.x];
    atomicAdd(dw + c, t);
  }
}

}  // namespace

void rmsnorm_forward(cudaStream_t s, Tensor y, Tensor rstd, Tensor x, Tensor w, double eps) {
  const int64_t D = w.numel(), R = x.numel() / D;
  check_numel(x, R * D, "rmsnorm_forward", "x");
  check_numel(y, R * D, "rmsnorm_forward", "y");
  check_numel(rstd, R, "rmsnorm_forward", "rstd");
  check_dtype(rstd, DType::F32, "rmsnorm_forward", "rstd");
  check_dtype(y, x.dtype, "rmsnorm_forward", "y");
  if (R == 0) return;
  dispatch_float(x.dtype, "rmsnorm_forward", [&](auto tx) {
    dispatch_float(w.dtype, "rmsnorm_forward", [&](auto tw) {
      using T = decltype(tx);
      using W = decltype(tw);
      rmsnorm_forward_kernel<T, W><<<ceil_div(R, kWarpsPerBlock), 32 * kWarpsPerBlock, 0, s>>>(
          static_cast<T*>(y.data), rstd.ptr<float>(), static_cast<const T*>(x.data),
          static_cast<const W*>(w.data), R, D, float(eps));
      CUDA_CHECK_LAUNCH();
    });
  });
}

void rmsnorm_backward(cudaStream_t s, Tensor dx, Tensor dw, Tensor dy, Tensor x, Tensor w,
                      Tensor rstd, bool accumulate_dx) {
  const int64_t D = w.numel(), R = x.numel() / D;
  check_numel(x, R * D, "rmsnorm_backward", "x");
  check_numel(dx, R * D, "rmsnorm_backward", "dx");
  check_numel(dy, R * D, "rmsnorm_backward", "dy");
  check_numel(dw, D, "rmsnorm_backward", "dw");
  check_numel(rstd, R, "rmsnorm_backward", "rstd");
  check_dtype(rstd, DType::F32, "rmsnorm_backward", "rstd");
  check_dtype(dw, DType::F32, "rmsnorm_backward", "dw");
  check_dtype(dx, x.dtype, "rmsnorm_backward", "dx");
  check_dtype(dy, x.dtype, "rmsnorm_backward", "dy");
  if (R == 0) return;
  dispatch_float(x.dtype, "rmsnorm_backward", [&](auto tx) {
    dispatch_float(w.dtype, "rmsnorm_backward", [&](auto tw) {
      using T = decltype(tx);
      using W = decltype(tw);
      rmsnorm_backward_dx_kernel<T, W>
          <<<ceil_div(R, kWarpsPerBlock), 32 * kWarpsPerBlock, 0, s>>>(
              static_cast<T*>(dx.data), static_cast<const T*>(dy.data),
              static_cast<const T*>(x.data), static_cast<const W*>(w.data), rstd.ptr<float>(),
              R, D, accumulate_dx);
      CUDA_CHECK_LAUNCH();
    });
    using T = decltype(tx);
    // About 4 blocks' worth of rows per SM in total keeps the atomics few and the SMs busy.
    const int64_t col_blocks = ceil_div(D, 32);
    const int64_t want_row_blocks = ceil_div(int64_t(grid_stride_blocks(R * D, 256)), col_blocks);
    const int64_t row_blocks = want_row_blocks < 1 ? 1 : (want_row_blocks > R ? R : want_row_blocks);
    const int64_t rows_per_block = ceil_div(R, row_blocks);
    dim3 grid(unsigned(col_blocks), unsigned(ceil_div(R, rows_per_block)));
    rmsnorm_backward_dw_kernel<T><<<grid, dim3(32, 8), 0, s>>>(
        dw.ptr<float>(), static_cast<const T*>(dy.data), static_cast<const T*>(x.data),
        rstd.ptr<float>(), R, D, rows_per_block);
    CUDA_CHECK_LAUNCH();
  });
}

}  // namespace mhar::cuda
