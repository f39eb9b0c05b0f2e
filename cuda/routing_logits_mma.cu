// routing_logits_mma.cu: one slot's routing logits and inv_rms on tensor cores (logits
// version 5 in routing.cu's lab numbering, the default where its shapes allow). Per head
// the logits are a product with a token-independent operand, raw [tokens x sites] =
// V [tokens x dh] QG^T (qg = q * g), each row then scaled by its token's inv_rms. The path
// for other shapes runs it as two cuBLAS GEMMs (q*g's bf16 hi and lo parts) between an
// inv_rms kernel and a scaling pass: v read three times and the logits twice more
// (cuda/NOTES.md, lead 7).
// - Two launches a slot: logits_mma_table_kernel writes q*g as bf16 hi + lo, records of 4
//   channels [hi01 hi23 lo01 lo23] (16 bytes, [site][d / 4]); logits_mma_kernel stages
//   that table in shared memory (cp.async, while its warps load their first rows) and
//   reads v once.
// - A warp takes 16 tokens and every head: mma.m16n8k16 with the tokens as M (rows g and
//   g + 8 of the fragment), the sites as N (8 a tile), the head's channels as K. v is A,
//   straight from global memory: in k-step s of a head, lane t's four k values are
//   channels 16 s + 4 t .. + 3 (one 8-byte load a row; k = 2t, 2t + 1 take the first two,
//   k = 2t + 8, 2t + 9 the last two), the table's records follow the same map, so B is
//   one 16-byte shared load for hi and lo together. The accumulators keep every head's
//   logits (heads x ceil(ns / 8) x 4 floats a lane) until the row's sum of squares, taken
//   from the same A registers and added over the 4 lanes of a row, gives inv_rms.
// - Numerics: v exact in bf16, q*g (exact in fp32) as hi + lo to ~2^-16 relative, fp32
//   accumulation: as the GEMM path, another order of sums (the CPU parity bound).
// - Shared layout: the table's site rows padded to a stride of 4 mod 8 records, so the two
//   rows an 8-lane phase reads fall in different bank groups.
// Measured: routing.cu, the Logits versions' comment.
#include <algorithm>

#include "cuda/attention_mma.cuh"
#include "cuda/routing_logits_mma.h"

namespace mhar::cuda {
namespace {

using attn_mma::cp_async16;
using attn_mma::cp_async_commit;
using attn_mma::cp_async_wait;
using attn_mma::mma;

constexpr int kHeadDim = 128;
constexpr int kKSteps = kHeadDim / 16;
constexpr int kWarps = 4;  // a block: 64 tokens

__global__ void logits_mma_table_kernel(uint4* __restrict__ table, const LogitsMmaSites p, int ns,
                                        int d) {
  const int records = d / 4;
  for (int64_t e = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; e < int64_t(ns) * records;
       e += int64_t(gridDim.x) * blockDim.x) {
    const int k = int(e / records), c = 4 * int(e % records);
    float x[4];
#pragma unroll
    for (int j = 0; j < 4; ++j)
      x[j] = __bfloat162float(p.q[k][c + j]) * __bfloat162float(p.g[k][c + j]);  // exact
    uint4 r;
    split_bf16x2(x[0], x[1], r.x, r.z);
    split_bf16x2(x[2], x[3], r.y, r.w);
    table[e] = r;
  }
}

// The table's shared row stride in records: d / 4 rounded up to 4 mod 8.
__host__ __device__ constexpr int table_stride(int d) {
  return d / 4 + ((4 - (d / 4) % 8) + 8) % 8;
}

__device__ __forceinline__ float sum_squares(const uint2& u) {
  const float a = __uint_as_float(u.x << 16), b = __uint_as_float(u.x & 0xffff0000u);
  const float c = __uint_as_float(u.y << 16), e = __uint_as_float(u.y & 0xffff0000u);
  return a * a + b * b + c * c + e * e;
}

struct Args {
  float* w;
  float* inv_rms;
  const bf16* v;
  const uint4* table;
  int64_t N;
  int ns;
  float eps;
};

template <int H, int NT>
__global__ void __launch_bounds__(32 * kWarps) logits_mma_kernel(const Args a) {
  constexpr int D = H * kHeadDim, RECORDS = D / 4, STRIDE = table_stride(D);
  extern __shared__ __align__(16) uint4 qs[];  // [8 NT sites][STRIDE records]
  for (int i = threadIdx.x; i < 8 * NT * RECORDS; i += 32 * kWarps) {
    const int k = i / RECORDS, c = i % RECORDS;
    cp_async16(qs + k * STRIDE + c, k < a.ns ? a.table + i : a.table, k < a.ns);
  }
  cp_async_commit();

  const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
  const int64_t n0 = (int64_t(blockIdx.x) * kWarps + (threadIdx.x >> 5)) * 16;
  const int64_t na = n0 + g, nb = n0 + g + 8;  // this lane's two tokens (rows g, g + 8)
  const bool oka = na < a.N, okb = nb < a.N;
  const uint2* va = reinterpret_cast<const uint2*>(a.v + (oka ? na : 0) * D);
  const uint2* vb = reinterpret_cast<const uint2*>(a.v + (okb ? nb : 0) * D);
  // Head h, k-step s: channels h 128 + 16 s + 4 t .. + 3, 8 bytes: uint2 h 32 + 4 s + t.
  auto load_head = [&](int h, uint2(&rows)[kKSteps][2]) {
#pragma unroll
    for (int s = 0; s < kKSteps; ++s) {
      const int at = h * (kHeadDim / 4) + 4 * s + t;
      rows[s][0] = oka ? va[at] : make_uint2(0, 0);
      rows[s][1] = okb ? vb[at] : make_uint2(0, 0);
    }
  };
  uint2 cur[kKSteps][2];
  load_head(0, cur);
  cp_async_wait<0>();
  __syncthreads();

  float acc[H][NT][4];
#pragma unroll
  for (int h = 0; h < H; ++h)
#pragma unroll
    for (int nt = 0; nt < NT; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) acc[h][nt][e] = 0.f;
  float ssa = 0.f, ssb = 0.f;
#pragma unroll
  for (int h = 0; h < H; ++h) {
    uint2 next[kKSteps][2];
    if (h + 1 < H) load_head(h + 1, next);  // in flight during this head's products
#pragma unroll
    for (int s = 0; s < kKSteps; ++s) {
      ssa += sum_squares(cur[s][0]);
      ssb += sum_squares(cur[s][1]);
      // a0a1: row g, k 2t..2t+1; a2a3: row g + 8; a4a5, a6a7: k 2t+8..2t+9.
      const uint32_t frag[4] = {cur[s][0].x, cur[s][1].x, cur[s][0].y, cur[s][1].y};
#pragma unroll
      for (int nt = 0; nt < NT; ++nt) {
        const uint4 b = qs[(8 * nt + g) * STRIDE + h * (kHeadDim / 4) + 4 * s + t];
        mma(acc[h][nt], frag, b.x, b.y);  // q*g's hi part
        mma(acc[h][nt], frag, b.z, b.w);  // and its lo part
      }
    }
    if (h + 1 < H) {
#pragma unroll
      for (int s = 0; s < kKSteps; ++s) cur[s][0] = next[s][0], cur[s][1] = next[s][1];
    }
  }
  // A row's sum of squares: its 4 lanes (t) hold disjoint channels.
  ssa += __shfl_xor_sync(0xffffffffu, ssa, 1);
  ssa += __shfl_xor_sync(0xffffffffu, ssa, 2);
  ssb += __shfl_xor_sync(0xffffffffu, ssb, 1);
  ssb += __shfl_xor_sync(0xffffffffu, ssb, 2);
  const float ra = rsqrtf(ssa / float(D) + a.eps), rb = rsqrtf(ssb / float(D) + a.eps);
  if (t == 0) {
    if (oka) a.inv_rms[na] = ra;
    if (okb) a.inv_rms[nb] = rb;
  }
  // c0, c1: token g, sites 8 nt + 2t, + 1; c2, c3: token g + 8.
#pragma unroll
  for (int h = 0; h < H; ++h)
#pragma unroll
    for (int nt = 0; nt < NT; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int k = 8 * nt + 2 * t + (e & 1);
        const bool second = e >= 2;
        if (k >= a.ns || !(second ? okb : oka)) continue;
        a.w[(int64_t(k) * H + h) * a.N + (second ? nb : na)] = (second ? rb : ra) * acc[h][nt][e];
      }
}

template <int H, int NT>
void launch(cudaStream_t s, const Args& a) {
  const size_t smem = size_t(8) * NT * table_stride(H * kHeadDim) * sizeof(uint4);
  auto kernel = logits_mma_kernel<H, NT>;
  static const bool allowed = [&] {
    if (smem > 48 * 1024)
      CUDA_CHECK(
          cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem)));
    return true;
  }();
  (void)allowed;
  kernel<<<unsigned(ceil_div(a.N, int64_t(16 * kWarps))), 32 * kWarps, smem, s>>>(a);
  CUDA_CHECK_LAUNCH();
}

}  // namespace

bool logits_mma_applies(int64_t N, int d, int heads, int ns, const void* v) {
  if (N <= 0 || ns <= 0 || heads <= 0 || d != heads * kHeadDim) return false;
  if ((reinterpret_cast<uintptr_t>(v) & 7u) != 0) return false;
  return (heads == 4 && ns <= 32) || (heads == 8 && ns <= 16);
}

size_t logits_mma_table_bytes(int d, int ns) { return size_t(ns) * size_t(d / 4) * sizeof(uint4); }

bool logits_mma(cudaStream_t s, float* w, float* inv_rms, const bf16* v,
                const LogitsMmaSites& sites, void* table, int64_t N, int d, int heads, int ns,
                float eps) {
  if (!logits_mma_applies(N, d, heads, ns, v)) return false;
  auto* records = static_cast<uint4*>(table);
  logits_mma_table_kernel<<<unsigned(ceil_div(int64_t(ns) * (d / 4), 256)), 256, 0, s>>>(
      records, sites, ns, d);
  CUDA_CHECK_LAUNCH();
  const Args a{w, inv_rms, v, records, N, ns, eps};
  const int nt = (ns + 7) / 8;
  if (heads == 4) {
    if (nt == 1) launch<4, 1>(s, a);
    else if (nt == 2) launch<4, 2>(s, a);
    else if (nt == 3) launch<4, 3>(s, a);
    else launch<4, 4>(s, a);
  } else {
    if (nt == 1) launch<8, 1>(s, a);
    else launch<8, 2>(s, a);
  }
  return true;
}

}  // namespace mhar::cuda
