// attention_tc.cu: the BF16 tensor-core attention on mma.sync (sm_80 and later; on
// compute capability 9.0 attention.cu prefers attention_hopper.cu). Conventions:
// attention.cu's header.
// FlashAttention-2 style on mma.sync.m16n8k16 (bf16 operands, fp32 accumulation), tiles
// staged in shared memory by cp.async (16-byte chunks, rows padded by 16 bytes so that
// ldmatrix reads are free of bank conflicts), two stages deep.
// - forward: a block owns 64 query rows of one (b, h), 16 per warp, Q fragments kept in
//   registers; it walks key tiles of 64 up to the diagonal (causal block skipping; only
//   the diagonal tile is masked) with an online softmax in the exp2 domain. P is rounded
//   to bf16 for the P.V product (register reuse: the S accumulator is the A operand);
//   the row sum l stays fp32.
// - backward: D = rowsum(dout * out) first (fp32, a backend-owned scratch of B*Hq*T
//   floats), then two kernels that never race and need no atomics:
//   dq: a block owns 64 query rows, walks key tiles up to the diagonal:
//       S = Q K^T, dP = dO V^T, P = exp2(S c - lse2), dS = P (dP - D), dQ += dS K.
//   dk/dv: a block owns 64 keys of one (b, kv head), 16 per warp, and walks every query
//       tile of 32 that can see them, for every query head of its group:
//       S^T = K Q^T, dP^T = V dO^T, dV += P^T dO, dK += dS^T Q.
#include "cuda/attention_mma.cuh"
#include "cuda/attention_paths.h"
#include "cuda/common.cuh"

namespace mhar::cuda {
namespace tc {

constexpr int kThreads = 128;  // 4 warps
constexpr int kRows = 64;      // query rows per block (forward, dq); keys per block (dk/dv)
constexpr int kKeys = 64;      // keys per tile (forward, dq)
constexpr int kBwdQ = 32;      // queries per tile (dk/dv)
using namespace attn_mma;

// Fragment addressing (lane l, i = l >> 3 the 8x8 matrix it addresses, r = l & 7):
// A operand, 16 rows x 16 k from a row-major [row][k] tile: row l & 15, k + 8 (l >> 4).
template <int LD>
__device__ __forceinline__ const bf16* a_addr(const bf16* tile, int row0, int k0, int lane) {
  return tile + (row0 + (lane & 15)) * LD + k0 + 8 * (lane >> 4);
}
// B operand for two n-tiles (n0, n0 + 8) x 16 k from a [n][k] tile (B = tile^T):
// r[0], r[1] = n-tile n0; r[2], r[3] = n-tile n0 + 8.
template <int LD>
__device__ __forceinline__ const bf16* b_addr(const bf16* tile, int n0, int k0, int lane) {
  return tile + (n0 + (lane & 7) + 8 * (lane >> 4)) * LD + k0 + 8 * ((lane >> 3) & 1);
}
// B operand for two n-tiles (n0, n0 + 8) x 16 k from a [k][n] tile, read with .trans.
template <int LD>
__device__ __forceinline__ const bf16* bt_addr(const bf16* tile, int k0, int n0, int lane) {
  return tile + (k0 + (lane & 7) + 8 * ((lane >> 3) & 1)) * LD + n0 + 8 * (lane >> 4);
}

// Rows r0 .. r0 + ROWS - 1 (rows >= n_rows zero-filled) of HD bf16 each, `stride`
// elements apart in global memory, into a padded shared tile.
template <int HD, int ROWS>
__device__ __forceinline__ void load_tile(bf16* dst, const bf16* base, int64_t stride,
                                          int64_t r0, int64_t n_rows) {
  constexpr int LD = HD + 8, CPR = HD / 8;
#pragma unroll
  for (int i = threadIdx.x; i < ROWS * CPR; i += kThreads) {
    const int r = i / CPR, c = i % CPR;
    const int64_t t = r0 + r;
    const bool ok = t < n_rows;
    cp_async16(dst + r * LD + c * 8, ok ? base + t * stride + c * 8 : base, ok);
  }
}

// A warp's 16 rows of fp32 accumulators (C fragments [HD/8][4]) * mul -> bf16, through
// the warp's own 16 rows of a shared tile, then 16-byte stores to global rows
// row0 + 0..15 (rows >= n_rows skipped).
template <int HD>
__device__ __forceinline__ void store_rows(bf16* tile, const float (&acc)[HD / 8][4], float mul0,
                                           float mul1, bf16* base, int64_t stride, int64_t row0,
                                           int64_t n_rows, int lane) {
  constexpr int LD = HD + 8, CPR = HD / 8;
  const int g = lane >> 2, c2 = 2 * (lane & 3);
#pragma unroll
  for (int dt = 0; dt < HD / 8; ++dt) {
    *reinterpret_cast<uint32_t*>(tile + g * LD + dt * 8 + c2) = pack(acc[dt][0] * mul0, acc[dt][1] * mul0);
    *reinterpret_cast<uint32_t*>(tile + (g + 8) * LD + dt * 8 + c2) =
        pack(acc[dt][2] * mul1, acc[dt][3] * mul1);
  }
  __syncwarp();
#pragma unroll
  for (int i = lane; i < 16 * CPR; i += 32) {
    const int r = i / CPR, c = i % CPR;
    if (row0 + r < n_rows)
      *reinterpret_cast<uint4*>(base + (row0 + r) * stride + c * 8) =
          *reinterpret_cast<const uint4*>(tile + r * LD + c * 8);
  }
}

using Args = AttentionArgs;

// ---------------------------------------------------------------- forward
template <int HD>
__global__ void __launch_bounds__(kThreads)
    forward_kernel(bf16* __restrict__ out, float* __restrict__ lse, const bf16* __restrict__ q,
                   const bf16* __restrict__ k, const bf16* __restrict__ v, Args a) {
  constexpr int LD = HD + 8, KS = HD / 16, DT = HD / 8, NT = kKeys / 8;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  bf16* Qs = reinterpret_cast<bf16*>(smem_raw);  // [kRows][LD]
  bf16* Ks = Qs + kRows * LD;                     // [2][kKeys][LD]
  bf16* Vs = Ks + 2 * kKeys * LD;                 // [2][kKeys][LD]

  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int64_t b = blockIdx.z, h = blockIdx.y, hkv = h / (a.Hq / a.Hkv);
  const int qb = int(gridDim.x) - 1 - int(blockIdx.x);  // longest rows first
  const int64_t q0 = int64_t(qb) * kRows;
  const int64_t qs = a.Hq * HD, kvs = a.Hkv * HD;  // element stride between positions
  const bf16* qbase = q + (b * a.T * a.Hq + h) * HD;
  const bf16* kbase = k + (b * a.T * a.Hkv + hkv) * HD;
  const bf16* vbase = v + (b * a.T * a.Hkv + hkv) * HD;

  load_tile<HD, kRows>(Qs, qbase, qs, q0, a.T);
  load_tile<HD, kKeys>(Ks, kbase, kvs, 0, a.T);
  load_tile<HD, kKeys>(Vs, vbase, kvs, 0, a.T);
  cp_async_commit();

  const float c = a.scale * kLog2e;
  const int g = lane >> 2, c2 = 2 * (lane & 3);
  const int64_t t_lo = q0 + warp * 16 + g, t_hi = t_lo + 8;  // this thread's two rows
  uint32_t qf[KS][4];
  float o[DT][4];
#pragma unroll
  for (int dt = 0; dt < DT; ++dt) o[dt][0] = o[dt][1] = o[dt][2] = o[dt][3] = 0.f;
  float m_lo = -INFINITY, m_hi = -INFINITY, l_lo = 0.f, l_hi = 0.f;

  const int n_tiles = qb + 1;  // key tiles 0 .. diagonal (kKeys == kRows)
  for (int j = 0; j < n_tiles; ++j) {
    if (j + 1 < n_tiles) {
      load_tile<HD, kKeys>(Ks + ((j + 1) & 1) * kKeys * LD, kbase, kvs, int64_t(j + 1) * kKeys, a.T);
      load_tile<HD, kKeys>(Vs + ((j + 1) & 1) * kKeys * LD, vbase, kvs, int64_t(j + 1) * kKeys, a.T);
      cp_async_commit();
      cp_async_wait<1>();
    } else {
      cp_async_wait<0>();
    }
    __syncthreads();
    if (j == 0) {
#pragma unroll
      for (int ks = 0; ks < KS; ++ks) ldmatrix_x4(qf[ks], a_addr<LD>(Qs, warp * 16, ks * 16, lane));
    }
    const bf16* Kt = Ks + (j & 1) * kKeys * LD;
    const bf16* Vt = Vs + (j & 1) * kKeys * LD;

    float s[NT][4];
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) s[nt][0] = s[nt][1] = s[nt][2] = s[nt][3] = 0.f;
#pragma unroll
    for (int ks = 0; ks < KS; ++ks) {
#pragma unroll
      for (int np = 0; np < NT / 2; ++np) {
        uint32_t kf[4];
        ldmatrix_x4(kf, b_addr<LD>(Kt, np * 16, ks * 16, lane));
        mma(s[2 * np], qf[ks], kf[0], kf[1]);
        mma(s[2 * np + 1], qf[ks], kf[2], kf[3]);
      }
    }
    // Scale to the exp2 domain; mask the diagonal tile (key > query).
    const bool diag = j == n_tiles - 1;
    float mx_lo = m_lo, mx_hi = m_hi;
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        float x = s[nt][e] * c;
        if (diag) {
          const int64_t key = int64_t(j) * kKeys + nt * 8 + c2 + (e & 1);
          if (key > (e < 2 ? t_lo : t_hi)) x = -INFINITY;
        }
        s[nt][e] = x;
      }
      mx_lo = fmaxf(mx_lo, fmaxf(s[nt][0], s[nt][1]));
      mx_hi = fmaxf(mx_hi, fmaxf(s[nt][2], s[nt][3]));
    }
    mx_lo = fmaxf(mx_lo, __shfl_xor_sync(0xffffffffu, mx_lo, 1));
    mx_lo = fmaxf(mx_lo, __shfl_xor_sync(0xffffffffu, mx_lo, 2));
    mx_hi = fmaxf(mx_hi, __shfl_xor_sync(0xffffffffu, mx_hi, 1));
    mx_hi = fmaxf(mx_hi, __shfl_xor_sync(0xffffffffu, mx_hi, 2));
    // Finite: key 0 of tile 0 is visible to every row.
    const float al_lo = exp2f(m_lo - mx_lo), al_hi = exp2f(m_hi - mx_hi);
    m_lo = mx_lo;
    m_hi = mx_hi;
    float sum_lo = 0.f, sum_hi = 0.f;
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) {
      s[nt][0] = exp2f(s[nt][0] - m_lo);
      s[nt][1] = exp2f(s[nt][1] - m_lo);
      s[nt][2] = exp2f(s[nt][2] - m_hi);
      s[nt][3] = exp2f(s[nt][3] - m_hi);
      sum_lo += s[nt][0] + s[nt][1];
      sum_hi += s[nt][2] + s[nt][3];
    }
    l_lo = l_lo * al_lo + sum_lo;  // per-thread partial sums; reduced at the end
    l_hi = l_hi * al_hi + sum_hi;
#pragma unroll
    for (int dt = 0; dt < DT; ++dt) {
      o[dt][0] *= al_lo;
      o[dt][1] *= al_lo;
      o[dt][2] *= al_hi;
      o[dt][3] *= al_hi;
    }
    // O += P V: P (16 x 64, C fragments) is the A operand, 16 keys per k-step.
#pragma unroll
    for (int kk = 0; kk < kKeys / 16; ++kk) {
      const uint32_t pa[4] = {pack(s[2 * kk][0], s[2 * kk][1]), pack(s[2 * kk][2], s[2 * kk][3]),
                              pack(s[2 * kk + 1][0], s[2 * kk + 1][1]),
                              pack(s[2 * kk + 1][2], s[2 * kk + 1][3])};
#pragma unroll
      for (int dp = 0; dp < DT / 2; ++dp) {
        uint32_t vf[4];
        ldmatrix_x4_trans(vf, bt_addr<LD>(Vt, kk * 16, dp * 16, lane));
        mma(o[2 * dp], pa, vf[0], vf[1]);
        mma(o[2 * dp + 1], pa, vf[2], vf[3]);
      }
    }
    __syncthreads();  // this stage is refilled by the next iteration's loads
  }

  finish_row_sums(l_lo, l_hi, m_lo, m_hi, lse, (b * a.Hq + h) * a.T, t_lo, a.T, lane);
  // Qs is free (Q lives in registers); each warp stages its own 16 rows there.
  store_rows<HD>(Qs + warp * 16 * LD, o, 1.f / l_lo, 1.f / l_hi,
                 out + (b * a.T * a.Hq + h) * HD, qs, q0 + warp * 16, a.T, lane);
}

// ---------------------------------------------------------------- backward: D
// D[b, h, t] = sum_c dout[b, t, h, c] * out[b, t, h, c]; one warp per row, 16-byte loads.
template <int HD>
__global__ void dot_rows_kernel(float* __restrict__ D, const bf16* __restrict__ dout,
                                const bf16* __restrict__ out, Args a) {
  const int64_t row = int64_t(blockIdx.x) * (blockDim.x / 32) + (threadIdx.x >> 5);  // (b,t,h)
  const int lane = threadIdx.x & 31;
  if (row >= a.B * a.T * a.Hq) return;
  float acc = 0.f;
  for (int c = lane * 8; c < HD; c += 32 * 8) {
    const uint4 x = *reinterpret_cast<const uint4*>(dout + row * HD + c);
    const uint4 y = *reinterpret_cast<const uint4*>(out + row * HD + c);
    const __nv_bfloat162* xp = reinterpret_cast<const __nv_bfloat162*>(&x);
    const __nv_bfloat162* yp = reinterpret_cast<const __nv_bfloat162*>(&y);
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const float2 xf = __bfloat1622float2(xp[e]), yf = __bfloat1622float2(yp[e]);
      acc += xf.x * yf.x + xf.y * yf.y;
    }
  }
  acc = warp_sum(acc);
  if (lane == 0) {
    const int64_t h = row % a.Hq, t = (row / a.Hq) % a.T, b = row / (a.Hq * a.T);
    D[(b * a.Hq + h) * a.T + t] = acc;
  }
}

// ---------------------------------------------------------------- backward: dq
template <int HD>
__global__ void __launch_bounds__(kThreads)
    dq_kernel(bf16* __restrict__ dq, const bf16* __restrict__ dout, const bf16* __restrict__ q,
              const bf16* __restrict__ k, const bf16* __restrict__ v,
              const float* __restrict__ lse, const float* __restrict__ Dsum, Args a) {
  constexpr int LD = HD + 8, KS = HD / 16, DT = HD / 8, NT = kKeys / 8;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  bf16* Qs = reinterpret_cast<bf16*>(smem_raw);  // [kRows][LD]
  bf16* dOs = Qs + kRows * LD;                    // [kRows][LD]
  bf16* Ks = dOs + kRows * LD;                    // [2][kKeys][LD]
  bf16* Vs = Ks + 2 * kKeys * LD;                 // [2][kKeys][LD]

  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int64_t b = blockIdx.z, h = blockIdx.y, hkv = h / (a.Hq / a.Hkv);
  const int qb = int(gridDim.x) - 1 - int(blockIdx.x);
  const int64_t q0 = int64_t(qb) * kRows;
  const int64_t qs = a.Hq * HD, kvs = a.Hkv * HD;
  const int64_t qoff = (b * a.T * a.Hq + h) * HD;
  const bf16* kbase = k + (b * a.T * a.Hkv + hkv) * HD;
  const bf16* vbase = v + (b * a.T * a.Hkv + hkv) * HD;

  load_tile<HD, kRows>(Qs, q + qoff, qs, q0, a.T);
  load_tile<HD, kRows>(dOs, dout + qoff, qs, q0, a.T);
  load_tile<HD, kKeys>(Ks, kbase, kvs, 0, a.T);
  load_tile<HD, kKeys>(Vs, vbase, kvs, 0, a.T);
  cp_async_commit();

  const float c = a.scale * kLog2e;
  const int g = lane >> 2, c2 = 2 * (lane & 3);
  const int64_t t_lo = q0 + warp * 16 + g, t_hi = t_lo + 8;
  const float* lse_bh = lse + (b * a.Hq + h) * a.T;
  const float* D_bh = Dsum + (b * a.Hq + h) * a.T;
  const float lse_lo = t_lo < a.T ? lse_bh[t_lo] * kLog2e : 0.f;
  const float lse_hi = t_hi < a.T ? lse_bh[t_hi] * kLog2e : 0.f;
  const float D_lo = t_lo < a.T ? D_bh[t_lo] : 0.f;
  const float D_hi = t_hi < a.T ? D_bh[t_hi] : 0.f;

  float acc[DT][4];
#pragma unroll
  for (int dt = 0; dt < DT; ++dt) acc[dt][0] = acc[dt][1] = acc[dt][2] = acc[dt][3] = 0.f;

  const int n_tiles = qb + 1;
  for (int j = 0; j < n_tiles; ++j) {
    if (j + 1 < n_tiles) {
      load_tile<HD, kKeys>(Ks + ((j + 1) & 1) * kKeys * LD, kbase, kvs, int64_t(j + 1) * kKeys, a.T);
      load_tile<HD, kKeys>(Vs + ((j + 1) & 1) * kKeys * LD, vbase, kvs, int64_t(j + 1) * kKeys, a.T);
      cp_async_commit();
      cp_async_wait<1>();
    } else {
      cp_async_wait<0>();
    }
    __syncthreads();
    const bf16* Kt = Ks + (j & 1) * kKeys * LD;
    const bf16* Vt = Vs + (j & 1) * kKeys * LD;

    float s[NT][4], dp[NT][4];
#pragma unroll
    for (int nt = 0; nt < NT; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) s[nt][e] = dp[nt][e] = 0.f;
#pragma unroll
    for (int ks = 0; ks < KS; ++ks) {
      uint32_t qf[4], df[4];
      ldmatrix_x4(qf, a_addr<LD>(Qs, warp * 16, ks * 16, lane));
      ldmatrix_x4(df, a_addr<LD>(dOs, warp * 16, ks * 16, lane));
#pragma unroll
      for (int np = 0; np < NT / 2; ++np) {
        uint32_t kf[4], vf[4];
        ldmatrix_x4(kf, b_addr<LD>(Kt, np * 16, ks * 16, lane));
        ldmatrix_x4(vf, b_addr<LD>(Vt, np * 16, ks * 16, lane));
        mma(s[2 * np], qf, kf[0], kf[1]);
        mma(s[2 * np + 1], qf, kf[2], kf[3]);
        mma(dp[2 * np], df, vf[0], vf[1]);
        mma(dp[2 * np + 1], df, vf[2], vf[3]);
      }
    }
    const bool diag = j == n_tiles - 1;
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const bool hi = e >= 2;
        float p = exp2f(s[nt][e] * c - (hi ? lse_hi : lse_lo));
        if (diag) {
          const int64_t key = int64_t(j) * kKeys + nt * 8 + c2 + (e & 1);
          if (key > (hi ? t_hi : t_lo)) p = 0.f;
        }
        s[nt][e] = p * (dp[nt][e] - (hi ? D_hi : D_lo));  // dS
      }
    }
    // dQ += dS K: dS (16 x 64 keys) is the A operand; B = K[key][d] read transposed.
#pragma unroll
    for (int kk = 0; kk < kKeys / 16; ++kk) {
      const uint32_t pa[4] = {pack(s[2 * kk][0], s[2 * kk][1]), pack(s[2 * kk][2], s[2 * kk][3]),
                              pack(s[2 * kk + 1][0], s[2 * kk + 1][1]),
                              pack(s[2 * kk + 1][2], s[2 * kk + 1][3])};
#pragma unroll
      for (int dp2 = 0; dp2 < DT / 2; ++dp2) {
        uint32_t kf[4];
        ldmatrix_x4_trans(kf, bt_addr<LD>(Kt, kk * 16, dp2 * 16, lane));
        mma(acc[2 * dp2], pa, kf[0], kf[1]);
        mma(acc[2 * dp2 + 1], pa, kf[2], kf[3]);
      }
    }
    __syncthreads();
  }
  // Qs rows of this warp are read only by this warp: stage the result there.
  store_rows<HD>(Qs + warp * 16 * LD, acc, a.scale, a.scale, dq + qoff, qs, q0 + warp * 16,
                 a.T, lane);
}

// ---------------------------------------------------------------- backward: dk, dv
template <int HD>
__global__ void __launch_bounds__(kThreads)
    dkdv_kernel(bf16* __restrict__ dk, bf16* __restrict__ dv, const bf16* __restrict__ dout,
                const bf16* __restrict__ q, const bf16* __restrict__ k,
                const bf16* __restrict__ v, const float* __restrict__ lse,
                const float* __restrict__ Dsum, Args a) {
  constexpr int LD = HD + 8, KS = HD / 16, DT = HD / 8, NT = kBwdQ / 8;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  bf16* Ks = reinterpret_cast<bf16*>(smem_raw);  // [kRows][LD]
  bf16* Vs = Ks + kRows * LD;                     // [kRows][LD]
  bf16* Qs = Vs + kRows * LD;                     // [2][kBwdQ][LD]
  bf16* dOs = Qs + 2 * kBwdQ * LD;                // [2][kBwdQ][LD]
  float* lse_s = reinterpret_cast<float*>(dOs + 2 * kBwdQ * LD);  // [2][kBwdQ] (exp2 domain)
  float* D_s = lse_s + 2 * kBwdQ;                                 // [2][kBwdQ]

  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int64_t b = blockIdx.z, hkv = blockIdx.y;
  const int64_t group = a.Hq / a.Hkv;
  const int64_t u0 = int64_t(blockIdx.x) * kRows;
  const int64_t qs = a.Hq * HD, kvs = a.Hkv * HD;
  const int64_t kvoff = (b * a.T * a.Hkv + hkv) * HD;

  load_tile<HD, kRows>(Ks, k + kvoff, kvs, u0, a.T);
  load_tile<HD, kRows>(Vs, v + kvoff, kvs, u0, a.T);

  const QueryTileWalk<kBwdQ> walk(hkv, group, u0, a.T);
  const int n_iter = int(group) * walk.tiles;
  // Issue the loads of iteration `it` into stage it & 1.
  auto issue = [&](int it) {
    const int st = it & 1;
    const int64_t hq = walk.head(it), t0 = walk.t0(it);
    const int64_t qoff = (b * a.T * a.Hq + hq) * HD;
    load_tile<HD, kBwdQ>(Qs + st * kBwdQ * LD, q + qoff, qs, t0, a.T);
    load_tile<HD, kBwdQ>(dOs + st * kBwdQ * LD, dout + qoff, qs, t0, a.T);
    stage_query_stats<kBwdQ>(lse_s + st * kBwdQ, D_s + st * kBwdQ, lse, Dsum,
                             (b * a.Hq + hq) * a.T, t0, a.T);
  };
  issue(0);
  cp_async_commit();

  const float c = a.scale * kLog2e;
  const int g = lane >> 2, c2 = 2 * (lane & 3);
  const int64_t u_lo = u0 + warp * 16 + g, u_hi = u_lo + 8;  // this thread's two keys
  float dk_acc[DT][4], dv_acc[DT][4];
#pragma unroll
  for (int dt = 0; dt < DT; ++dt)
#pragma unroll
    for (int e = 0; e < 4; ++e) dk_acc[dt][e] = dv_acc[dt][e] = 0.f;

  for (int it = 0; it < n_iter; ++it) {
    if (it + 1 < n_iter) {
      issue(it + 1);
      cp_async_commit();
      cp_async_wait<1>();
    } else {
      cp_async_wait<0>();
    }
    __syncthreads();
    const int st = it & 1;
    const bf16* Qt = Qs + st * kBwdQ * LD;
    const bf16* dOt = dOs + st * kBwdQ * LD;
    const float* lse_t = lse_s + st * kBwdQ;
    const float* D_t = D_s + st * kBwdQ;
    const int64_t t0 = walk.t0(it);

    float s[NT][4], dp[NT][4];
#pragma unroll
    for (int nt = 0; nt < NT; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) s[nt][e] = dp[nt][e] = 0.f;
#pragma unroll
    for (int ks = 0; ks < KS; ++ks) {
      uint32_t kf[4], vf[4];
      ldmatrix_x4(kf, a_addr<LD>(Ks, warp * 16, ks * 16, lane));
      ldmatrix_x4(vf, a_addr<LD>(Vs, warp * 16, ks * 16, lane));
#pragma unroll
      for (int np = 0; np < NT / 2; ++np) {
        uint32_t qf[4], df[4];
        ldmatrix_x4(qf, b_addr<LD>(Qt, np * 16, ks * 16, lane));
        ldmatrix_x4(df, b_addr<LD>(dOt, np * 16, ks * 16, lane));
        mma(s[2 * np], kf, qf[0], qf[1]);
        mma(s[2 * np + 1], kf, qf[2], qf[3]);
        mma(dp[2 * np], vf, df[0], df[1]);
        mma(dp[2 * np + 1], vf, df[2], df[3]);
      }
    }
    // P^T and dS^T (rows: keys, columns: queries).
    const bool masked = t0 < u0 + kRows - 1;
    float ds[NT][4];
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int col = nt * 8 + c2 + (e & 1);
        float p = exp2f(s[nt][e] * c - lse_t[col]);
        if (masked && t0 + col < (e < 2 ? u_lo : u_hi)) p = 0.f;
        s[nt][e] = p;
        ds[nt][e] = p * (dp[nt][e] - D_t[col]);
      }
    }
    // dV += P^T dO and dK += dS^T Q: 16 queries per k-step, B read transposed.
#pragma unroll
    for (int kk = 0; kk < kBwdQ / 16; ++kk) {
      const uint32_t pa[4] = {pack(s[2 * kk][0], s[2 * kk][1]), pack(s[2 * kk][2], s[2 * kk][3]),
                              pack(s[2 * kk + 1][0], s[2 * kk + 1][1]),
                              pack(s[2 * kk + 1][2], s[2 * kk + 1][3])};
      const uint32_t da[4] = {pack(ds[2 * kk][0], ds[2 * kk][1]), pack(ds[2 * kk][2], ds[2 * kk][3]),
                              pack(ds[2 * kk + 1][0], ds[2 * kk + 1][1]),
                              pack(ds[2 * kk + 1][2], ds[2 * kk + 1][3])};
#pragma unroll
      for (int dp2 = 0; dp2 < DT / 2; ++dp2) {
        uint32_t of[4], qf[4];
        ldmatrix_x4_trans(of, bt_addr<LD>(dOt, kk * 16, dp2 * 16, lane));
        ldmatrix_x4_trans(qf, bt_addr<LD>(Qt, kk * 16, dp2 * 16, lane));
        mma(dv_acc[2 * dp2], pa, of[0], of[1]);
        mma(dv_acc[2 * dp2 + 1], pa, of[2], of[3]);
        mma(dk_acc[2 * dp2], da, qf[0], qf[1]);
        mma(dk_acc[2 * dp2 + 1], da, qf[2], qf[3]);
      }
    }
    __syncthreads();
  }
  // Each warp's 16 rows of Ks / Vs are read only by that warp: stage the results there.
  store_rows<HD>(Ks + warp * 16 * LD, dk_acc, a.scale, a.scale, dk + kvoff, kvs,
                 u0 + warp * 16, a.T, lane);
  store_rows<HD>(Vs + warp * 16 * LD, dv_acc, 1.f, 1.f, dv + kvoff, kvs, u0 + warp * 16, a.T,
                 lane);
}

template <int HD> constexpr size_t forward_smem() { return sizeof(bf16) * 5 * kRows * (HD + 8); }
template <int HD> constexpr size_t dq_smem() { return sizeof(bf16) * 6 * kRows * (HD + 8); }
template <int HD> constexpr size_t dkdv_smem() {
  return sizeof(bf16) * (2 * kRows + 4 * kBwdQ) * (HD + 8) + sizeof(float) * 4 * kBwdQ;
}

template <int HD>
void forward(cudaStream_t s, bf16* out, float* lse, const bf16* q, const bf16* k,
             const bf16* v, const Args& a) {
  constexpr size_t smem = forward_smem<HD>();
  static bool configured = [] {
    CUDA_CHECK(cudaFuncSetAttribute(forward_kernel<HD>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                    int(smem)));
    return true;
  }();
  (void)configured;
  dim3 grid(unsigned(ceil_div(a.T, kRows)), unsigned(a.Hq), unsigned(a.B));
  forward_kernel<HD><<<grid, kThreads, smem, s>>>(out, lse, q, k, v, a);
  CUDA_CHECK_LAUNCH();
}

template <int HD>
void row_dots(cudaStream_t s, float* Dsum, const bf16* dout, const bf16* out, const Args& a) {
  const int64_t rows = a.B * a.T * a.Hq;
  dot_rows_kernel<HD><<<unsigned(ceil_div(rows, 8)), 256, 0, s>>>(Dsum, dout, out, a);
  CUDA_CHECK_LAUNCH();
}

template <int HD>
void backward(cudaStream_t s, bf16* dq, bf16* dk, bf16* dv, const bf16* dout, const bf16* q,
              const bf16* k, const bf16* v, const float* lse, const float* Dsum,
              const Args& a) {
  static bool configured = [] {
    CUDA_CHECK(cudaFuncSetAttribute(dq_kernel<HD>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                    int(dq_smem<HD>())));
    CUDA_CHECK(cudaFuncSetAttribute(dkdv_kernel<HD>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                    int(dkdv_smem<HD>())));
    return true;
  }();
  (void)configured;
  dim3 gq(unsigned(ceil_div(a.T, kRows)), unsigned(a.Hq), unsigned(a.B));
  dq_kernel<HD><<<gq, kThreads, dq_smem<HD>(), s>>>(dq, dout, q, k, v, lse, Dsum, a);
  CUDA_CHECK_LAUNCH();
  dim3 gk(unsigned(ceil_div(a.T, kRows)), unsigned(a.Hkv), unsigned(a.B));
  dkdv_kernel<HD><<<gk, kThreads, dkdv_smem<HD>(), s>>>(dk, dv, dout, q, k, v, lse, Dsum, a);
  CUDA_CHECK_LAUNCH();
}

bool available() {
  static const bool ok = [] {
    cudaFuncAttributes fa{};
    return cudaFuncGetAttributes(&fa, forward_kernel<64>) == cudaSuccess &&
           fa.binaryVersion >= 80;
  }();
  return ok;
}

#define MHAR_TC_INSTANTIATE(HD)                                                              \
  template void forward<HD>(cudaStream_t, bf16*, float*, const bf16*, const bf16*,           \
                            const bf16*, const Args&);                                       \
  template void row_dots<HD>(cudaStream_t, float*, const bf16*, const bf16*, const Args&);   \
  template void backward<HD>(cudaStream_t, bf16*, bf16*, bf16*, const bf16*, const bf16*,    \
                             const bf16*, const bf16*, const float*, const float*,           \
                             const Args&);
MHAR_TC_INSTANTIATE(64)
MHAR_TC_INSTANTIATE(128)
#undef MHAR_TC_INSTANTIATE

}  // namespace tc

}  // namespace mhar::cuda
