// rope.cu: rotary position embedding in place on x [B, T, heads, head_dim], position =
// first_position + t (first_position > 0 only for rope_at, in incremental decoding),
// Hugging Face's rotate-half pairing (i, i + head_dim/2):
//   forward:  (x1, x2) <- (x1 cos - x2 sin, x2 cos + x1 sin),  angle = t * theta^(-2i/hd)
//   backward: the inverse rotation (angle negated), which is the gradient.
// The angle is formed in fp32 as Hugging Face does (inv_freq = 1/theta^(2i/hd) in fp32,
// times t), then an accurate sincosf: positions up to a few thousand keep the angle error
// near 1e-4 rad, far below bf16's resolution.
#include "cuda/common.cuh"
#include "cuda/kernels.h"

namespace mhar::cuda {
namespace {

template <class T>
__global__ void rope_kernel(T* x, int64_t rows, int64_t T_len, int64_t heads, int half,
                            float theta, bool backward, int64_t first_position) {
  const int64_t pairs = rows * half;
  for (int64_t p = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; p < pairs;
       p += int64_t(gridDim.x) * blockDim.x) {
    const int64_t row = p / half;  // (b, t, h)
    const int i = int(p - row * half);
    const int64_t t = first_position + (row / heads) % T_len;
    const float inv_freq = 1.0f / powf(theta, float(2 * i) / float(2 * half));
    float sn, cs;
    sincosf(float(t) * inv_freq, &sn, &cs);
    if (backward) sn = -sn;
    T* base = x + row * (2 * half);
    const float x1 = load(base[i]), x2 = load(base[i + half]);
    base[i] = store<T>(x1 * cs - x2 * sn);
    base[i + half] = store<T>(x2 * cs + x1 * sn);
  }
}

}  // namespace

void rope(cudaStream_t s, Tensor x, double theta, bool backward, int64_t first_position) {
  MHAR_CHECK(x.ndim == 4, "rope wants x [B, T, heads, head_dim], got ", x.shape_str());
  const int64_t T_len = x.dim(1), heads = x.dim(2), hd = x.dim(3);
  MHAR_CHECK(hd % 2 == 0, "rope: head_dim ", hd, " must be even");
  const int64_t rows = x.numel() / hd;
  if (rows == 0) return;
  dispatch_float(x.dtype, "rope", [&](auto tx) {
    using T = decltype(tx);
    const int64_t pairs = rows * (hd / 2);
    rope_kernel<T><<<grid_stride_blocks(pairs, 256), 256, 0, s>>>(
        static_cast<T*>(x.data), rows, T_len, heads, int(hd / 2), float(theta),
        backward, first_position);
    CUDA_CHECK_LAUNCH();
  });
}

}  // namespace mhar::cuda
