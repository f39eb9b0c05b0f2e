// mlp.cu: the SwiGLU gate, elementwise over equal-sized tensors (fp32 math).
// - forward: h = silu(gate) * up, silu(z) = z * sigmoid(z); h overwritten.
// - backward: dgate = dh * up * sig(z) * (1 + z (1 - sig(z))), dup = dh * silu(z); both
//   overwritten; with h given, h too (swiglu_h, the forward's own expression: the same
//   bits), so the model need not keep h from the forward.
// Vector path (every pointer 16-byte aligned): 8 elements per thread per step with 16-byte
// loads/stores (bf16x8, or 2 x float4), the n % 8 tail by scalar code in the same launch;
// the same fp32 arithmetic per element, so the same bits as the scalar path.
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

template <class T>
__global__ void swiglu_forward_kernel(T* h, const T* gate, const T* up, int64_t n) {
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += int64_t(gridDim.x) * blockDim.x)
    h[i] = store<T>(swiglu_h(load(gate[i]), load(up[i])));
}

// One element of the backward (the scalar kernel and the vector kernel's tail).
template <class T>
__device__ __forceinline__ void swiglu_backward_one(T* dgate, T* dup, T* h, const T* dh,
                                                    const T* gate, const T* up, int64_t i) {
  const float z = load(gate[i]), u = load(up[i]);
  float dg, du;
  swiglu_grads(z, u, load(dh[i]), dg, du);
  dgate[i] = store<T>(dg);
  dup[i] = store<T>(du);
  if (h) h[i] = store<T>(swiglu_h(z, u));
}

template <class T>
__global__ void swiglu_backward_kernel(T* dgate, T* dup, T* h, const T* dh, const T* gate,
                                       const T* up, int64_t n) {
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += int64_t(gridDim.x) * blockDim.x)
    swiglu_backward_one(dgate, dup, h, dh, gate, up, i);
}

template <class T>
__global__ void swiglu_forward_vec_kernel(T* h, const T* gate,
                                          const T* up, int64_t n) {
  const int64_t nv = n / 8, stride = int64_t(gridDim.x) * blockDim.x;
  const int64_t tid = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  for (int64_t v = tid; v < nv; v += stride) {
    float z[8], u[8], o[8];
    load8(gate + v * 8, z);
    load8(up + v * 8, u);
#pragma unroll
    for (int e = 0; e < 8; ++e) o[e] = swiglu_h(z[e], u[e]);
    store8(h + v * 8, o);
  }
  for (int64_t i = nv * 8 + tid; i < n; i += stride)
    h[i] = store<T>(swiglu_h(load(gate[i]), load(up[i])));
}

template <class T>
__global__ void swiglu_backward_vec_kernel(T* dgate, T* dup, T* h, const T* dh, const T* gate,
                                           const T* up, int64_t n) {
  const int64_t nv = n / 8, stride = int64_t(gridDim.x) * blockDim.x;
  const int64_t tid = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  for (int64_t v = tid; v < nv; v += stride) {
    float z[8], u[8], g[8], dg[8], du[8];
    load8(gate + v * 8, z);
    load8(up + v * 8, u);
    load8(dh + v * 8, g);
#pragma unroll
    for (int e = 0; e < 8; ++e) swiglu_grads(z[e], u[e], g[e], dg[e], du[e]);
    store8(dgate + v * 8, dg);
    store8(dup + v * 8, du);
    if (h) {
      float hv[8];
#pragma unroll
      for (int e = 0; e < 8; ++e) hv[e] = swiglu_h(z[e], u[e]);
      store8(h + v * 8, hv);
    }
  }
  for (int64_t i = nv * 8 + tid; i < n; i += stride)
    swiglu_backward_one(dgate, dup, h, dh, gate, up, i);
}

void check_same(const char* what, std::initializer_list<const Tensor*> ts) {
  const Tensor* first = *ts.begin();
  for (const Tensor* t : ts)
    MHAR_CHECK(t->numel() == first->numel() && t->dtype == first->dtype, what,
               ": tensors differ in size or dtype");
}

}  // namespace

void swiglu_forward(cudaStream_t s, Tensor h, Tensor gate, Tensor up) {
  check_same("swiglu_forward", {&h, &gate, &up});
  const int64_t n = h.numel();
  if (n == 0) return;
  dispatch_float(h.dtype, "swiglu_forward", [&](auto tag) {
    using T = decltype(tag);
    const bool vec = aligned16(h.data) && aligned16(gate.data) && aligned16(up.data);
    auto kern = vec ? swiglu_forward_vec_kernel<T> : swiglu_forward_kernel<T>;
    kern<<<grid_stride_blocks(vec ? ceil_div(n, 8) : n, 256), 256, 0, s>>>(
        static_cast<T*>(h.data), static_cast<const T*>(gate.data),
        static_cast<const T*>(up.data), n);
    CUDA_CHECK_LAUNCH();
  });
}

void swiglu_backward(cudaStream_t s, Tensor dgate, Tensor dup, Tensor h, Tensor dh, Tensor gate,
                     Tensor up) {
  check_same("swiglu_backward", {&dgate, &dup, &dh, &gate, &up});
  if (!h.empty()) check_same("swiglu_backward (h)", {&dh, &h});
  const int64_t n = dh.numel();
  if (n == 0) return;
  dispatch_float(dh.dtype, "swiglu_backward", [&](auto tag) {
    using T = decltype(tag);
    const bool vec = aligned16(dgate.data) && aligned16(dup.data) && aligned16(dh.data) &&
                     aligned16(gate.data) && aligned16(up.data) && aligned16(h.data);
    auto kern = vec ? swiglu_backward_vec_kernel<T> : swiglu_backward_kernel<T>;
    kern<<<grid_stride_blocks(vec ? ceil_div(n, 8) : n, 256), 256, 0, s>>>(
        static_cast<T*>(dgate.data), static_cast<T*>(dup.data), static_cast<T*>(h.data),
        static_cast<const T*>(dh.data), static_cast<const T*>(gate.data),
        static_cast<const T*>(up.data), n);
    CUDA_CHECK_LAUNCH();
  });
}

}  // namespace mhar::cuda
