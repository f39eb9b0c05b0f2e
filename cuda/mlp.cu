// mlp.cu: the SwiGLU gate, elementwise over equal-sized tensors (fp32 math).
// - forward: h = silu(gate) * up, silu(z) = z * sigmoid(z); h overwritten.
// - backward: dgate = dh * up * sig(z) * (1 + z (1 - sig(z))), dup = dh * silu(z); both
//   overwritten.
#include "cuda/common.cuh"
#include "cuda/kernels.h"

namespace mhar::cuda {
namespace {

__device__ __forceinline__ float sigmoid(float z) { return 1.f / (1.f + __expf(-z)); }

template <class T>
__global__ void swiglu_forward_kernel(T* h, const T* gate, const T* up, int64_t n) {
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += int64_t(gridDim.x) * blockDim.x) {
    const float z = load(gate[i]);
    h[i] = store<T>(z * sigmoid(z) * load(up[i]));
  }
}

template <class T>
__global__ void swiglu_backward_kernel(T* dgate, T* dup, const T* dh, const T* gate, const T* up,
                                       int64_t n) {
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += int64_t(gridDim.x) * blockDim.x) {
    const float z = load(gate[i]), u = load(up[i]), g = load(dh[i]);
    const float sg = sigmoid(z);
    dgate[i] = store<T>(g * u * sg * (1.f + z * (1.f - sg)));
    dup[i] = store<T>(g * z * sg);
  }
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
    swiglu_forward_kernel<T><<<grid_stride_blocks(n, 256), 256, 0, s>>>(
        static_cast<T*>(h.data), static_cast<const T*>(gate.data),
        static_cast<const T*>(up.data), n);
    CUDA_CHECK_LAUNCH();
  });
}

void swiglu_backward(cudaStream_t s, Tensor dgate, Tensor dup, Tensor dh, Tensor gate, Tensor up) {
  check_same("swiglu_backward", {&dgate, &dup, &dh, &gate, &up});
  const int64_t n = dh.numel();
  if (n == 0) return;
  dispatch_float(dh.dtype, "swiglu_backward", [&](auto tag) {
    using T = decltype(tag);
    swiglu_backward_kernel<T><<<grid_stride_blocks(n, 256), 256, 0, s>>>(
        static_cast<T*>(dgate.data), static_cast<T*>(dup.data), static_cast<const T*>(dh.data),
        static_cast<const T*>(gate.data), static_cast<const T*>(up.data), n);
    CUDA_CHECK_LAUNCH();
  });
}

}  // namespace mhar::cuda
