// routing_key_grad_mma.cu: a slot's key gradients on tensor cores (key-gradient version 3
// in routing_key_grads.cu's lab numbering, the default). Per head they are a matrix product,
// G [ns sites x dh] = DSR [ns x tokens] V [tokens x dh], summed over a slab's tokens into
// that slab of gsum (slabs added later by routing_param_grads, as for versions 1-2).
// Versions 1-2 run it as cuBLAS GEMMs of ~32 tiles or as CUDA-core FMAs per token (ncu at
// 100M: key_grad_kernel<8> at 0.97 TB/s, latency-bound); here it is memory-bound by design.
// - Block: 8 warps over 128 features (a warp two n8 tiles of mma.m16n8k16, inside one
//   head: dh % 16 == 0), all 16 MT sites of a site group (MT m16 tiles; grid z the groups),
//   the tokens of one slab in stages of 64 tokens (4 k-steps of 16).
// - Numerics: ds r (fp32) enters as bf16 hi + lo (hi = bf16(x), lo = bf16(x - hi): x to
//   ~2^-16 relative), two mmas a tile, as version 1's two GEMMs; v is exact in bf16; fp32
//   accumulation. Each (site, feature) of a slab is one mma chain in token order, so the
//   bits repeat run to run; they are not version 2's (another order and rounding), within
//   the CPU parity bound.
// - K order: in a k-step, the mma's k maps to token step_token(k), so that the four A
//   values a lane holds per row are 4 consecutive tokens (one 16-byte shared load); B's
//   ldmatrix rows follow the same map (a sum over k does not care which token is which k).
// - Staging: v by cp.async in kStages stages (zero-filled past the slab and past d). ds r
//   (zero past the slot's sites, heads and the slab) either through registers, loaded a
//   stage ahead, split, and stored as 16-byte groups of 4 tokens [hi01 hi23 lo01 lo23]
//   (version 3), or by cp.async as fp32 with v, each warp splitting what it reads
//   (version 4, ASYNC: the same split, so the same bits). Why 4: ncu of version 3 at 100M
//   (twenty-fourth session) found 39% of its warps' cycles waiting on the ds r loads, which
//   a stage's 4 k-steps of products do not cover.
// - Shared layouts: v [64 tokens][16 chunks of 16 bytes], chunk c stored at c ^
//   v_swizzle(token), which puts the 8 rows of every ldmatrix matrix (tokens {0,1,4,5,8,9,
//   12,13} or {2,3,6,7,...} of a k-step) in 8 different bank groups; ds r rows [head]
//   [site] of kRowWords words (64 + 16 pad: a row step is 4 bank groups, so the two rows
//   an 8-lane phase reads do not share banks).
#include <algorithm>

#include "cuda/attention_mma.cuh"
#include "cuda/routing_key_grad_mma.h"

namespace mhar::cuda {
namespace {

using attn_mma::cp_async16;
using attn_mma::cp_async_commit;
using attn_mma::cp_async_wait;
using attn_mma::ldmatrix_x4_trans;
using attn_mma::mma;

constexpr int kWarps = 8;
constexpr int kBlockFeatures = 16 * kWarps;  // 128
constexpr int kChunks = kBlockFeatures / 8;  // 16-byte chunks of a token's block row
constexpr int kStepTokens = 64;
constexpr int kKSteps = kStepTokens / 16;
constexpr int kStages = 3;
constexpr int kRowWords = kStepTokens + 16;  // a staged ds r row: 64 tokens' hi/lo + pad
constexpr int kVStageBytes = kStepTokens * kChunks * 16;
constexpr int kMaxSpan = 4;  // heads a block's 128 features may span (registers for ds r)

__device__ __forceinline__ int step_token(int k) {
  return ((k & 7) >> 1) * 4 + (k >> 3) * 2 + (k & 1);
}
__device__ __forceinline__ int v_swizzle(int token) {
  return (((token >> 2) & 3) << 1) | (token & 1);
}

// 4 bytes global -> shared, zero-filled when !valid (cp.async's 16-byte form needs a
// 16-byte aligned source: ds r rows where N % 4 != 0).
__device__ __forceinline__ void cp_async4(void* dst, const void* src, bool valid) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 800
  __trap();
#else
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(smem_addr(dst)), "l"(src),
               "r"(valid ? 4 : 0));
#endif
}

// The heads block y's 128 features touch: the first, and how many.
__host__ __device__ inline int first_head(int y, int dh) { return y * kBlockFeatures / dh; }
inline int heads_spanned(int y, int d, int dh) {
  const int last = std::min(y * kBlockFeatures + kBlockFeatures, d) - 1;
  return last / dh - first_head(y, dh) + 1;
}

struct Args {
  float* gsum;
  const float* dsr;
  const bf16* v;
  int64_t N, per;  // tokens; a slab's share (a multiple of 16)
  int d, H, dh, sites, source, ns, span;
};

size_t smem_bytes(int mt, int span) {
  return size_t(kStages) * (kVStageBytes + size_t(span) * 16 * mt * kRowWords * 4);
}

// ASYNC (version 4): ds r copied by cp.async as fp32 (no register round trip; the stage's
// warps each split the values they read), else through registers, split once.
template <int MT, bool ASYNC>
__global__ void __launch_bounds__(32 * kWarps) key_grad_mma_kernel(const Args a) {
  constexpr int M = 16 * MT;  // a site group
  extern __shared__ __align__(16) unsigned char smem[];
  const int rows = a.span * M;  // staged ds r rows a stage, [head][site]
  uint4* vs = reinterpret_cast<uint4*>(smem);
  uint32_t* ws = reinterpret_cast<uint32_t*>(smem + kStages * kVStageBytes);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, t = lane & 3;
  const int slab = blockIdx.x, k0 = int(blockIdx.z) * M;
  const int ns = min(a.ns - k0, M);
  const int64_t n0 = min(a.N, a.per * slab), n1 = min(a.N, n0 + a.per);
  const int steps = int((n1 - n0 + kStepTokens - 1) / kStepTokens);
  if (steps == 0) return;  // uniform over the block
  const int f_block = int(blockIdx.y) * kBlockFeatures, h0 = first_head(blockIdx.y, a.dh);
  const int f_warp = f_block + 16 * warp;
  const int head_row = min(min(f_warp, a.d - 1) / a.dh - h0, a.span - 1);
  const bool rows_aligned = a.N % 4 == 0;  // every ds r group of 4 tokens 16-byte aligned

  // This thread's i-th group of 4 tokens of a stage's ds r: its staged row ([head][site])
  // and record, the head and site it holds, and its first token.
  struct Group {
    int row, record, head, site;
    int64_t n;
  };
  auto group = [&](int i, int step) {
    const int idx = threadIdx.x + 32 * kWarps * i, row = idx >> 4;
    return Group{row, idx & 15, h0 + row / M, row % M,
                 n0 + int64_t(step) * kStepTokens + 4 * (idx & 15)};
  };
  float4 ahead[ASYNC ? 1 : kMaxSpan * MT];  // this thread's ds r groups of the stage loading
  auto load_dsr = [&](int step) {
#pragma unroll
    for (int i = 0; i < kMaxSpan * MT; ++i) {
      if (i >= a.span * MT) break;
      const auto [row, record, head, site, n] = group(i, step);
      float4 x = make_float4(0.f, 0.f, 0.f, 0.f);
      if (site < ns && head < a.H && n < n1) {
        const float* p = a.dsr + (int64_t(k0 + site) * a.H + head) * a.N + n;
        if (rows_aligned) {
          x = *reinterpret_cast<const float4*>(p);  // n1 is a multiple of 4 here
        } else {
          x.x = p[0];
          x.y = n + 1 < n1 ? p[1] : 0.f;
          x.z = n + 2 < n1 ? p[2] : 0.f;
          x.w = n + 3 < n1 ? p[3] : 0.f;
        }
      }
      ahead[i] = x;
    }
  };
  auto load_dsr_async = [&](int step, int buf) {
    float* w = reinterpret_cast<float*>(ws) + buf * rows * kRowWords;
#pragma unroll
    for (int i = 0; i < kMaxSpan * MT; ++i) {
      if (i >= a.span * MT) break;
      const auto [row, record, head, site, n] = group(i, step);
      const bool ok = site < ns && head < a.H;
      const float* p = ok ? a.dsr + (int64_t(k0 + site) * a.H + head) * a.N + n : a.dsr;
      float* dst = w + row * kRowWords + 4 * record;
      if (rows_aligned) {
        cp_async16(dst, ok && n < n1 ? p : a.dsr, ok && n < n1);  // n1 a multiple of 4
      } else {
#pragma unroll
        for (int e = 0; e < 4; ++e)
          cp_async4(dst + e, ok && n + e < n1 ? p + e : a.dsr, ok && n + e < n1);
      }
    }
  };
  auto store_dsr = [&](int buf) {
    uint32_t* w = ws + buf * rows * kRowWords;
#pragma unroll
    for (int i = 0; i < kMaxSpan * MT; ++i) {
      if (i >= a.span * MT) break;
      const Group at = group(i, 0);
      const float4 x = ahead[i];
      uint4 parts;  // [hi01 hi23 lo01 lo23]
      split_bf16x2(x.x, x.y, parts.x, parts.z);
      split_bf16x2(x.z, x.w, parts.y, parts.w);
      reinterpret_cast<uint4*>(w + at.row * kRowWords)[at.record] = parts;
    }
  };
  auto load_v = [&](int step, int buf) {
    const int64_t base = n0 + int64_t(step) * kStepTokens;
    uint4* dst = vs + buf * kStepTokens * kChunks;
#pragma unroll
    for (int i = 0; i < kStepTokens * kChunks / (32 * kWarps); ++i) {
      const int idx = threadIdx.x + 32 * kWarps * i, token = idx / kChunks, c = idx % kChunks;
      const int64_t n = base + token;
      const int chunk = f_block / 8 + c;
      const bool ok = n < n1 && chunk < a.d / 8;
      cp_async16(dst + token * kChunks + (c ^ v_swizzle(token)),
                 ok ? a.v + n * a.d + int64_t(chunk) * 8 : a.v, ok);
    }
  };

  float acc[MT][2][4];
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int nt = 0; nt < 2; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) acc[mt][nt][e] = 0.f;
  // ldmatrix: lanes 8 m .. 8 m + 7 give matrix m's rows: k-half m & 1, n-tile m >> 1.
  const int ld_k = (lane >> 3 & 1) * 8 + (lane & 7), ld_chunk = 2 * warp + (lane >> 4);

#pragma unroll
  for (int s = 0; s < kStages - 1; ++s) {
    if (s < steps) {
      load_v(s, s);
      if constexpr (ASYNC) {
        load_dsr_async(s, s);
      } else {
        load_dsr(s);
        store_dsr(s);
      }
    }
    cp_async_commit();
  }
  for (int it = 0; it < steps; ++it) {
    const int next = it + kStages - 1;
    if (!ASYNC && next < steps) load_dsr(next);  // in flight during this stage's products
    cp_async_wait<kStages - 2>();
    __syncthreads();  // stage it landed for all; stage it - 1's buffers are free
    if (next < steps) {
      load_v(next, next % kStages);
      if constexpr (ASYNC) load_dsr_async(next, next % kStages);
    }
    cp_async_commit();
    const int buf = it % kStages;
    const uint4* vb = vs + buf * kStepTokens * kChunks;
    const uint32_t* wb = ws + (buf * rows + head_row * M) * kRowWords;
#pragma unroll
    for (int j = 0; j < kKSteps; ++j) {
      const int token = 16 * j + step_token(ld_k);
      uint32_t b[4];
      ldmatrix_x4_trans(b, vb + token * kChunks + (ld_chunk ^ v_swizzle(token)));
#pragma unroll
      for (int mt = 0; mt < MT; ++mt) {
        const uint32_t* r = wb + (16 * mt + g) * kRowWords + (4 * j + t) * 4;
        uint32_t hi[4], lo[4];  // rows g, g + 8 x tokens 4t, 4t + 1 | 4t + 2, 4t + 3
        if constexpr (ASYNC) {
          const float4 x0 = *reinterpret_cast<const float4*>(r);
          const float4 x1 = *reinterpret_cast<const float4*>(r + 8 * kRowWords);
          split_bf16x2(x0.x, x0.y, hi[0], lo[0]);
          split_bf16x2(x1.x, x1.y, hi[1], lo[1]);
          split_bf16x2(x0.z, x0.w, hi[2], lo[2]);
          split_bf16x2(x1.z, x1.w, hi[3], lo[3]);
        } else {
          const uint4 x0 = *reinterpret_cast<const uint4*>(r);
          const uint4 x1 = *reinterpret_cast<const uint4*>(r + 8 * kRowWords);
          hi[0] = x0.x, hi[1] = x1.x, hi[2] = x0.y, hi[3] = x1.y;
          lo[0] = x0.z, lo[1] = x1.z, lo[2] = x0.w, lo[3] = x1.w;
        }
        mma(acc[mt][0], hi, b[0], b[1]);
        mma(acc[mt][0], lo, b[0], b[1]);
        mma(acc[mt][1], hi, b[2], b[3]);
        mma(acc[mt][1], lo, b[2], b[3]);
      }
    }
    if (!ASYNC && next < steps) store_dsr(next % kStages);
  }

  // c0, c1: site g, features 2t, 2t + 1 of the n-tile; c2, c3: site g + 8.
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int nt = 0; nt < 2; ++nt) {
      const int f = f_warp + 8 * nt + 2 * t;
      if (f >= a.d) continue;
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const int site = 16 * mt + g + 8 * half;
        if (site >= ns) continue;
        float2* p = reinterpret_cast<float2*>(
            a.gsum + (int64_t(slab) * a.sites + a.source + k0 + site) * a.d + f);
        float2 sum = *p;
        sum.x += acc[mt][nt][2 * half];
        sum.y += acc[mt][nt][2 * half + 1];
        *p = sum;
      }
    }
}

int span_of(int d, int dh) {
  int span = 1;
  for (int y = 0; y * kBlockFeatures < d; ++y) span = std::max(span, heads_spanned(y, d, dh));
  return span;
}

}  // namespace

bool key_grad_mma_applies(int64_t N, int d, int heads, const void* dsr, const void* v) {
  if (N <= 0 || d <= 0 || heads <= 0 || d % heads != 0) return false;
  const int dh = d / heads;
  return d % 8 == 0 && dh % 16 == 0 && span_of(d, dh) <= kMaxSpan && aligned16(dsr) && aligned16(v);
}

bool key_grad_mma(cudaStream_t s, float* gsum, const float* dsr, const bf16* v, int64_t N, int d,
                  int heads, int sites, int source, int ns, int slabs, bool async_dsr) {
  if (ns <= 0 || slabs <= 0 || !key_grad_mma_applies(N, d, heads, dsr, v)) return false;
  Args a{gsum, dsr, v, N, 0, d, heads, d / heads, sites, source, ns, 0};
  a.per = ceil_div(ceil_div(N, slabs), 16) * 16;
  a.span = span_of(d, a.dh);
  auto launch = [&](auto mt_tag) {
    constexpr int MT = decltype(mt_tag)::value;
    const size_t smem = smem_bytes(MT, a.span);
    auto kernel = async_dsr ? key_grad_mma_kernel<MT, true> : key_grad_mma_kernel<MT, false>;
    if (smem > 48 * 1024)
      CUDA_CHECK(
          cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem)));
    const dim3 grid(unsigned(slabs), unsigned(ceil_div(d, kBlockFeatures)),
                    unsigned(ceil_div(ns, 16 * MT)));
    kernel<<<grid, 32 * kWarps, smem, s>>>(a);
    CUDA_CHECK_LAUNCH();
  };
  if (ns <= 16)
    launch(std::integral_constant<int, 1>{});
  else
    launch(std::integral_constant<int, 2>{});
  return true;
}

}  // namespace mhar::cuda
