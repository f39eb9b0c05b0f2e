// hyper.cu: the Hyper-Connections stream ops (residual.mode hyper, DESIGN.md section 2;
// backend.h's hyper_* for their equations, engine/cpu/hyper.h for the reference):
//   hyper_mix              x = sum_i c_i H[i]                     (n+1 rows moved)
//   hyper_mix_backward     dH[i] (+)= c_i dx, dc_i += <dx, H[i]>  (2n+1, or 3n+1 with +=)
//   hyper_update           out[i] = B_i v + sum_r A_r[r,i] in[r]  (2n+1)
//   hyper_update_backward  din, dv, dA_r += , dB +=               (2n+1 read, n+1 written)
// Each op is one pass over its streams: a thread owns 16-byte chunks of 8 bf16 of the
// flattened [N*d] row (grid-stride, needs N*d % 8 == 0 and 16-byte aligned rows, which
// d % 8 == 0 and the memory plan give), loads the chunk of every stream it needs before
// using any (n is a template parameter, 1..kMaxStreams, so the per-stream registers are
// indexed by constants), and writes each output chunk once. The ops are bound by those
// bytes: there is no reuse to exploit, only the copy bandwidth to approach.
// Storage: streams, x, v and their gradients BF16; coefficients BF16 (the backend's
// parameters); coefficient gradients F32. Every product and sum is fp32 (a bf16 x bf16
// product is exact in fp32); each output element is rounded once.
// Coefficient gradients (sums over all N*d elements) are deterministic, with no atomics:
// every thread sums its chunks in a fixed order, each block reduces its threads in a
// fixed order (warp shuffles, then warps in index order) into its own row of a scratch
// [blocks, P] owned by the backend, and a second one-block kernel adds the rows in block
// order into the gradient. The grid depends only on N*d and the device's SM count, so a
// resumed run reproduces every bit.
// Registers (ptxas, sm_90): the update backward holds n*n + n gradient sums per thread;
// for n <= 4 its launch bounds ask for two 256-thread blocks per SM, which ptxas meets
// at n = 4 with 128 registers and no spills (144 unbounded, one block per SM); n >= 6
// uses 255 with small spills. The other kernels stay under 100.
// Dynamic Hyper-Connections (residual.hyper_dynamic; per token t and stream r, Q = n + 2
// coefficients C[t, r, :] = static + s tanh(rmsnorm(h_r[t]) . W), F32 [N, n, Q]):
//   hyper_dynamic_coef             C, T (the tanh), rstd from H      (n rows read)
//   hyper_mix_dynamic              x = sum_r C[t,r,0] h_r            (n+1)
//   hyper_mix_dynamic_backward     dH += C dx, dC[:, :, 0] = <dx, h_r>   (3n+1)
//   hyper_update_dynamic           out_i = C[t,i,n+1] v + sum_r C[t,r,1+i] in_r   (2n+1)
//   hyper_update_dynamic_backward  din, dv, dC[:, :, 1..n+1]         (3n+2)
//   hyper_dynamic_coef_backward    dH += through the norm; dW, dA_m, dA_r, dB, ds_a, ds_b +=
// Their coefficients change per token, so one warp owns a token (its lanes the token's
// 16-byte chunks) and keeps that token's coefficients in registers; every per-token sum
// is a lane's chunks in order and then a warp butterfly, whatever the grid. The
// coefficients' backward: a token kernel (two passes over the token: the norm's dot,
// then dH; it leaves U = rstd dz per token and stream in the scratch), dW = sum over
// tokens and streams of h U^T as [splits, d, Q] block partial sums added in split order,
// and the static coefficients' and scales' sums over tokens, one block per column of
// dC, added in column order. W is read through L1 (d (n+2) bf16, shared by every warp).
// Registers of the dynamic kernels (ptxas -v, sm_90): at n = 4 at most 125 (the update
// backward), no spills; at n = 8 the coefficients' backward 223, the update backward 255
// with 128 bytes of spills (n = 7: 12 bytes); the others under 200 without spills.
// Not measured on a GPU yet (the lead's H200 run): bandwidth against the copy's is open.
#include <algorithm>
#include <cstdint>
#include <type_traits>

#include "cuda/common.cuh"
#include "cuda/kernels.h"

namespace mhar::cuda {
namespace {

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;

__device__ __forceinline__ void load8(const bf16* p, float (&f)[8]) {
  const uint4 u = *reinterpret_cast<const uint4*>(p);
  const __nv_bfloat162* h = reinterpret_cast<const __nv_bfloat162*>(&u);
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    const float2 t = __bfloat1622float2(h[k]);
    f[2 * k] = t.x;
    f[2 * k + 1] = t.y;
  }
}
__device__ __forceinline__ void store8(bf16* p, const float (&f)[8]) {
  uint4 u;
  __nv_bfloat162* h = reinterpret_cast<__nv_bfloat162*>(&u);
#pragma unroll
  for (int k = 0; k < 4; ++k) h[k] = __floats2bfloat162_rn(f[2 * k], f[2 * k + 1]);
  *reinterpret_cast<uint4*>(p) = u;
}

// Block-wide sums of P per-thread values, in a fixed order; thread p < P writes sum p
// into row[p]. Shared memory: kWarps * P floats.
template <int P>
__device__ __forceinline__ void block_sums(float (&g)[P], float* row) {
  __shared__ float s[kWarps][P];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
#pragma unroll
  for (int p = 0; p < P; ++p) {
    const float w = warp_sum(g[p]);
    if (lane == 0) s[warp][p] = w;
  }
  __syncthreads();
  for (int p = threadIdx.x; p < P; p += kThreads) {
    float t = 0;
    for (int w = 0; w < kWarps; ++w) t += s[w][p];
    row[p] = t;
  }
}

// grad[p] += sum over blocks b of partial[b * stride + p] (p < count), blocks in order.
// Any grid: each p is one thread's sum, whatever the launch shape.
__global__ void finish_kernel(float* grad, const float* partial, int blocks, int64_t count,
                              int64_t stride) {
  for (int64_t p = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; p < count;
       p += int64_t(gridDim.x) * blockDim.x) {
    float t = 0;
    for (int b = 0; b < blocks; ++b) t += partial[int64_t(b) * stride + p];
    grad[p] += t;
  }
}

template <int NS>
__device__ __forceinline__ void load_coef(float (&c)[NS], const bf16* coef) {
#pragma unroll
  for (int i = 0; i < NS; ++i) c[i] = coef ? load(coef[i]) : 1.0f;
}

template <int NS>
__global__ void __launch_bounds__(kThreads) mix_kernel(bf16* __restrict__ x,
                                                       const bf16* __restrict__ H,
                                                       const bf16* __restrict__ coef,
                                                       int64_t M) {
  float c[NS];
  load_coef<NS>(c, coef);
  const int64_t chunks = M / 8;
  for (int64_t q = blockIdx.x * int64_t(kThreads) + threadIdx.x; q < chunks;
       q += int64_t(gridDim.x) * kThreads) {
    float h[NS][8];
#pragma unroll
    for (int i = 0; i < NS; ++i) load8(H + i * M + q * 8, h[i]);
    float acc[8];
#pragma unroll
    for (int k = 0; k < 8; ++k) {
      acc[k] = 0;
#pragma unroll
      for (int i = 0; i < NS; ++i) acc[k] = fmaf(c[i], h[i][k], acc[k]);
    }
    store8(x + q * 8, acc);
  }
}

// COEF: a mix with coefficients (their gradient into partial); otherwise the head's sum.
template <int NS, bool COEF, bool ACC>
__global__ void __launch_bounds__(kThreads) mix_backward_kernel(
    bf16* __restrict__ dH, float* __restrict__ partial, const bf16* __restrict__ dx,
    const bf16* __restrict__ H, const bf16* __restrict__ coef, int64_t M) {
  float c[NS], g[NS];
  load_coef<NS>(c, COEF ? coef : nullptr);
#pragma unroll
  for (int i = 0; i < NS; ++i) g[i] = 0;
  const int64_t chunks = M / 8;
  for (int64_t q = blockIdx.x * int64_t(kThreads) + threadIdx.x; q < chunks;
       q += int64_t(gridDim.x) * kThreads) {
    float gx[8], h[NS][8], old[NS][8];
    load8(dx + q * 8, gx);
#pragma unroll
    for (int i = 0; i < NS; ++i) {
      if (COEF) load8(H + i * M + q * 8, h[i]);
      if (ACC) load8(dH + i * M + q * 8, old[i]);
    }
#pragma unroll
    for (int i = 0; i < NS; ++i) {
      float out[8];
#pragma unroll
      for (int k = 0; k < 8; ++k) {
        out[k] = ACC ? fmaf(c[i], gx[k], old[i][k]) : c[i] * gx[k];
        if (COEF) g[i] = fmaf(gx[k], h[i][k], g[i]);
      }
      store8(dH + i * M + q * 8, out);
    }
  }
  if (COEF) block_sums<NS>(g, partial + int64_t(blockIdx.x) * NS);
}

// Coefficients in shared memory: A_r [n * n] then B [n] (read as broadcasts).
template <int NS>
__device__ __forceinline__ void stage_update_coef(float* s, const bf16* Ar, const bf16* B) {
  for (int p = threadIdx.x; p < NS * NS + NS; p += kThreads)
    s[p] = p < NS * NS ? load(Ar[p]) : load(B[p - NS * NS]);
  __syncthreads();
}

template <int NS>
__global__ void __launch_bounds__(kThreads) update_kernel(bf16* __restrict__ out,
                                                          const bf16* __restrict__ in,
                                                          const bf16* __restrict__ v,
                                                          const bf16* __restrict__ Ar,
                                                          const bf16* __restrict__ B, int64_t M) {
  __shared__ float s[NS * NS + NS];
  stage_update_coef<NS>(s, Ar, B);
  const int64_t chunks = M / 8;
  for (int64_t q = blockIdx.x * int64_t(kThreads) + threadIdx.x; q < chunks;
       q += int64_t(gridDim.x) * kThreads) {
    float h[NS][8], vv[8];
    load8(v + q * 8, vv);
#pragma unroll
    for (int r = 0; r < NS; ++r) load8(in + r * M + q * 8, h[r]);
#pragma unroll
    for (int i = 0; i < NS; ++i) {
      const float b = s[NS * NS + i];
      float o[8];
#pragma unroll
      for (int k = 0; k < 8; ++k) {
        float acc = b * vv[k];
#pragma unroll
        for (int r = 0; r < NS; ++r) acc = fmaf(s[r * NS + i], h[r][k], acc);
        o[k] = acc;
      }
      store8(out + i * M + q * 8, o);
    }
  }
}

// Partial sums per block: dA_r[r * n + i] at p = r * n + i, dB[i] at p = n * n + i.
template <int NS>
__global__ void __launch_bounds__(kThreads, NS <= 4 ? 2 : 1) update_backward_kernel(
    bf16* __restrict__ din, bf16* __restrict__ dv, float* __restrict__ partial,
    const bf16* __restrict__ dout, const bf16* __restrict__ in, const bf16* __restrict__ v,
    const bf16* __restrict__ Ar, const bf16* __restrict__ B, int64_t M) {
  constexpr int P = NS * NS + NS;
  __shared__ float s[P];
  stage_update_coef<NS>(s, Ar, B);
  float g[P];
#pragma unroll
  for (int p = 0; p < P; ++p) g[p] = 0;
  const int64_t chunks = M / 8;
  for (int64_t q = blockIdx.x * int64_t(kThreads) + threadIdx.x; q < chunks;
       q += int64_t(gridDim.x) * kThreads) {
    float go[NS][8], vv[8];
    load8(v + q * 8, vv);
#pragma unroll
    for (int i = 0; i < NS; ++i) load8(dout + i * M + q * 8, go[i]);
    float o[8];
#pragma unroll
    for (int k = 0; k < 8; ++k) {
      float acc = 0;
#pragma unroll
      for (int i = 0; i < NS; ++i) {
        acc = fmaf(s[NS * NS + i], go[i][k], acc);
        g[NS * NS + i] = fmaf(go[i][k], vv[k], g[NS * NS + i]);
      }
      o[k] = acc;
    }
    store8(dv + q * 8, o);
#pragma unroll
    for (int r = 0; r < NS; ++r) {
      float h[8];
      load8(in + r * M + q * 8, h);
#pragma unroll
      for (int k = 0; k < 8; ++k) {
        float acc = 0;
#pragma unroll
        for (int i = 0; i < NS; ++i) {
          acc = fmaf(s[r * NS + i], go[i][k], acc);
          g[r * NS + i] = fmaf(go[i][k], h[k], g[r * NS + i]);
        }
        o[k] = acc;
      }
      store8(din + r * M + q * 8, o);
    }
  }
  block_sums<P>(g, partial + int64_t(blockIdx.x) * P);
}

// ---- Dynamic Hyper-Connections (per-token coefficients; engine/cpu/hyper.h). One warp
// owns one token (grid-stride over tokens): its lanes walk the token's d/8 chunks of
// every stream, so the per-token sums (the norm, the n+2 projections, the coefficient
// gradients of a token) are one lane's chunks in order, then a warp butterfly: the same
// bits whatever the grid. C, T, dC, rstd and the scratch U are F32 [N, n, Q], Q = n + 2.

// The warp of token t: lane's chunks j = lane, lane + 32, ... of d / 8.
#define MHAR_FOR_EACH_TOKEN(t)                                                    \
  for (int64_t t = blockIdx.x * int64_t(kWarps) + (threadIdx.x >> 5); t < N;    \
       t += int64_t(gridDim.x) * kWarps)

template <int NS>
__global__ void __launch_bounds__(kThreads) dyn_coef_kernel(
    float* __restrict__ C, float* __restrict__ Tt, float* __restrict__ rstd,
    const bf16* __restrict__ H, const bf16* __restrict__ W, const bf16* __restrict__ Am,
    const bf16* __restrict__ Ar, const bf16* __restrict__ B, const bf16* __restrict__ sa,
    const bf16* __restrict__ sb, int64_t N, int64_t d, float eps) {
  constexpr int Q = NS + 2;
  const int lane = threadIdx.x & 31;
  const int64_t M = N * d, chunks = d / 8;
  const float s_a = load(sa[0]), s_b = load(sb[0]);
  MHAR_FOR_EACH_TOKEN(t) {
    float z[NS][Q], ss[NS];
#pragma unroll
    for (int r = 0; r < NS; ++r) {
      ss[r] = 0;
#pragma unroll
      for (int q = 0; q < Q; ++q) z[r][q] = 0;
    }
    for (int64_t j = lane; j < chunks; j += 32) {
      float h[NS][8];
#pragma unroll
      for (int r = 0; r < NS; ++r) load8(H + r * M + t * d + j * 8, h[r]);
#pragma unroll
      for (int k = 0; k < 8; ++k) {
        const bf16* w = W + (j * 8 + k) * Q;
        float wq[Q];
#pragma unroll
        for (int q = 0; q < Q; ++q) wq[q] = load(w[q]);
#pragma unroll
        for (int r = 0; r < NS; ++r) {
          ss[r] = fmaf(h[r][k], h[r][k], ss[r]);
#pragma unroll
          for (int q = 0; q < Q; ++q) z[r][q] = fmaf(h[r][k], wq[q], z[r][q]);
        }
      }
    }
#pragma unroll
    for (int r = 0; r < NS; ++r) {
      // Correctly rounded sqrt and division (no fast math), as the reference's 1/sqrt.
      const float rs = 1.0f / sqrtf(warp_sum(ss[r]) / float(d) + eps);
      if (lane == r) rstd[t * NS + r] = rs;
#pragma unroll
      for (int q = 0; q < Q; ++q) {
        const float zq = warp_sum(z[r][q]) * rs;
        const int p = r * Q + q;
        if (lane == (p & 31)) {
          const float th = tanhf(zq);
          const float base = q == 0 ? load(Am[r]) : q <= NS ? load(Ar[r * NS + q - 1]) : load(B[r]);
          Tt[t * NS * Q + p] = th;
          C[t * NS * Q + p] = fmaf(q <= NS ? s_a : s_b, th, base);
        }
      }
    }
  }
}

template <int NS>
__global__ void __launch_bounds__(kThreads) dyn_mix_kernel(bf16* __restrict__ x,
                                                           const bf16* __restrict__ H,
                                                           const float* __restrict__ C,
                                                           int64_t N, int64_t d) {
  constexpr int Q = NS + 2;
  const int lane = threadIdx.x & 31;
  const int64_t M = N * d, chunks = d / 8;
  MHAR_FOR_EACH_TOKEN(t) {
    float c[NS];
#pragma unroll
    for (int r = 0; r < NS; ++r) c[r] = C[(t * NS + r) * Q];
    for (int64_t j = lane; j < chunks; j += 32) {
      float h[NS][8], acc[8];
#pragma unroll
      for (int r = 0; r < NS; ++r) load8(H + r * M + t * d + j * 8, h[r]);
#pragma unroll
      for (int k = 0; k < 8; ++k) {
        acc[k] = 0;
#pragma unroll
        for (int r = 0; r < NS; ++r) acc[k] = fmaf(c[r], h[r][k], acc[k]);
      }
      store8(x + t * d + j * 8, acc);
    }
  }
}

// dH[r] += C[t, r, 0] dx; dC[t, r, 0] = <dx[t], h_r[t]> (column 0 overwritten).
template <int NS>
__global__ void __launch_bounds__(kThreads) dyn_mix_backward_kernel(
    bf16* __restrict__ dH, float* __restrict__ dC, const bf16* __restrict__ dx,
    const bf16* __restrict__ H, const float* __restrict__ C, int64_t N, int64_t d) {
  constexpr int Q = NS + 2;
  const int lane = threadIdx.x & 31;
  const int64_t M = N * d, chunks = d / 8;
  MHAR_FOR_EACH_TOKEN(t) {
    float c[NS], g[NS];
#pragma unroll
    for (int r = 0; r < NS; ++r) c[r] = C[(t * NS + r) * Q], g[r] = 0;
    for (int64_t j = lane; j < chunks; j += 32) {
      float gx[8];
      load8(dx + t * d + j * 8, gx);
#pragma unroll
      for (int r = 0; r < NS; ++r) {
        bf16* p = dH + r * M + t * d + j * 8;
        float h[8], o[8];
        load8(H + r * M + t * d + j * 8, h);
        load8(p, o);
#pragma unroll
        for (int k = 0; k < 8; ++k) {
          g[r] = fmaf(gx[k], h[k], g[r]);
          o[k] = fmaf(c[r], gx[k], o[k]);
        }
        store8(p, o);
      }
    }
#pragma unroll
    for (int r = 0; r < NS; ++r) {
      const float s = warp_sum(g[r]);
      if (lane == r) dC[(t * NS + r) * Q] = s;
    }
  }
}

// out_i = C[t, i, n+1] v + sum_r C[t, r, 1+i] in_r
template <int NS>
__global__ void __launch_bounds__(kThreads) dyn_update_kernel(
    bf16* __restrict__ out, const bf16* __restrict__ in, const bf16* __restrict__ v,
    const float* __restrict__ C, int64_t N, int64_t d) {
  constexpr int Q = NS + 2;
  const int lane = threadIdx.x & 31;
  const int64_t M = N * d, chunks = d / 8;
  MHAR_FOR_EACH_TOKEN(t) {
    float a[NS][NS], b[NS];  // a[r][i] = C[t, r, 1+i], b[i] = C[t, i, n+1]
#pragma unroll
    for (int r = 0; r < NS; ++r) {
      b[r] = C[(t * NS + r) * Q + NS + 1];
#pragma unroll
      for (int i = 0; i < NS; ++i) a[r][i] = C[(t * NS + r) * Q + 1 + i];
    }
    for (int64_t j = lane; j < chunks; j += 32) {
      float h[NS][8], vv[8];
      load8(v + t * d + j * 8, vv);
#pragma unroll
      for (int r = 0; r < NS; ++r) load8(in + r * M + t * d + j * 8, h[r]);
#pragma unroll
      for (int i = 0; i < NS; ++i) {
        float o[8];
#pragma unroll
        for (int k = 0; k < 8; ++k) {
          float acc = b[i] * vv[k];
#pragma unroll
          for (int r = 0; r < NS; ++r) acc = fmaf(a[r][i], h[r][k], acc);
          o[k] = acc;
        }
        store8(out + i * M + t * d + j * 8, o);
      }
    }
  }
}

// din_r = sum_i C[t, r, 1+i] dout_i; dv = sum_i C[t, i, n+1] dout_i;
// dC[t, r, 1+i] = <dout_i, in_r>; dC[t, i, n+1] = <dout_i, v>  (columns 1..n+1 overwritten)
template <int NS>
__global__ void __launch_bounds__(kThreads) dyn_update_backward_kernel(
    bf16* __restrict__ din, bf16* __restrict__ dv, float* __restrict__ dC,
    const bf16* __restrict__ dout, const bf16* __restrict__ in, const bf16* __restrict__ v,
    const float* __restrict__ C, int64_t N, int64_t d) {
  constexpr int Q = NS + 2;
  const int lane = threadIdx.x & 31;
  const int64_t M = N * d, chunks = d / 8;
  MHAR_FOR_EACH_TOKEN(t) {
    float a[NS][NS], b[NS], ga[NS][NS], gb[NS];
#pragma unroll
    for (int i = 0; i < NS; ++i) {
      gb[i] = 0;
      b[i] = C[(t * NS + i) * Q + NS + 1];
#pragma unroll
      for (int r = 0; r < NS; ++r) ga[r][i] = 0, a[i][r] = C[(t * NS + i) * Q + 1 + r];
    }
    for (int64_t j = lane; j < chunks; j += 32) {
      float go[NS][8], vv[8], o[8];
      load8(v + t * d + j * 8, vv);
#pragma unroll
      for (int i = 0; i < NS; ++i) load8(dout + i * M + t * d + j * 8, go[i]);
#pragma unroll
      for (int k = 0; k < 8; ++k) {
        float acc = 0;
#pragma unroll
        for (int i = 0; i < NS; ++i) {
          acc = fmaf(b[i], go[i][k], acc);
          gb[i] = fmaf(go[i][k], vv[k], gb[i]);
        }
        o[k] = acc;
      }
      store8(dv + t * d + j * 8, o);
#pragma unroll
      for (int r = 0; r < NS; ++r) {
        float h[8];
        load8(in + r * M + t * d + j * 8, h);
#pragma unroll
        for (int k = 0; k < 8; ++k) {
          float acc = 0;
#pragma unroll
          for (int i = 0; i < NS; ++i) {
            acc = fmaf(a[r][i], go[i][k], acc);
            ga[r][i] = fmaf(go[i][k], h[k], ga[r][i]);
          }
          o[k] = acc;
        }
        store8(din + r * M + t * d + j * 8, o);
      }
    }
    float* dct = dC + t * NS * Q;
#pragma unroll
    for (int i = 0; i < NS; ++i) {
      const float sb = warp_sum(gb[i]);
      if (lane == ((i * Q + NS + 1) & 31)) dct[i * Q + NS + 1] = sb;
#pragma unroll
      for (int r = 0; r < NS; ++r) {
        const float sa = warp_sum(ga[r][i]);
        if (lane == ((r * Q + 1 + i) & 31)) dct[r * Q + 1 + i] = sa;
      }
    }
  }
}

// The coefficients' backward, per token (the parameter sums are the two kernels below):
//   dz = dC s (1 - T^2);  dhbar[c] = sum_q dz_q W[c, q]
//   dh_r += rs dhbar - h rs^3 <dhbar, h> / d           (RMSNorm without scale)
//   U[t, r, q] = rs dz_q, written for dW[c, q] = sum_{t,r} hbar[c] dz_q = sum h[c] U
// Two passes over the token's chunks: the first for <dhbar, h>, the second recomputes
// dhbar (Q FMAs per element: cheaper than keeping d/32 values per lane and stream).
template <int NS>
__global__ void __launch_bounds__(kThreads) dyn_coef_backward_kernel(
    bf16* __restrict__ dH, float* __restrict__ U, const float* __restrict__ dC,
    const bf16* __restrict__ H, const bf16* __restrict__ W, const float* __restrict__ Tt,
    const float* __restrict__ rstd, const bf16* __restrict__ sa, const bf16* __restrict__ sb,
    int64_t N, int64_t d) {
  constexpr int Q = NS + 2;
  const int lane = threadIdx.x & 31;
  const int64_t M = N * d, chunks = d / 8;
  const float s_a = load(sa[0]), s_b = load(sb[0]);
  MHAR_FOR_EACH_TOKEN(t) {
    float dz[NS][Q], rs[NS], dot[NS];
#pragma unroll
    for (int r = 0; r < NS; ++r) {
      rs[r] = rstd[t * NS + r];
      dot[r] = 0;
#pragma unroll
      for (int q = 0; q < Q; ++q) {
        const int64_t p = (t * NS + r) * Q + q;
        const float th = Tt[p];
        // 1 - T^2 rounded once (fma): no cancellation error near |T| = 1.
        dz[r][q] = dC[p] * (q <= NS ? s_a : s_b) * fmaf(-th, th, 1.0f);
      }
    }
    for (int64_t j = lane; j < chunks; j += 32) {
      float h[NS][8];
#pragma unroll
      for (int r = 0; r < NS; ++r) load8(H + r * M + t * d + j * 8, h[r]);
#pragma unroll
      for (int k = 0; k < 8; ++k) {
        const bf16* w = W + (j * 8 + k) * Q;
        float wq[Q];
#pragma unroll
        for (int q = 0; q < Q; ++q) wq[q] = load(w[q]);
#pragma unroll
        for (int r = 0; r < NS; ++r) {
          float a = 0;
#pragma unroll
          for (int q = 0; q < Q; ++q) a = fmaf(dz[r][q], wq[q], a);
          dot[r] = fmaf(a, h[r][k], dot[r]);
        }
      }
    }
    float coef[NS];
#pragma unroll
    for (int r = 0; r < NS; ++r) coef[r] = rs[r] * rs[r] * rs[r] * (warp_sum(dot[r]) / float(d));
    for (int64_t j = lane; j < chunks; j += 32) {
      float h[NS][8];
#pragma unroll
      for (int r = 0; r < NS; ++r) load8(H + r * M + t * d + j * 8, h[r]);
      float dhb[NS][8];
#pragma unroll
      for (int k = 0; k < 8; ++k) {
        const bf16* w = W + (j * 8 + k) * Q;
        float wq[Q];
#pragma unroll
        for (int q = 0; q < Q; ++q) wq[q] = load(w[q]);
#pragma unroll
        for (int r = 0; r < NS; ++r) {
          float a = 0;
#pragma unroll
          for (int q = 0; q < Q; ++q) a = fmaf(dz[r][q], wq[q], a);
          dhb[r][k] = a;
        }
      }
#pragma unroll
      for (int r = 0; r < NS; ++r) {
        bf16* p = dH + r * M + t * d + j * 8;
        float o[8];
        load8(p, o);
#pragma unroll
        for (int k = 0; k < 8; ++k) o[k] = fmaf(rs[r], dhb[r][k], fmaf(-h[r][k], coef[r], o[k]));
        store8(p, o);
      }
    }
#pragma unroll
    for (int r = 0; r < NS; ++r)
#pragma unroll
      for (int q = 0; q < Q; ++q) {
        const int p = r * Q + q;
        if (lane == (p & 31)) U[t * NS * Q + p] = rs[r] * dz[r][q];
      }
  }
}

// dW's partial sums: block (x, y) owns columns [256 x, 256 x + 256) (lane: 8 of them);
// its warp w takes tokens t = y * kWarps + w, stepping splits * kWarps:
// acc[c, q] = sum over its tokens t and streams r of h_r[t, c] U[t, r, q]. The block's
// warps then add up in warp order in shared memory, and the block writes row y of
// partial [splits, d * Q] (its column range). Every sum has a fixed order.
constexpr int kDynColumns = 32 * 8;  // columns per block
template <int NS>
__global__ void __launch_bounds__(kThreads) dyn_dw_kernel(float* __restrict__ partial,
                                                          const bf16* __restrict__ H,
                                                          const float* __restrict__ U,
                                                          int64_t N, int64_t d) {
  constexpr int Q = NS + 2;
  __shared__ float s[kDynColumns * Q];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int64_t M = N * d, j = int64_t(blockIdx.x) * 32 + lane;
  const bool active = j < d / 8;
  float acc[8][Q];
#pragma unroll
  for (int k = 0; k < 8; ++k)
#pragma unroll
    for (int q = 0; q < Q; ++q) acc[k][q] = 0;
  for (int64_t t = int64_t(blockIdx.y) * kWarps + warp; t < N; t += int64_t(gridDim.y) * kWarps) {
#pragma unroll
    for (int r = 0; r < NS; ++r) {
      float u[Q];
#pragma unroll
      for (int q = 0; q < Q; ++q) u[q] = U[(t * NS + r) * Q + q];
      if (!active) continue;
      float h[8];
      load8(H + r * M + t * d + j * 8, h);
#pragma unroll
      for (int k = 0; k < 8; ++k)
#pragma unroll
        for (int q = 0; q < Q; ++q) acc[k][q] = fmaf(h[k], u[q], acc[k][q]);
    }
  }
  for (int w = 0; w < kWarps; ++w) {
    if (warp == w)
#pragma unroll
      for (int k = 0; k < 8; ++k)
#pragma unroll
        for (int q = 0; q < Q; ++q) {
          float& e = s[(lane * 8 + k) * Q + q];
          e = w == 0 ? acc[k][q] : e + acc[k][q];
        }
    __syncthreads();
  }
  const int64_t c0 = int64_t(blockIdx.x) * kDynColumns;
  float* row = partial + int64_t(blockIdx.y) * d * Q + c0 * Q;
  for (int p = threadIdx.x; p < kDynColumns * Q; p += kThreads)
    if (c0 + p / Q < d) row[p] = s[p];
}

// The static coefficients' and the scales' sums over tokens: block p (< n Q) sums
// column p of dC and of dC * T over the tokens (a fixed order) into partial[2p], [2p+1].
__global__ void __launch_bounds__(kThreads) dyn_param_kernel(float* __restrict__ partial,
                                                             const float* __restrict__ dC,
                                                             const float* __restrict__ Tt,
                                                             int64_t N, int P) {
  const int p = blockIdx.x;
  float g[2] = {0, 0};
  for (int64_t t = threadIdx.x; t < N; t += kThreads) {
    const float v = dC[t * P + p];
    g[0] += v;
    g[1] = fmaf(v, Tt[t * P + p], g[1]);
  }
  block_sums<2>(g, partial + 2 * p);
}

// partial [n Q, 2] into dA_m, dA_r, dB (column 0, 1..n, n+1 of each stream r) and
// ds_a (columns 0..n), ds_b (column n+1), in column order. One block.
__global__ void dyn_param_finish_kernel(float* dAm, float* dAr, float* dB, float* dsa,
                                        float* dsb, const float* partial, int n) {
  const int Q = n + 2;
  for (int p = threadIdx.x; p < n * Q; p += blockDim.x) {
    const int r = p / Q, q = p % Q;
    const float v = partial[2 * p];
    if (q == 0) dAm[r] += v;
    else if (q <= n) dAr[r * n + q - 1] += v;
    else dB[r] += v;
  }
  if (threadIdx.x == 0) {
    float a = 0, b = 0;
    for (int p = 0; p < n * Q; ++p) {
      if (p % Q <= n) a += partial[2 * p + 1];
      else b += partial[2 * p + 1];
    }
    dsa[0] += a;
    dsb[0] += b;
  }
}

#undef MHAR_FOR_EACH_TOKEN

// Calls f(std::integral_constant<int, n>) for n = 1..kHyperMaxStreams.
template <class F> void dispatch_streams(int n, const char* what, F&& f) {
  if (!dispatch_int<1, kHyperMaxStreams>(n, f))
    fail("CUDA ", what, ": residual.hyper_n = ", n, " streams; the CUDA kernels take 1 to ",
         kHyperMaxStreams, " (run more on the CPU backend)");
}

void check_aligned(const Tensor& t, const char* what, const char* name) {
  if (reinterpret_cast<uintptr_t>(t.data) % 16)
    fail("CUDA ", what, ": ", name, " is not 16-byte aligned (the stream kernels read 8 bf16 "
         "at a time)");
}

// n streams of M elements in H; checks its dtype, shape and alignment.
int streams_of(const Tensor& H, int64_t M, const char* what, const char* name) {
  check_dtype(H, DType::BF16, what, name);
  if (M <= 0 || M % 8 || H.ndim < 2 || H.dim(0) * M != H.numel())
    fail("CUDA ", what, ": ", name, " ", H.shape_str(), " is not [n, ", M,
         " elements] with a multiple of 8 elements per stream (d % 8 == 0)");
  check_aligned(H, what, name);
  return int(H.dim(0));
}
void check_row(const Tensor& t, int64_t M, const char* what, const char* name) {
  check_dtype(t, DType::BF16, what, name);
  check_numel(t, M, what, name);
  check_aligned(t, what, name);
}
void check_coef(const Tensor& c, int64_t n, const char* what, const char* name) {
  check_dtype(c, DType::BF16, what, name);
  check_numel(c, n, what, name);
}
void check_grad(const Tensor& g, int64_t n, const char* what, const char* name) {
  check_dtype(g, DType::F32, what, name);
  check_numel(g, n, what, name);
}

// Tensor::ptr<T> checks T against the dtype, which knows no bf16: the views are checked
// by the check_* helpers above instead.
bf16* bf(const Tensor& t) { return static_cast<bf16*>(t.data); }

int blocks_for(int64_t M) { return grid_stride_blocks(M / 8, kThreads); }

float* partial_rows(const HyperWorkspace& ws, int blocks, int P, const char* what) {
  if (ws.data == nullptr || ws.floats < size_t(blocks) * size_t(P))
    fail("CUDA ", what, ": the coefficient-gradient scratch holds ", ws.floats, " floats, ",
         size_t(blocks) * size_t(P), " needed (hyper_workspace_floats)");
  return ws.data;
}

}  // namespace

size_t hyper_workspace_floats(int64_t M, int n) {
  return size_t(blocks_for(M)) * size_t(n * n + n);
}

void hyper_mix(cudaStream_t s, Tensor x, Tensor H, Tensor coef) {
  const char* what = "hyper_mix";
  const int64_t M = x.numel();
  check_row(x, M, what, "x");
  const int n = streams_of(H, M, what, "H");
  if (!coef.empty()) check_coef(coef, n, what, "coef");
  const int blocks = blocks_for(M);
  dispatch_streams(n, what, [&](auto ns) {
    constexpr int NS = decltype(ns)::value;
    mix_kernel<NS><<<blocks, kThreads, 0, s>>>(
        bf(x), bf(H), coef.empty() ? nullptr : bf(coef), M);
  });
  CUDA_CHECK(cudaGetLastError());
}

void hyper_mix_backward(cudaStream_t s, Tensor dH, Tensor dcoef, Tensor dx, Tensor H,
                        Tensor coef, bool accumulate, const HyperWorkspace& ws) {
  const char* what = "hyper_mix_backward";
  const int64_t M = dx.numel();
  check_row(dx, M, what, "dx");
  const int n = streams_of(dH, M, what, "dH");
  const bool has_coef = !coef.empty();
  if (has_coef) {
    check_coef(coef, n, what, "coef");
    check_grad(dcoef, n, what, "dcoef");
    if (streams_of(H, M, what, "H") != n) fail("CUDA ", what, ": H ", H.shape_str(), " dH ", dH.shape_str());
  }
  const int blocks = blocks_for(M);
  float* partial = has_coef ? partial_rows(ws, blocks, n, what) : nullptr;
  dispatch_streams(n, what, [&](auto ns) {
    constexpr int NS = decltype(ns)::value;
    const bf16* h = has_coef ? bf(H) : nullptr;
    const bf16* c = has_coef ? bf(coef) : nullptr;
    auto go = [&](auto kernel) {
      kernel<<<blocks, kThreads, 0, s>>>(bf(dH), partial, bf(dx), h, c, M);
    };
    if (has_coef) {
      if (accumulate) go(mix_backward_kernel<NS, true, true>);
      else go(mix_backward_kernel<NS, true, false>);
    } else {
      if (accumulate) go(mix_backward_kernel<NS, false, true>);
      else go(mix_backward_kernel<NS, false, false>);
    }
  });
  CUDA_CHECK(cudaGetLastError());
  if (has_coef) {
    finish_kernel<<<1, 128, 0, s>>>(dcoef.ptr<float>(), partial, blocks, n, n);
    CUDA_CHECK(cudaGetLastError());
  }
}

void hyper_update(cudaStream_t s, Tensor out, Tensor in, Tensor v, Tensor Ar, Tensor B) {
  const char* what = "hyper_update";
  const int64_t M = v.numel();
  check_row(v, M, what, "v");
  const int n = streams_of(out, M, what, "out");
  if (streams_of(in, M, what, "in") != n || in.data == out.data)
    fail("CUDA ", what, ": in ", in.shape_str(), " must be a buffer of out's shape ",
         out.shape_str(), " other than out");
  check_coef(Ar, int64_t(n) * n, what, "A_r");
  check_coef(B, n, what, "B");
  const int blocks = blocks_for(M);
  dispatch_streams(n, what, [&](auto ns) {
    constexpr int NS = decltype(ns)::value;
    update_kernel<NS><<<blocks, kThreads, 0, s>>>(bf(out), bf(in), bf(v),
                                                   bf(Ar), bf(B), M);
  });
  CUDA_CHECK(cudaGetLastError());
}

void hyper_update_backward(cudaStream_t s, Tensor din, Tensor dv, Tensor dAr, Tensor dB,
                           Tensor dout, Tensor in, Tensor v, Tensor Ar, Tensor B,
                           const HyperWorkspace& ws) {
  const char* what = "hyper_update_backward";
  const int64_t M = v.numel();
  check_row(v, M, what, "v");
  check_row(dv, M, what, "dv");
  const int n = streams_of(dout, M, what, "dout");
  if (streams_of(din, M, what, "din") != n || streams_of(in, M, what, "in") != n ||
      din.data == dout.data)
    fail("CUDA ", what, ": din ", din.shape_str(), " and in ", in.shape_str(),
         " must have dout's shape ", dout.shape_str(), " (din another buffer than dout)");
  check_coef(Ar, int64_t(n) * n, what, "A_r");
  check_coef(B, n, what, "B");
  check_grad(dAr, int64_t(n) * n, what, "dA_r");
  check_grad(dB, n, what, "dB");
  const int blocks = blocks_for(M), P = n * n + n;
  float* partial = partial_rows(ws, blocks, P, what);
  dispatch_streams(n, what, [&](auto ns) {
    constexpr int NS = decltype(ns)::value;
    update_backward_kernel<NS><<<blocks, kThreads, 0, s>>>(
        bf(din), bf(dv), partial, bf(dout), bf(in), bf(v),
        bf(Ar), bf(B), M);
  });
  CUDA_CHECK(cudaGetLastError());
  // dA_r and dB are two parameters (two buffers): one finishing pass each.
  finish_kernel<<<1, 128, 0, s>>>(dAr.ptr<float>(), partial, blocks, n * n, P);
  CUDA_CHECK(cudaGetLastError());
  // dB's sums sit at offset n * n of every row of P.
  finish_kernel<<<1, 128, 0, s>>>(dB.ptr<float>(), partial + n * n, blocks, n, P);
  CUDA_CHECK(cudaGetLastError());
}


// ---- Dynamic Hyper-Connections: host side.
namespace {

struct DynShape {
  int n;
  int64_t N, d;
};
// H [n, N, d] (bf16, d % 8 == 0, 16-byte aligned) and the F32 per-token tensors of that
// n and N: C-shaped [N, n, n+2] ones and rstd [N, n].
DynShape dyn_streams(const Tensor& H, const char* what, const char* name) {
  check_dtype(H, DType::BF16, what, name);
  if (H.ndim != 3 || H.dim(0) < 1 || H.dim(1) < 1 || H.dim(2) < 8 || H.dim(2) % 8)
    fail("CUDA ", what, ": ", name, " ", H.shape_str(), " is not [n, N, d] with d a multiple "
         "of 8 (the stream kernels read 8 bf16 at a time)");
  check_aligned(H, what, name);
  return DynShape{int(H.dim(0)), H.dim(1), H.dim(2)};
}
void check_per_token(const Tensor& t, const DynShape& s, int64_t per, const char* what,
                     const char* name) {
  check_dtype(t, DType::F32, what, name);
  check_numel(t, s.N * s.n * per, what, name);
}
void check_same_streams(const Tensor& t, const DynShape& s, const char* what, const char* name) {
  check_dtype(t, DType::BF16, what, name);
  check_numel(t, int64_t(s.n) * s.N * s.d, what, name);
  check_aligned(t, what, name);
}
int dyn_blocks(int64_t N) { return grid_stride_blocks(N, kWarps); }  // a warp per token

// dW's token splits (rows of its partial sums): about 4 blocks per SM over all column
// groups, each warp at least one token. Depends only on N, d and the device.
int64_t dyn_dw_groups(int64_t d) { return std::max<int64_t>(1, ceil_div(d / 8, 32)); }
int64_t dyn_dw_splits(int64_t N, int64_t d) {
  const int64_t sms8 = grid_stride_blocks(int64_t(1) << 40, 1);  // 8 x the SM count
  const int64_t want = ceil_div(sms8 / 2, dyn_dw_groups(d));
  return std::max<int64_t>(1, std::min(want, ceil_div(N, kWarps)));
}

}  // namespace

size_t hyper_dynamic_workspace_floats(int64_t N, int64_t d, int n) {
  const int64_t Q = n + 2;
  // U [N, n, Q], dW's partial rows [splits, d, Q], the parameter sums [n Q, 2].
  return size_t(N * n * Q + dyn_dw_splits(N, d) * d * Q + 2 * n * Q);
}

void hyper_dynamic_coef(cudaStream_t s, Tensor C, Tensor T, Tensor rstd, Tensor H, Tensor W,
                        Tensor Am, Tensor Ar, Tensor B, Tensor s_a, Tensor s_b, double eps) {
  const char* what = "hyper_dynamic_coef";
  const DynShape sh = dyn_streams(H, what, "H");
  const int n = sh.n, Q = n + 2;
  check_per_token(C, sh, Q, what, "C");
  check_per_token(T, sh, Q, what, "T");
  check_per_token(rstd, sh, 1, what, "rstd");
  check_coef(W, sh.d * Q, what, "W");
  check_coef(Am, n, what, "A_m");
  check_coef(Ar, int64_t(n) * n, what, "A_r");
  check_coef(B, n, what, "B");
  check_coef(s_a, 1, what, "s_a");
  check_coef(s_b, 1, what, "s_b");
  dispatch_streams(n, what, [&](auto ns) {
    constexpr int NS = decltype(ns)::value;
    dyn_coef_kernel<NS><<<dyn_blocks(sh.N), kThreads, 0, s>>>(
        C.ptr<float>(), T.ptr<float>(), rstd.ptr<float>(), bf(H), bf(W), bf(Am), bf(Ar), bf(B),
        bf(s_a), bf(s_b), sh.N, sh.d, float(eps));
  });
  CUDA_CHECK(cudaGetLastError());
}

void hyper_mix_dynamic(cudaStream_t s, Tensor x, Tensor H, Tensor C) {
  const char* what = "hyper_mix_dynamic";
  const DynShape sh = dyn_streams(H, what, "H");
  check_row(x, sh.N * sh.d, what, "x");
  check_per_token(C, sh, sh.n + 2, what, "C");
  dispatch_streams(sh.n, what, [&](auto ns) {
    constexpr int NS = decltype(ns)::value;
    dyn_mix_kernel<NS><<<dyn_blocks(sh.N), kThreads, 0, s>>>(bf(x), bf(H), C.ptr<float>(),
                                                              sh.N, sh.d);
  });
  CUDA_CHECK(cudaGetLastError());
}

void hyper_mix_dynamic_backward(cudaStream_t s, Tensor dH, Tensor dC, Tensor dx, Tensor H,
                                Tensor C) {
  const char* what = "hyper_mix_dynamic_backward";
  const DynShape sh = dyn_streams(H, what, "H");
  check_same_streams(dH, sh, what, "dH");
  check_row(dx, sh.N * sh.d, what, "dx");
  check_per_token(C, sh, sh.n + 2, what, "C");
  check_per_token(dC, sh, sh.n + 2, what, "dC");
  dispatch_streams(sh.n, what, [&](auto ns) {
    constexpr int NS = decltype(ns)::value;
    dyn_mix_backward_kernel<NS><<<dyn_blocks(sh.N), kThreads, 0, s>>>(
        bf(dH), dC.ptr<float>(), bf(dx), bf(H), C.ptr<float>(), sh.N, sh.d);
  });
  CUDA_CHECK(cudaGetLastError());
}

void hyper_update_dynamic(cudaStream_t s, Tensor out, Tensor in, Tensor v, Tensor C) {
  const char* what = "hyper_update_dynamic";
  const DynShape sh = dyn_streams(in, what, "in");
  check_same_streams(out, sh, what, "out");
  if (out.data == in.data) fail("CUDA ", what, ": out must be another buffer than in");
  check_row(v, sh.N * sh.d, what, "v");
  check_per_token(C, sh, sh.n + 2, what, "C");
  dispatch_streams(sh.n, what, [&](auto ns) {
    constexpr int NS = decltype(ns)::value;
    dyn_update_kernel<NS><<<dyn_blocks(sh.N), kThreads, 0, s>>>(bf(out), bf(in), bf(v),
                                                                 C.ptr<float>(), sh.N, sh.d);
  });
  CUDA_CHECK(cudaGetLastError());
}

void hyper_update_dynamic_backward(cudaStream_t s, Tensor din, Tensor dv, Tensor dC, Tensor dout,
                                   Tensor in, Tensor v, Tensor C) {
  const char* what = "hyper_update_dynamic_backward";
  const DynShape sh = dyn_streams(in, what, "in");
  check_same_streams(din, sh, what, "din");
  check_same_streams(dout, sh, what, "dout");
  if (din.data == dout.data) fail("CUDA ", what, ": din must be another buffer than dout");
  check_row(v, sh.N * sh.d, what, "v");
  check_row(dv, sh.N * sh.d, what, "dv");
  check_per_token(C, sh, sh.n + 2, what, "C");
  check_per_token(dC, sh, sh.n + 2, what, "dC");
  dispatch_streams(sh.n, what, [&](auto ns) {
    constexpr int NS = decltype(ns)::value;
    dyn_update_backward_kernel<NS><<<dyn_blocks(sh.N), kThreads, 0, s>>>(
        bf(din), bf(dv), dC.ptr<float>(), bf(dout), bf(in), bf(v), C.ptr<float>(), sh.N, sh.d);
  });
  CUDA_CHECK(cudaGetLastError());
}

void hyper_dynamic_coef_backward(cudaStream_t s, Tensor dH, Tensor dW, Tensor dAm, Tensor dAr,
                                 Tensor dB, Tensor ds_a, Tensor ds_b, Tensor dC, Tensor H,
                                 Tensor W, Tensor T, Tensor rstd, Tensor s_a, Tensor s_b,
                                 const HyperWorkspace& ws) {
  const char* what = "hyper_dynamic_coef_backward";
  const DynShape sh = dyn_streams(H, what, "H");
  const int n = sh.n, Q = n + 2;
  const int64_t N = sh.N, d = sh.d;
  check_same_streams(dH, sh, what, "dH");
  check_per_token(dC, sh, Q, what, "dC");
  check_per_token(T, sh, Q, what, "T");
  check_per_token(rstd, sh, 1, what, "rstd");
  check_coef(W, d * Q, what, "W");
  check_coef(s_a, 1, what, "s_a");
  check_coef(s_b, 1, what, "s_b");
  check_grad(dW, d * Q, what, "dW");
  check_grad(dAm, n, what, "dA_m");
  check_grad(dAr, int64_t(n) * n, what, "dA_r");
  check_grad(dB, n, what, "dB");
  check_grad(ds_a, 1, what, "ds_a");
  check_grad(ds_b, 1, what, "ds_b");
  const size_t need = hyper_dynamic_workspace_floats(N, d, n);
  if (ws.data == nullptr || ws.floats < need)
    fail("CUDA ", what, ": the scratch holds ", ws.floats, " floats, ", need,
         " needed (hyper_dynamic_workspace_floats)");
  const int64_t splits = dyn_dw_splits(N, d), groups = dyn_dw_groups(d);
  float* U = ws.data;
  float* dw_rows = U + N * n * Q;
  float* param_rows = dw_rows + splits * d * Q;
  dispatch_streams(n, what, [&](auto ns) {
    constexpr int NS = decltype(ns)::value;
    dyn_coef_backward_kernel<NS><<<dyn_blocks(N), kThreads, 0, s>>>(
        bf(dH), U, dC.ptr<float>(), bf(H), bf(W), T.ptr<float>(), rstd.ptr<float>(), bf(s_a),
        bf(s_b), N, d);
    CUDA_CHECK(cudaGetLastError());
    dyn_dw_kernel<NS><<<dim3(unsigned(groups), unsigned(splits)), kThreads, 0, s>>>(dw_rows,
                                                                                   bf(H), U, N, d);
  });
  CUDA_CHECK(cudaGetLastError());
  finish_kernel<<<int(ceil_div(d * Q, 256)), 256, 0, s>>>(dW.ptr<float>(), dw_rows, int(splits),
                                                          d * Q, d * Q);
  CUDA_CHECK(cudaGetLastError());
  dyn_param_kernel<<<n * Q, kThreads, 0, s>>>(param_rows, dC.ptr<float>(), T.ptr<float>(), N,
                                              n * Q);
  CUDA_CHECK(cudaGetLastError());
  dyn_param_finish_kernel<<<1, 128, 0, s>>>(dAm.ptr<float>(), dAr.ptr<float>(), dB.ptr<float>(),
                                            ds_a.ptr<float>(), ds_b.ptr<float>(), param_rows, n);
  CUDA_CHECK(cudaGetLastError());
}

}  // namespace mhar::cuda
