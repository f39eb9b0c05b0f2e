// mlp.cu: the SwiGLU gate on the stacked gate/up projection's output (fp32 math).
// - gate_up [rows, 2F], row r = [gate_r | up_r]; h and dh [rows, F]; d_gate_up in
//   gate_up's layout (it feeds the stacked projection's two gradient GEMMs as one matrix).
// - forward: h = silu(gate) * up, silu(z) = z * sigmoid(z); h overwritten.
// - backward: dgate = dh * up * sig(z) * (1 + z (1 - sig(z))), dup = dh * silu(z); both
//   overwritten; with h given, h too (swiglu_h, the forward's own expression: the same
//   bits), so the model need not keep h from the forward.
// Vector path (F a multiple of 8, every pointer 16-byte aligned): 8 consecutive columns
// of one row per thread per step with 16-byte loads/stores (bf16x8, or 2 x float4); the
// scalar path otherwise. Both do the same fp32 arithmetic per element: the same bits.
#include "cuda/common.cuh"
#include "cuda/kernels.h"

namespace mhar::cuda {
namespace {

__device__ __forceinline__ float sigmoid(float z) { return 1.f / (1.f + __expf(-z)); }

__device__ __forceinline__ float swiglu_h(float z, float u) { return z * sigmoid(z) * u; }
__device__ __forceinline__ void swiglu_grads(float z, float u, float g, float& dgate, float& dup) {
  const float sg = sigmoid(z);
  dgate = g * u * sg * (1.f + z * (1.f - sg));
  dup = g * z * sg;
}

// Work item i of `per_row` items a row: its row and its first column (`width` columns an
// item). 32-bit division where the count allows: these kernels are memory-bound, but a
// 64-bit division per item is not free.
__device__ __forceinline__ void row_col(int64_t i, int64_t per_row, int width, int64_t& row,
                                        int64_t& col) {
  if (i < (int64_t(1) << 31) && per_row < (int64_t(1) << 31)) {
    row = uint32_t(i) / uint32_t(per_row);
  } else {
    row = i / per_row;
  }
  col = (i - row * per_row) * width;
}

template <class T>
__global__ void swiglu_forward_kernel(T* h, const T* gate_up, int64_t rows, int64_t F) {
  const int64_t n = rows * F;
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += int64_t(gridDim.x) * blockDim.x) {
    int64_t r, c;
    row_col(i, F, 1, r, c);
    const T* g = gate_up + r * 2 * F;
    h[i] = store<T>(swiglu_h(load(g[c]), load(g[F + c])));
  }
}

template <class T>
__global__ void swiglu_backward_kernel(T* d_gate_up, T* h, const T* dh, const T* gate_up,
                                       int64_t rows, int64_t F) {
  const int64_t n = rows * F;
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += int64_t(gridDim.x) * blockDim.x) {
    int64_t r, c;
    row_col(i, F, 1, r, c);
    const T* g = gate_up + r * 2 * F;
    const float z = load(g[c]), u = load(g[F + c]);
    float dg, du;
    swiglu_grads(z, u, load(dh[i]), dg, du);
    d_gate_up[r * 2 * F + c] = store<T>(dg);
    d_gate_up[r * 2 * F + F + c] = store<T>(du);
    if (h) h[i] = store<T>(swiglu_h(z, u));
  }
}

template <class T>
__global__ void swiglu_forward_vec_kernel(T* h, const T* gate_up, int64_t rows, int64_t F) {
  const int64_t per_row = F / 8, nv = rows * per_row, stride = int64_t(gridDim.x) * blockDim.x;
  for (int64_t v = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; v < nv; v += stride) {
    int64_t r, c;
    row_col(v, per_row, 8, r, c);
    const T* g = gate_up + r * 2 * F + c;
    float z[8], u[8], o[8];
    load8(g, z);
    load8(g + F, u);
#pragma unroll
    for (int e = 0; e < 8; ++e) o[e] = swiglu_h(z[e], u[e]);
    store8(h + v * 8, o);
  }
}

template <class T>
__global__ void swiglu_backward_vec_kernel(T* d_gate_up, T* h, const T* dh, const T* gate_up,
                                           int64_t rows, int64_t F) {
  const int64_t per_row = F / 8, nv = rows * per_row, stride = int64_t(gridDim.x) * blockDim.x;
  for (int64_t v = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; v < nv; v += stride) {
    int64_t r, c;
    row_col(v, per_row, 8, r, c);
    const T* g = gate_up + r * 2 * F + c;
    T* dg_out = d_gate_up + r * 2 * F + c;
    float z[8], u[8], g8[8], dg[8], du[8];
    load8(g, z);
    load8(g + F, u);
    load8(dh + v * 8, g8);
#pragma unroll
    for (int e = 0; e < 8; ++e) swiglu_grads(z[e], u[e], g8[e], dg[e], du[e]);
    store8(dg_out, dg);
    store8(dg_out + F, du);
    if (h) {
      float hv[8];
#pragma unroll
      for (int e = 0; e < 8; ++e) hv[e] = swiglu_h(z[e], u[e]);
      store8(h + v * 8, hv);
    }
  }
}

}  // namespace

void swiglu_forward(cudaStream_t s, Tensor h, Tensor gate_up) {
  const int64_t F = swiglu_width(h, gate_up, "swiglu_forward");
  const int64_t n = h.numel();
  if (n == 0) return;
  const int64_t rows = n / F;
  dispatch_float(h.dtype, "swiglu_forward", [&](auto tag) {
    using T = decltype(tag);
    const bool vec = F % 8 == 0 && aligned16(h.data) && aligned16(gate_up.data);
    auto kern = vec ? swiglu_forward_vec_kernel<T> : swiglu_forward_kernel<T>;
    kern<<<grid_stride_blocks(vec ? n / 8 : n, 256), 256, 0, s>>>(
        static_cast<T*>(h.data), static_cast<const T*>(gate_up.data), rows, F);
    CUDA_CHECK_LAUNCH();
  });
}

void swiglu_backward(cudaStream_t s, Tensor d_gate_up, Tensor h, Tensor dh, Tensor gate_up) {
  const int64_t F = swiglu_backward_width(d_gate_up, h, dh, gate_up, "swiglu_backward");
  const int64_t n = dh.numel();
  if (n == 0) return;
  const int64_t rows = n / F;
  dispatch_float(dh.dtype, "swiglu_backward", [&](auto tag) {
    using T = decltype(tag);
    const bool vec = F % 8 == 0 && aligned16(d_gate_up.data) && aligned16(dh.data) &&
                     aligned16(gate_up.data) && aligned16(h.data);
    auto kern = vec ? swiglu_backward_vec_kernel<T> : swiglu_backward_kernel<T>;
    kern<<<grid_stride_blocks(vec ? n / 8 : n, 256), 256, 0, s>>>(
        static_cast<T*>(d_gate_up.data), static_cast<T*>(h.data),
        static_cast<const T*>(dh.data), static_cast<const T*>(gate_up.data), rows, F);
    CUDA_CHECK_LAUNCH();
  });
}

}  // namespace mhar::cuda
