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
// Not measured on a GPU yet (the lead's H200 run): bandwidth against the copy's is open.
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
__global__ void finish_kernel(float* grad, const float* partial, int blocks, int count,
                              int stride) {
  for (int p = threadIdx.x; p < count; p += blockDim.x) {
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

// Calls f(std::integral_constant<int, n>) for n = 1..kMaxStreams.
template <class F> void dispatch_streams(int n, const char* what, F&& f) {
  switch (n) {
    case 1: f(std::integral_constant<int, 1>{}); return;
    case 2: f(std::integral_constant<int, 2>{}); return;
    case 3: f(std::integral_constant<int, 3>{}); return;
    case 4: f(std::integral_constant<int, 4>{}); return;
    case 5: f(std::integral_constant<int, 5>{}); return;
    case 6: f(std::integral_constant<int, 6>{}); return;
    case 7: f(std::integral_constant<int, 7>{}); return;
    case 8: f(std::integral_constant<int, 8>{}); return;
    default:
      fail("CUDA ", what, ": residual.hyper_n = ", n, " streams; the CUDA kernels take 1 to ",
           kHyperMaxStreams, " (run more on the CPU backend)");
  }
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

}  // namespace mhar::cuda
