// rope.cu: rotary position embedding in place on x [B, T, heads, head_dim], position =
// first_position + t (first_position > 0 only for rope_at, in incremental decoding),
// Hugging Face's rotate-half pairing (i, i + head_dim/2):
//   forward:  (x1, x2) <- (x1 cos - x2 sin, x2 cos + x1 sin),  angle = t * theta^(-2i/hd)
//   backward: the inverse rotation (angle negated), which is the gradient.
// The angle is formed in fp64 as the CPU reference does (inv_freq_i = base^i with
// base = theta^(-2/hd) from the host, so no pow on the device; i multiplications in fp64
// are ~1e-14 relative), reduced to [-pi, pi] in fp64, then an fp32 sincosf: cos/sin land
// within an fp32 ulp or two of the reference's float(cos(angle)), at any position.
// Vector path (BF16, head_dim/2 a multiple of 8, x 16-byte aligned): one thread per
// (token, 8 consecutive pairs) computes its 8 cos/sin once and rotates those pairs in
// every head of the token with bf16x8 loads/stores (x read once, written once); the
// loads of its first 8 heads are in flight while it computes the cos/sin (they were
// issued after them: the whole grid, about one wave, computed before the first byte
// moved). Other shapes/dtypes: one thread per (row, pair), cos/sin per element.
#include "cuda/common.cuh"
#include "cuda/kernels.h"

namespace mhar::cuda {
namespace {

template <class T>
__global__ void rope_kernel(T* x, int64_t rows, int64_t T_len, int64_t heads, int half,
                            double base, bool backward, int64_t first_position) {
  const int64_t pairs = rows * half;
  for (int64_t p = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; p < pairs;
       p += int64_t(gridDim.x) * blockDim.x) {
    const int64_t row = p / half;  // (b, t, h)
    const int i = int(p - row * half);
    const int64_t t = first_position + (row / heads) % T_len;
    float sn, cs;
    rope_cos_sin(ipow(base, i), t, backward, cs, sn);
    T* xr = x + row * (2 * half);
    const float x1 = load(xr[i]), x2 = load(xr[i + half]);
    xr[i] = store<T>(x1 * cs - x2 * sn);
    xr[i + half] = store<T>(x2 * cs + x1 * sn);
  }
}

// Thread = (token, vector j of 8 pairs); tokens = B * T rows of heads * 2 * half. The
// loads of the first kHeadsInRegs heads are issued before the cos/sin are computed, so the
// fp64 angles and sincosf run while they are in flight; the token's later heads (q with
// more heads than that) are asked of L2 at the start, by the token's vector-0 thread.
constexpr int kHeadsInRegs = 8;

__global__ void rope_vec_kernel(bf16* x, int64_t tokens, int64_t T_len, int heads, int half,
                                double base, bool backward, int64_t first_position) {
  const int nv = half / 8;
  const int64_t work = tokens * nv;
  for (int64_t p = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; p < work;
       p += int64_t(gridDim.x) * blockDim.x) {
    const int64_t tok = p / nv;
    const int j = int(p - tok * nv), i0 = j * 8;
    bf16* xt = x + tok * int64_t(heads) * (2 * half) + i0;
    uint4 va[kHeadsInRegs], vb[kHeadsInRegs];
    auto load_heads = [&](int h0) {
#pragma unroll
      for (int c = 0; c < kHeadsInRegs; ++c) {
        if (h0 + c >= heads) break;
        const bf16* p1 = xt + int64_t(h0 + c) * (2 * half);
        va[c] = *reinterpret_cast<const uint4*>(p1);
        vb[c] = *reinterpret_cast<const uint4*>(p1 + half);
      }
    };
    load_heads(0);
    if (j == 0 && heads > kHeadsInRegs)
      prefetch_l2(xt + int64_t(kHeadsInRegs) * (2 * half),
                  uint32_t(int64_t(heads - kHeadsInRegs) * (2 * half) * 2));
    const int64_t t = first_position + tok % T_len;
    float cs[8], sn[8];
    double f = ipow(base, i0);
#pragma unroll
    for (int e = 0; e < 8; ++e) {
      rope_cos_sin(f, t, backward, cs[e], sn[e]);
      f *= base;
    }
    for (int h0 = 0; h0 < heads; h0 += kHeadsInRegs) {
      if (h0 > 0) load_heads(h0);
#pragma unroll
      for (int c = 0; c < kHeadsInRegs; ++c) {
        if (h0 + c >= heads) break;
        bf16* p1 = xt + int64_t(h0 + c) * (2 * half);
        float a[8], b[8], o1[8], o2[8];
        unpack8(va[c], a);
        unpack8(vb[c], b);
#pragma unroll
        for (int e = 0; e < 8; ++e) {
          o1[e] = a[e] * cs[e] - b[e] * sn[e];
          o2[e] = b[e] * cs[e] + a[e] * sn[e];
        }
        store8(p1, o1);
        store8(p1 + half, o2);
      }
    }
  }
}

}  // namespace

void rope(cudaStream_t s, Tensor x, double theta, bool backward, int64_t first_position) {
  MHAR_CHECK(x.ndim == 4, "rope wants x [B, T, heads, head_dim], got ", x.shape_str());
  const int64_t T_len = x.dim(1), heads = x.dim(2), hd = x.dim(3);
  MHAR_CHECK(hd % 2 == 0, "rope: head_dim ", hd, " must be even");
  const int64_t rows = x.numel() / hd;
  if (rows == 0) return;
  const double base = std::pow(theta, -2.0 / double(hd));
  const int half = int(hd / 2);
  if (x.dtype == DType::BF16 && half % 8 == 0 && aligned16(x.data)) {
    const int64_t tokens = rows / heads, work = tokens * (half / 8);
    rope_vec_kernel<<<grid_stride_blocks(work, 256), 256, 0, s>>>(
        static_cast<bf16*>(x.data), tokens, T_len, int(heads), half, base, backward,
        first_position);
    CUDA_CHECK_LAUNCH();
    return;
  }
  dispatch_float(x.dtype, "rope", [&](auto tx) {
    using T = decltype(tx);
    const int64_t pairs = rows * half;
    rope_kernel<T><<<grid_stride_blocks(pairs, 256), 256, 0, s>>>(
        static_cast<T*>(x.data), rows, T_len, heads, half, base, backward, first_position);
    CUDA_CHECK_LAUNCH();
  });
}

}  // namespace mhar::cuda
