// attention.cu: causal grouped-query attention, scale 1/sqrt(head_dim), flash-style: the
// [T, T] score matrix is never stored; the forward saves only the log-sum-exp.
// Layouts: q, out, dq [B, T, Hq, hd]; k, v, dk, dv [B, T, Hkv, hd]; lse [B, Hq, T] (F32,
// natural log of sum_u exp(scale q.k_u)). Query head h reads KV head h / (Hq/Hkv).
// attention_cached (incremental decoding) is the forward with Tk >= Tq cached keys, query
// t at position Tk - Tq + t, and no lse.
// Every output is overwritten. head_dim 64 or 128; q, k, v, out and their gradients share
// one storage type (BF16 or F32).
//
// Three paths:
// - BF16 training forward and backward on compute capability 9.0: the Hopper wgmma
//   kernels of attention_hopper.cu (attention_set_hopper turns them off).
// - BF16 training forward and backward elsewhere: the tensor-core kernels of namespace tc
//   below (FlashAttention-2 style, mma.sync m16n8k16). Either backward needs a scratch of
//   B*Hq*T floats (the row dots D, computed here for both), owned by the backend like the
//   cuBLAS workspace. Copy and mma helpers shared with the Hopper kernels:
//   attention_mma.cuh.
// - F32 storage, attention_cached (decode), and BF16 tensors not 16-byte aligned: the
//   first, correctness-first kernels on fp32 CUDA cores (described next), which also
//   serve as the reference the tensor-core path was developed against (cuda/NOTES.md).
//
// fp32 CUDA-core path: the tiles live in shared memory as fp32:
// - forward (and dq): a block owns 16 query rows of one (b, h), 4 per warp; it walks key
//   tiles of 32 with an online softmax. Lane j scores key j against the warp's 4 rows;
//   then each lane accumulates the output for its hd/32 features.
// - dk/dv: a block owns 16 keys of one (b, kv head), 4 per warp, and walks every query
//   tile of 32 that can see them, for every query head of the group, so a group's sums
//   never race and need no atomics. Lane i handles query i of the tile.
// Backward recomputes p = exp(scale q.k - lse), D = dout . out, ds = p (dout.v - D):
//   dq = scale sum_u ds k_u;  dk = scale sum_t ds q_t;  dv = sum_t p dout_t.
#include <atomic>

#include "cuda/attention_hopper.h"
#include "cuda/attention_mma.cuh"
#include "cuda/common.cuh"
#include "cuda/kernels.h"

namespace mhar::cuda {
namespace {

constexpr int kWarps = 4;
constexpr int kRowsPerWarp = 4;
constexpr int kQueryRows = kWarps * kRowsPerWarp;  // query rows per block (forward, dq)
constexpr int kKeyTile = 32;                        // keys per tile (forward, dq)
constexpr int kKeysPerBlock = kWarps * kRowsPerWarp;  // keys per block (dk/dv)
constexpr int kQueryTile = 32;                        // queries per tile (dk/dv)

struct Dims {
  int64_t B, T, Hq, Hkv;  // T: query rows (and keys, except in the cached forward)
  float scale;
  int64_t Tk = 0, offset = 0;  // forward only: key rows; query t sits at offset + t
};

__device__ __forceinline__ int64_t row_index(int64_t b, int64_t t, int64_t h, int64_t heads,
                                             int64_t T_len) {
  return (b * T_len + t) * heads + h;
}

// ---------------------------------------------------------------- forward
template <int HD, class T>
__global__ void __launch_bounds__(kWarps * 32)
    attention_forward_kernel(T* __restrict__ out, float* __restrict__ lse,
                             const T* __restrict__ q, const T* __restrict__ k,
                             const T* __restrict__ v, Dims dm) {
  constexpr int DPL = HD / 32;  // features per lane
  extern __shared__ float smem[];
  float* qs = smem;                        // [kQueryRows][HD], pre-scaled
  float* ks = qs + kQueryRows * HD;        // [kKeyTile][HD + 1] (lane j reads row j)
  float* vs = ks + kKeyTile * (HD + 1);    // [kKeyTile][HD]

  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int64_t b = blockIdx.z, h = blockIdx.y;
  const int64_t hkv = h / (dm.Hq / dm.Hkv);
  // Longest causal rows first, for load balance.
  const int64_t r0 = (int64_t(gridDim.x) - 1 - blockIdx.x) * kQueryRows;
  const int64_t r_end = min(dm.T, r0 + kQueryRows);

  for (int idx = threadIdx.x; idx < kQueryRows * HD; idx += blockDim.x) {
    const int r = idx / HD, c = idx % HD;
    const int64_t t = r0 + r;
    qs[idx] = t < dm.T ? load(q[row_index(b, t, h, dm.Hq, dm.T) * HD + c]) * dm.scale : 0.f;
  }

  float m[kRowsPerWarp], l[kRowsPerWarp], acc[kRowsPerWarp][DPL];
  int64_t my_row[kRowsPerWarp];
#pragma unroll
  for (int rr = 0; rr < kRowsPerWarp; ++rr) {
    m[rr] = -INFINITY;
    l[rr] = 0.f;
    // Rows past the end mask like the last row (keeps the arithmetic finite); not written.
    my_row[rr] = dm.offset + min(r0 + warp * kRowsPerWarp + rr, dm.T - 1);  // its position
#pragma unroll
    for (int e = 0; e < DPL; ++e) acc[rr][e] = 0.f;
  }

  const int64_t n_tiles = (dm.offset + r_end - 1) / kKeyTile + 1;
  for (int64_t kt = 0; kt < n_tiles; ++kt) {
    const int64_t k0 = kt * kKeyTile;
    __syncthreads();  // previous tile fully consumed (and qs written, first time)
    for (int idx = threadIdx.x; idx < kKeyTile * HD; idx += blockDim.x) {
      const int j = idx / HD, c = idx % HD;
      const int64_t u = k0 + j;
      float kv = 0.f, vv = 0.f;
      if (u < dm.Tk) {
        const int64_t base = row_index(b, u, hkv, dm.Hkv, dm.Tk) * HD + c;
        kv = load(k[base]);
        vv = load(v[base]);
      }
      ks[j * (HD + 1) + c] = kv;
      vs[j * HD + c] = vv;
    }
    __syncthreads();

    float s[kRowsPerWarp];
#pragma unroll
    for (int rr = 0; rr < kRowsPerWarp; ++rr) s[rr] = 0.f;
    const float* kr = ks + lane * (HD + 1);
    const float* qw = qs + warp * kRowsPerWarp * HD;
#pragma unroll 8
    for (int c = 0; c < HD; ++c) {
      const float kc = kr[c];
#pragma unroll
      for (int rr = 0; rr < kRowsPerWarp; ++rr) s[rr] += qw[rr * HD + c] * kc;
    }
    const int64_t u = k0 + lane;
    float p[kRowsPerWarp];
#pragma unroll
    for (int rr = 0; rr < kRowsPerWarp; ++rr) {
      if (u > my_row[rr]) s[rr] = -INFINITY;
      const float m_new = fmaxf(m[rr], warp_max(s[rr]));  // finite: key 0 <= every row
      const float alpha = __expf(m[rr] - m_new);
      p[rr] = __expf(s[rr] - m_new);
      l[rr] = l[rr] * alpha + warp_sum(p[rr]);
      m[rr] = m_new;
#pragma unroll
      for (int e = 0; e < DPL; ++e) acc[rr][e] *= alpha;
    }
#pragma unroll 4
    for (int j = 0; j < kKeyTile; ++j) {
      float vj[DPL];
#pragma unroll
      for (int e = 0; e < DPL; ++e) vj[e] = vs[j * HD + lane + 32 * e];
#pragma unroll
      for (int rr = 0; rr < kRowsPerWarp; ++rr) {
        const float pj = __shfl_sync(0xffffffffu, p[rr], j);
#pragma unroll
        for (int e = 0; e < DPL; ++e) acc[rr][e] += pj * vj[e];
      }
    }
  }

#pragma unroll
  for (int rr = 0; rr < kRowsPerWarp; ++rr) {
    const int64_t t = r0 + warp * kRowsPerWarp + rr;
    if (t >= dm.T) continue;
    const float inv_l = 1.f / l[rr];
    T* o = out + row_index(b, t, h, dm.Hq, dm.T) * HD;
#pragma unroll
    for (int e = 0; e < DPL; ++e) o[lane + 32 * e] = store<T>(acc[rr][e] * inv_l);
    if (lse && lane == 0) lse[(b * dm.Hq + h) * dm.T + t] = m[rr] + logf(l[rr]);
  }
}

// ---------------------------------------------------------------- backward: dq
template <int HD, class T>
__global__ void __launch_bounds__(kWarps * 32)
    attention_backward_dq_kernel(T* __restrict__ dq, const T* __restrict__ dout,
                                 const T* __restrict__ q, const T* __restrict__ k,
                                 const T* __restrict__ v, const T* __restrict__ out,
                                 const float* __restrict__ lse, Dims dm) {
  constexpr int DPL = HD / 32;
  extern __shared__ float smem[];
  float* qs = smem;                      // [kQueryRows][HD], pre-scaled
  float* dos = qs + kQueryRows * HD;     // [kQueryRows][HD]
  float* ks = dos + kQueryRows * HD;     // [kKeyTile][HD + 1]
  float* vs = ks + kKeyTile * (HD + 1);  // [kKeyTile][HD + 1]

  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int64_t b = blockIdx.z, h = blockIdx.y;
  const int64_t hkv = h / (dm.Hq / dm.Hkv);
  const int64_t r0 = (int64_t(gridDim.x) - 1 - blockIdx.x) * kQueryRows;
  const int64_t r_end = min(dm.T, r0 + kQueryRows);

  for (int idx = threadIdx.x; idx < kQueryRows * HD; idx += blockDim.x) {
    const int r = idx / HD, c = idx % HD;
    const int64_t t = r0 + r;
    float qv = 0.f, dv = 0.f;
    if (t < dm.T) {
      const int64_t base = row_index(b, t, h, dm.Hq, dm.T) * HD + c;
      qv = load(q[base]) * dm.scale;
      dv = load(dout[base]);
    }
    qs[idx] = qv;
    dos[idx] = dv;
  }

  float lse_r[kRowsPerWarp], D[kRowsPerWarp], acc[kRowsPerWarp][DPL];
  int64_t my_row[kRowsPerWarp];
#pragma unroll
  for (int rr = 0; rr < kRowsPerWarp; ++rr) {
    my_row[rr] = min(r0 + warp * kRowsPerWarp + rr, dm.T - 1);
    const int64_t base = row_index(b, my_row[rr], h, dm.Hq, dm.T) * HD;
    float d = 0.f;
#pragma unroll
    for (int e = 0; e < DPL; ++e)
      d += load(dout[base + lane + 32 * e]) * load(out[base + lane + 32 * e]);
    D[rr] = warp_sum(d);
    lse_r[rr] = lse[(b * dm.Hq + h) * dm.T + my_row[rr]];
#pragma unroll
    for (int e = 0; e < DPL; ++e) acc[rr][e] = 0.f;
  }

  const int64_t n_tiles = (r_end - 1) / kKeyTile + 1;
  for (int64_t kt = 0; kt < n_tiles; ++kt) {
    const int64_t k0 = kt * kKeyTile;
    __syncthreads();
    for (int idx = threadIdx.x; idx < kKeyTile * HD; idx += blockDim.x) {
      const int j = idx / HD, c = idx % HD;
      const int64_t u = k0 + j;
      float kv = 0.f, vv = 0.f;
      if (u < dm.T) {
        const int64_t base = row_index(b, u, hkv, dm.Hkv, dm.T) * HD + c;
        kv = load(k[base]);
        vv = load(v[base]);
      }
      ks[j * (HD + 1) + c] = kv;
      vs[j * (HD + 1) + c] = vv;
    }
    __syncthreads();

    float s[kRowsPerWarp], dp[kRowsPerWarp];
#pragma unroll
    for (int rr = 0; rr < kRowsPerWarp; ++rr) s[rr] = dp[rr] = 0.f;
    const float* kr = ks + lane * (HD + 1);
    const float* vr = vs + lane * (HD + 1);
    const float* qw = qs + warp * kRowsPerWarp * HD;
    const float* dw = dos + warp * kRowsPerWarp * HD;
#pragma unroll 8
    for (int c = 0; c < HD; ++c) {
      const float kc = kr[c], vc = vr[c];
#pragma unroll
      for (int rr = 0; rr < kRowsPerWarp; ++rr) {
        s[rr] += qw[rr * HD + c] * kc;
        dp[rr] += dw[rr * HD + c] * vc;
      }
    }
    const int64_t u = k0 + lane;
    float ds[kRowsPerWarp];
#pragma unroll
    for (int rr = 0; rr < kRowsPerWarp; ++rr) {
      const float p = u <= my_row[rr] ? __expf(s[rr] - lse_r[rr]) : 0.f;
      ds[rr] = p * (dp[rr] - D[rr]);
    }
#pragma unroll 4
    for (int j = 0; j < kKeyTile; ++j) {
      float kj[DPL];
#pragma unroll
      for (int e = 0; e < DPL; ++e) kj[e] = ks[j * (HD + 1) + lane + 32 * e];
#pragma unroll
      for (int rr = 0; rr < kRowsPerWarp; ++rr) {
        const float dsj = __shfl_sync(0xffffffffu, ds[rr], j);
#pragma unroll
        for (int e = 0; e < DPL; ++e) acc[rr][e] += dsj * kj[e];
      }
    }
  }

#pragma unroll
  for (int rr = 0; rr < kRowsPerWarp; ++rr) {
    const int64_t t = r0 + warp * kRowsPerWarp + rr;
    if (t >= dm.T) continue;
    T* o = dq + row_index(b, t, h, dm.Hq, dm.T) * HD;
#pragma unroll
    for (int e = 0; e < DPL; ++e) o[lane + 32 * e] = store<T>(acc[rr][e] * dm.scale);
  }
}

// ---------------------------------------------------------------- backward: dk, dv
template <int HD, class T>
__global__ void __launch_bounds__(kWarps * 32)
    attention_backward_dkdv_kernel(T* __restrict__ dk, T* __restrict__ dv,
                                   const T* __restrict__ dout, const T* __restrict__ q,
                                   const T* __restrict__ k, const T* __restrict__ v,
                                   const T* __restrict__ out, const float* __restrict__ lse,
                                   Dims dm) {
  constexpr int DPL = HD / 32;
  extern __shared__ float smem[];
  float* qs = smem;                            // [kQueryTile][HD + 1] (lane i reads row i)
  float* dos = qs + kQueryTile * (HD + 1);     // [kQueryTile][HD + 1]
  float* ks = dos + kQueryTile * (HD + 1);     // [kKeysPerBlock][HD]
  float* vs = ks + kKeysPerBlock * HD;         // [kKeysPerBlock][HD]
  float* lse_s = vs + kKeysPerBlock * HD;      // [kQueryTile]
  float* D_s = lse_s + kQueryTile;             // [kQueryTile]

  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int64_t b = blockIdx.z, hkv = blockIdx.y;
  const int64_t group = dm.Hq / dm.Hkv;
  const int64_t u0 = int64_t(blockIdx.x) * kKeysPerBlock;

  for (int idx = threadIdx.x; idx < kKeysPerBlock * HD; idx += blockDim.x) {
    const int j = idx / HD, c = idx % HD;
    const int64_t u = u0 + j;
    float kv = 0.f, vv = 0.f;
    if (u < dm.T) {
      const int64_t base = row_index(b, u, hkv, dm.Hkv, dm.T) * HD + c;
      kv = load(k[base]);
      vv = load(v[base]);
    }
    ks[idx] = kv;
    vs[idx] = vv;
  }

  float dk_acc[kRowsPerWarp][DPL], dv_acc[kRowsPerWarp][DPL];
#pragma unroll
  for (int kk = 0; kk < kRowsPerWarp; ++kk)
#pragma unroll
    for (int e = 0; e < DPL; ++e) dk_acc[kk][e] = dv_acc[kk][e] = 0.f;
  const int64_t my_key0 = u0 + warp * kRowsPerWarp;
  const float* kw = ks + warp * kRowsPerWarp * HD;
  const float* vw = vs + warp * kRowsPerWarp * HD;

  const int64_t first_tile = u0 / kQueryTile;
  const int64_t n_tiles = ceil_div(dm.T, kQueryTile);
  for (int64_t hq = hkv * group; hq < (hkv + 1) * group; ++hq) {
    for (int64_t qt = first_tile; qt < n_tiles; ++qt) {
      const int64_t t0 = qt * kQueryTile;
      __syncthreads();  // previous tile consumed; ks/vs written (first time)
      for (int idx = threadIdx.x; idx < kQueryTile * HD; idx += blockDim.x) {
        const int i = idx / HD, c = idx % HD;
        const int64_t t = t0 + i;
        float qv = 0.f, dv_ = 0.f;
        if (t < dm.T) {
          const int64_t base = row_index(b, t, hq, dm.Hq, dm.T) * HD + c;
          qv = load(q[base]);
          dv_ = load(dout[base]);
        }
        qs[i * (HD + 1) + c] = qv;
        dos[i * (HD + 1) + c] = dv_;
      }
      // D_t = dout_t . out_t for the tile's 32 queries, 8 per warp.
      for (int i = warp; i < kQueryTile; i += kWarps) {
        const int64_t t = t0 + i;
        float d = 0.f;
        if (t < dm.T) {
          const int64_t base = row_index(b, t, hq, dm.Hq, dm.T) * HD;
#pragma unroll
          for (int e = 0; e < DPL; ++e)
            d += load(dout[base + lane + 32 * e]) * load(out[base + lane + 32 * e]);
        }
        d = warp_sum(d);
        if (lane == 0) {
          D_s[i] = d;
          lse_s[i] = t < dm.T ? lse[(b * dm.Hq + hq) * dm.T + t] : 0.f;
        }
      }
      __syncthreads();

      const int64_t t = t0 + lane;
      float s[kRowsPerWarp], dp[kRowsPerWarp];
#pragma unroll
      for (int kk = 0; kk < kRowsPerWarp; ++kk) s[kk] = dp[kk] = 0.f;
      const float* qr = qs + lane * (HD + 1);
      const float* dr = dos + lane * (HD + 1);
#pragma unroll 8
      for (int c = 0; c < HD; ++c) {
        const float qc = qr[c], dc = dr[c];
#pragma unroll
        for (int kk = 0; kk < kRowsPerWarp; ++kk) {
          s[kk] += qc * kw[kk * HD + c];
          dp[kk] += dc * vw[kk * HD + c];
        }
      }
      float p[kRowsPerWarp], ds[kRowsPerWarp];
#pragma unroll
      for (int kk = 0; kk < kRowsPerWarp; ++kk) {
        const int64_t u = my_key0 + kk;
        const bool visible = t < dm.T && u < dm.T && u <= t;
        p[kk] = visible ? __expf(s[kk] * dm.scale - lse_s[lane]) : 0.f;
        ds[kk] = p[kk] * (dp[kk] - D_s[lane]);
      }
#pragma unroll 4
      for (int i = 0; i < kQueryTile; ++i) {
        float qi[DPL], di[DPL];
#pragma unroll
        for (int e = 0; e < DPL; ++e) {
          qi[e] = qs[i * (HD + 1) + lane + 32 * e];
          di[e] = dos[i * (HD + 1) + lane + 32 * e];
        }
#pragma unroll
        for (int kk = 0; kk < kRowsPerWarp; ++kk) {
          const float pi = __shfl_sync(0xffffffffu, p[kk], i);
          const float dsi = __shfl_sync(0xffffffffu, ds[kk], i);
#pragma unroll
          for (int e = 0; e < DPL; ++e) {
            dv_acc[kk][e] += pi * di[e];
            dk_acc[kk][e] += dsi * qi[e];
          }
        }
      }
    }
  }

#pragma unroll
  for (int kk = 0; kk < kRowsPerWarp; ++kk) {
    const int64_t u = my_key0 + kk;
    if (u >= dm.T) continue;
    const int64_t base = row_index(b, u, hkv, dm.Hkv, dm.T) * HD;
#pragma unroll
    for (int e = 0; e < DPL; ++e) {
      dk[base + lane + 32 * e] = store<T>(dk_acc[kk][e] * dm.scale);
      dv[base + lane + 32 * e] = store<T>(dv_acc[kk][e]);
    }
  }
}

// ================================================================ tensor-core path (BF16)
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

struct Args {
  int64_t B, T, Hq, Hkv;
  float scale;
};

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

  l_lo += __shfl_xor_sync(0xffffffffu, l_lo, 1);
  l_lo += __shfl_xor_sync(0xffffffffu, l_lo, 2);
  l_hi += __shfl_xor_sync(0xffffffffu, l_hi, 1);
  l_hi += __shfl_xor_sync(0xffffffffu, l_hi, 2);
  if (lse && (lane & 3) == 0) {
    const float ln2 = 0.6931471805599453f;
    if (t_lo < a.T) lse[(b * a.Hq + h) * a.T + t_lo] = (m_lo + log2f(l_lo)) * ln2;
    if (t_hi < a.T) lse[(b * a.Hq + h) * a.T + t_hi] = (m_hi + log2f(l_hi)) * ln2;
  }
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

  const int first = int(u0 / kBwdQ);
  const int nq = int(ceil_div(a.T, kBwdQ)) - first;  // query tiles per head
  const int n_iter = int(group) * nq;
  // Issue the loads of iteration `it` into stage it & 1.
  auto issue = [&](int it) {
    const int st = it & 1;
    const int64_t hq = hkv * group + it / nq;
    const int64_t t0 = int64_t(first + it % nq) * kBwdQ;
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
    const int64_t t0 = int64_t(first + it % nq) * kBwdQ;

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
void backward(cudaStream_t s, bf16* dq, bf16* dk, bf16* dv, const bf16* dout, const bf16* q,
              const bf16* k, const bf16* v, const bf16* out, const float* lse, float* Dsum,
              const Args& a, bool use_hopper) {
  static bool configured = [] {
    CUDA_CHECK(cudaFuncSetAttribute(dq_kernel<HD>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                    int(dq_smem<HD>())));
    CUDA_CHECK(cudaFuncSetAttribute(dkdv_kernel<HD>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                    int(dkdv_smem<HD>())));
    return true;
  }();
  (void)configured;
  const int64_t rows = a.B * a.T * a.Hq;
  dot_rows_kernel<HD><<<unsigned(ceil_div(rows, 8)), 256, 0, s>>>(Dsum, dout, out, a);
  CUDA_CHECK_LAUNCH();
  if (use_hopper) {
    hopper::backward<HD>(s, dq, dk, dv, dout, q, k, v, lse, Dsum,
                         hopper::ForwardArgs{a.B, a.T, a.Hq, a.Hkv, a.scale});
    return;
  }
  dim3 gq(unsigned(ceil_div(a.T, kRows)), unsigned(a.Hq), unsigned(a.B));
  dq_kernel<HD><<<gq, kThreads, dq_smem<HD>(), s>>>(dq, dout, q, k, v, lse, Dsum, a);
  CUDA_CHECK_LAUNCH();
  dim3 gk(unsigned(ceil_div(a.T, kRows)), unsigned(a.Hkv), unsigned(a.B));
  dkdv_kernel<HD><<<gk, kThreads, dkdv_smem<HD>(), s>>>(dk, dv, dout, q, k, v, lse, Dsum, a);
  CUDA_CHECK_LAUNCH();
}

}  // namespace tc

// ---------------------------------------------------------------- launch helpers
struct Shape {
  int64_t B, T, Hq, Hkv, hd;
};

Shape check_shapes(const char* what, const Tensor& q, const Tensor& k, const Tensor& v,
                   bool cached = false) {
  MHAR_CHECK(q.ndim == 4 && k.ndim == 4 && v.ndim == 4, what, ": q, k, v must be [B, T, H, hd]");
  Shape sh{q.dim(0), q.dim(1), q.dim(2), k.dim(2), q.dim(3)};
  MHAR_CHECK(k.dim(0) == sh.B && (cached ? k.dim(1) >= sh.T : k.dim(1) == sh.T) &&
                 k.dim(3) == sh.hd, what, ": k ",
             k.shape_str(), " vs q ", q.shape_str());
  MHAR_CHECK(v.numel() == k.numel(), what, ": v ", v.shape_str(), " vs k ", k.shape_str());
  MHAR_CHECK(sh.Hkv > 0 && sh.Hq % sh.Hkv == 0, what, ": Hq ", sh.Hq, " not a multiple of Hkv ",
             sh.Hkv);
  if (sh.hd != 64 && sh.hd != 128)
    fail("CUDA ", what, ": head_dim ", sh.hd, " unsupported (64 or 128)");
  MHAR_CHECK(k.dtype == q.dtype && v.dtype == q.dtype, what, ": q, k, v dtypes differ");
  return sh;
}

template <int HD> size_t forward_smem() {
  return sizeof(float) * (kQueryRows * HD + kKeyTile * (HD + 1) + kKeyTile * HD);
}
template <int HD> size_t dq_smem() {
  return sizeof(float) * (2 * kQueryRows * HD + 2 * kKeyTile * (HD + 1));
}
template <int HD> size_t dkdv_smem() {
  return sizeof(float) * (2 * kQueryTile * (HD + 1) + 2 * kKeysPerBlock * HD + 2 * kQueryTile);
}

template <int HD, class T>
void forward_impl(cudaStream_t s, Tensor out, Tensor lse, Tensor q, Tensor k, Tensor v,
                  const Shape& sh, int64_t Tk) {
  Dims dm{sh.B, sh.T, sh.Hq, sh.Hkv, float(1.0 / std::sqrt(double(HD))), Tk, Tk - sh.T};
  const size_t smem = forward_smem<HD>();
  auto kernel = attention_forward_kernel<HD, T>;
  CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem)));
  dim3 grid(unsigned(ceil_div(sh.T, kQueryRows)), unsigned(sh.Hq), unsigned(sh.B));
  kernel<<<grid, kWarps * 32, smem, s>>>(static_cast<T*>(out.data),
                                         lse.empty() ? nullptr : lse.ptr<float>(),
                                         static_cast<const T*>(q.data),
                                         static_cast<const T*>(k.data),
                                         static_cast<const T*>(v.data), dm);
  CUDA_CHECK_LAUNCH();
}

template <int HD, class T>
void backward_impl(cudaStream_t s, Tensor dq, Tensor dk, Tensor dv, Tensor dout, Tensor q,
                   Tensor k, Tensor v, Tensor out, Tensor lse, const Shape& sh) {
  Dims dm{sh.B, sh.T, sh.Hq, sh.Hkv, float(1.0 / std::sqrt(double(HD)))};
  {
    const size_t smem = dq_smem<HD>();
    auto kernel = attention_backward_dq_kernel<HD, T>;
    CUDA_CHECK(
        cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem)));
    dim3 grid(unsigned(ceil_div(sh.T, kQueryRows)), unsigned(sh.Hq), unsigned(sh.B));
    kernel<<<grid, kWarps * 32, smem, s>>>(
        static_cast<T*>(dq.data), static_cast<const T*>(dout.data), static_cast<const T*>(q.data),
        static_cast<const T*>(k.data), static_cast<const T*>(v.data),
        static_cast<const T*>(out.data), lse.ptr<float>(), dm);
    CUDA_CHECK_LAUNCH();
  }
  {
    const size_t smem = dkdv_smem<HD>();
    auto kernel = attention_backward_dkdv_kernel<HD, T>;
    CUDA_CHECK(
        cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem)));
    dim3 grid(unsigned(ceil_div(sh.T, kKeysPerBlock)), unsigned(sh.Hkv), unsigned(sh.B));
    kernel<<<grid, kWarps * 32, smem, s>>>(
        static_cast<T*>(dk.data), static_cast<T*>(dv.data), static_cast<const T*>(dout.data),
        static_cast<const T*>(q.data), static_cast<const T*>(k.data),
        static_cast<const T*>(v.data), static_cast<const T*>(out.data), lse.ptr<float>(), dm);
    CUDA_CHECK_LAUNCH();
  }
}

// The tensor-core path takes BF16 tensors whose rows are 16-byte aligned (cp.async and
// vector stores); anything else goes to the fp32 CUDA-core kernels.
bool tc_available() {
  static const bool ok = [] {
    cudaFuncAttributes fa{};
    return cudaFuncGetAttributes(&fa, tc::forward_kernel<64>) == cudaSuccess &&
           fa.binaryVersion >= 80;
  }();
  return ok;
}
bool use_tensor_cores(std::initializer_list<const Tensor*> ts) {
  if (!tc_available()) return false;
  for (const Tensor* t : ts)
    if (t->dtype != DType::BF16 || reinterpret_cast<uintptr_t>(t->data) % 16 != 0) return false;
  return true;
}

std::atomic<bool> g_hopper_enabled{true};

}  // namespace

bool attention_set_hopper(bool enabled) { return g_hopper_enabled.exchange(enabled); }
bool attention_uses_hopper() { return g_hopper_enabled.load() && hopper::available(); }

void attention_forward(cudaStream_t s, Tensor out, Tensor lse, Tensor q, Tensor k, Tensor v) {
  const Shape sh = check_shapes("attention_forward", q, k, v);
  check_numel(out, q.numel(), "attention_forward", "out");
  check_dtype(out, q.dtype, "attention_forward", "out");
  check_numel(lse, sh.B * sh.Hq * sh.T, "attention_forward", "lse");
  check_dtype(lse, DType::F32, "attention_forward", "lse");
  if (q.numel() == 0) return;
  if (use_tensor_cores({&out, &q, &k, &v})) {
    const tc::Args a{sh.B, sh.T, sh.Hq, sh.Hkv, float(1.0 / std::sqrt(double(sh.hd)))};
    auto* o = static_cast<bf16*>(out.data);
    auto *qp = static_cast<const bf16*>(q.data), *kp = static_cast<const bf16*>(k.data),
         *vp = static_cast<const bf16*>(v.data);
    if (attention_uses_hopper()) {
      const hopper::ForwardArgs ha{a.B, a.T, a.Hq, a.Hkv, a.scale};
      if (sh.hd == 64) hopper::forward<64>(s, o, lse.ptr<float>(), qp, kp, vp, ha);
      else hopper::forward<128>(s, o, lse.ptr<float>(), qp, kp, vp, ha);
      return;
    }
    if (sh.hd == 64) tc::forward<64>(s, o, lse.ptr<float>(), qp, kp, vp, a);
    else tc::forward<128>(s, o, lse.ptr<float>(), qp, kp, vp, a);
    return;
  }
  dispatch_float(q.dtype, "attention_forward", [&](auto tag) {
    using T = decltype(tag);
    if (sh.hd == 64) forward_impl<64, T>(s, out, lse, q, k, v, sh, sh.T);
    else forward_impl<128, T>(s, out, lse, q, k, v, sh, sh.T);
  });
}

void attention_backward(cudaStream_t s, Tensor dq, Tensor dk, Tensor dv, Tensor dout, Tensor q,
                        Tensor k, Tensor v, Tensor out, Tensor lse, float* workspace,
                        size_t workspace_floats) {
  const Shape sh = check_shapes("attention_backward", q, k, v);
  check_numel(dq, q.numel(), "attention_backward", "dq");
  check_numel(dout, q.numel(), "attention_backward", "dout");
  check_numel(out, q.numel(), "attention_backward", "out");
  check_numel(dk, k.numel(), "attention_backward", "dk");
  check_numel(dv, k.numel(), "attention_backward", "dv");
  check_numel(lse, sh.B * sh.Hq * sh.T, "attention_backward", "lse");
  check_dtype(lse, DType::F32, "attention_backward", "lse");
  for (const Tensor* t : {&dq, &dk, &dv, &dout, &out})
    MHAR_CHECK(t->dtype == q.dtype, "attention_backward: gradient dtypes must match q");
  if (q.numel() == 0) return;
  if (use_tensor_cores({&dq, &dk, &dv, &dout, &q, &k, &v, &out})) {
    MHAR_CHECK(workspace && workspace_floats >= size_t(sh.B * sh.Hq * sh.T),
               "attention_backward: workspace of ", sh.B * sh.Hq * sh.T, " floats needed");
    const tc::Args a{sh.B, sh.T, sh.Hq, sh.Hkv, float(1.0 / std::sqrt(double(sh.hd)))};
    auto bp = [](const Tensor& t) { return static_cast<bf16*>(t.data); };
    const bool hopper = attention_uses_hopper();
    if (sh.hd == 64)
      tc::backward<64>(s, bp(dq), bp(dk), bp(dv), bp(dout), bp(q), bp(k), bp(v), bp(out),
                       lse.ptr<float>(), workspace, a, hopper);
    else
      tc::backward<128>(s, bp(dq), bp(dk), bp(dv), bp(dout), bp(q), bp(k), bp(v), bp(out),
                        lse.ptr<float>(), workspace, a, hopper);
    return;
  }
  dispatch_float(q.dtype, "attention_backward", [&](auto tag) {
    using T = decltype(tag);
    if (sh.hd == 64) backward_impl<64, T>(s, dq, dk, dv, dout, q, k, v, out, lse, sh);
    else backward_impl<128, T>(s, dq, dk, dv, dout, q, k, v, out, lse, sh);
  });
}

void attention_cached(cudaStream_t s, Tensor out, Tensor q, Tensor k_cache, Tensor v_cache) {
  const Shape sh = check_shapes("attention_cached", q, k_cache, v_cache, true);
  check_numel(out, q.numel(), "attention_cached", "out");
  check_dtype(out, q.dtype, "attention_cached", "out");
  if (q.numel() == 0) return;
  const int64_t Tk = k_cache.dim(1);
  dispatch_float(q.dtype, "attention_cached", [&](auto tag) {
    using T = decltype(tag);
    if (sh.hd == 64) forward_impl<64, T>(s, out, Tensor(), q, k_cache, v_cache, sh, Tk);
    else forward_impl<128, T>(s, out, Tensor(), q, k_cache, v_cache, sh, Tk);
  });
}

}  // namespace mhar::cuda
