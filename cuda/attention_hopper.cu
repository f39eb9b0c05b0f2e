// attention_hopper.cu: the Hopper (sm_90a) forward and backward of causal grouped-query
// attention on wgmma, BF16, head_dim 64 or 128. attention.cu sends the BF16 training
// forward and backward here when the device is compute capability 9.0 (other devices take
// attention_tc.cu; other storage types attention_fp32.cu). Layouts and the lse convention
// are attention.cu's; the declarations are in attention_paths.h. The default forward and
// dK/dV kernels are the warp-specialized ones of attention_hopper_ws.cu; this file has the
// dQ kernel every backward version runs, and the earlier forward (version 1) and dK/dV
// kernel (backward version 2) for the kernel lab.
//
// Forward version 1 (FlashAttention-3's math, without its producer warp and TMA;
// cuda/NOTES.md "Hopper attention" has the measurements):
// - a block owns 128 query rows of one (b, h): two warpgroups of 64 rows each; it walks
//   key tiles of 64 up to the diagonal. K and V tiles are staged by cp.async, two stages
//   deep, in the 128-byte-swizzled layout that wgmma's shared-memory descriptors read
//   (below); Q stays in shared memory as wgmma's A operand.
// - S = Q K^T: wgmma m64n64k16, A and B both K-major from shared memory, fp32 accumulators.
// - online softmax in the exp2 domain on the accumulators (each thread owns two rows'
//   values, the m16n8 C layout per warp); P is rounded to bf16 into registers, which are
//   already the register-A layout of the next wgmma: O += P V, m64n{HD}k16, V read
//   N-major (transposed) straight from its [key][feature] tile.
// - two blocks per SM (96 KB of shared memory each at head_dim 128): one block's softmax
//   runs while the other's matrix products do, which is the overlap FA3 gets from its
//   ping-pong schedule.
// Numerics as the mma.sync forward's (fp32 scores and statistics, P rounded to bf16 for
// the P V product, the row sum l kept in fp32 from the unrounded P), except that p =
// 2^(s c - m) is one FFMA and the exponentials flush results below 2^-126 to zero
// (fast_exp2). The backward: section "backward" below.
//
// Shared-memory tiles use the 128-byte-swizzled layout and descriptors of
// attention_wgmma.cuh.
#include "cuda/attention_paths.h"

#include "cuda/attention_wgmma.cuh"

namespace mhar::cuda::hopper {
namespace {

using namespace attn_wgmma;

constexpr int kWarpgroups = 2;
constexpr int kThreads = 128 * kWarpgroups;
constexpr int kRows = 64 * kWarpgroups;  // query rows per block
constexpr int kKeys = 64;                // keys per tile: one warpgroup's rows, so only the
                                         // tile holding a warpgroup's rows needs the mask

// Rows r0 .. r0 + ROWS - 1 of HD bf16 (`stride` elements apart in global memory; rows >=
// n_rows zero-filled) into the swizzled layout above. A thread always copies the same
// 16-byte column chunk, of rows kThreads / (HD / 8) apart, so its swizzle and offsets
// are fixed once and the copies unroll.
template <int HD, int ROWS>
__device__ __forceinline__ void load_tile_sw128(bf16* dst, const bf16* base, int64_t stride,
                                                int64_t r0, int64_t n_rows) {
  constexpr int CPR = HD / 8, ROWS_PER_PASS = kThreads / CPR;
  static_assert(ROWS % ROWS_PER_PASS == 0 && ROWS_PER_PASS % 8 == 0, "tile rows per pass");
  const int c = threadIdx.x % CPR, r = threadIdx.x / CPR;
  bf16* d = dst + (c / 8) * (ROWS * 64) + r * 64 + ((c % 8) ^ (r % 8)) * 8;
  const bf16* src = base + (r0 + r) * stride + c * 8;
  const int64_t step = ROWS_PER_PASS * stride;
  const int64_t rows_left = n_rows - r0 - r;
#pragma unroll
  for (int p = 0; p < ROWS / ROWS_PER_PASS; ++p) {
    const bool ok = p * ROWS_PER_PASS < rows_left;
    cp_async16(d + p * ROWS_PER_PASS * 64, ok ? src + p * step : base, ok);
  }
}

// Step j of a walk over n tiles staged two deep: issue(j + 1) starts the next step's
// copies into the other stage, then this waits for step j's and publishes them to the
// tensor cores (async proxy) and to every thread.
template <class Issue>
__device__ __forceinline__ void stage_advance(Issue&& issue, int j, int n) {
  if (j + 1 < n) {
    issue(j + 1);
    cp_async_commit();
    cp_async_wait<1>();
  } else {
    cp_async_wait<0>();
  }
  fence_proxy_async();
  __syncthreads();
}
// The key-tile walk of the forward and of dq version 1: key tile j's K and V.
template <int HD>
__device__ __forceinline__ void kv_stage_advance(bf16* Ks, bf16* Vs, const bf16* kbase,
                                                 const bf16* vbase, int64_t kvs, int j,
                                                 int n_tiles, int64_t T) {
  // Written from j, not from the lambda's argument (j + 1): so the forward's and dq's
  // integer code stays what it was when they were measured (the same stage either way).
  stage_advance(
      [&](int) {
        load_tile_sw128<HD, kKeys>(Ks + ((j + 1) & 1) * kKeys * HD, kbase, kvs,
                                   int64_t(j + 1) * kKeys, T);
        load_tile_sw128<HD, kKeys>(Vs + ((j + 1) & 1) * kKeys * HD, vbase, kvs,
                                   int64_t(j + 1) * kKeys, T);
      },
      j, n_tiles);
}

template <int HD> constexpr size_t tile_bytes(int rows) { return size_t(rows) * HD * 2; }
template <int HD> constexpr size_t forward_smem() {
  // Q, two stages of K and V, and 1 KB to align the base to the swizzle's 1024 bytes.
  return tile_bytes<HD>(kRows) + 4 * tile_bytes<HD>(kKeys) + 1024;
}

template <int HD>
__global__ void __launch_bounds__(kThreads, 2)
    forward_kernel(bf16* __restrict__ out, float* __restrict__ lse, const bf16* __restrict__ q,
                   const bf16* __restrict__ k, const bf16* __restrict__ v, AttentionArgs a) {
#ifdef MHAR_NO_WGMMA
  __trap();
#else
  constexpr int KS = HD / 16, NT = kKeys / 8, PV_STEPS = kKeys / 16;
  extern __shared__ unsigned char smem_raw[];
  bf16* Qs = aligned_smem(smem_raw);
  bf16* Ks = Qs + kRows * HD;        // [2][kKeys * HD]
  bf16* Vs = Ks + 2 * kKeys * HD;    // [2][kKeys * HD]

  const int wg = threadIdx.x >> 7, warp = (threadIdx.x >> 5) & 3, lane = threadIdx.x & 31;
  const int64_t b = blockIdx.z, h = blockIdx.y, hkv = h / (a.Hq / a.Hkv);
  const int qb = int(gridDim.x) - 1 - int(blockIdx.x);  // longest rows first
  const int64_t q0 = int64_t(qb) * kRows;
  const int64_t qs = a.Hq * HD, kvs = a.Hkv * HD;  // element stride between positions
  const bf16* qbase = q + (b * a.T * a.Hq + h) * HD;
  const bf16* kbase = k + (b * a.T * a.Hkv + hkv) * HD;
  const bf16* vbase = v + (b * a.T * a.Hkv + hkv) * HD;

  // Key tiles this block needs, and the last one (the diagonal) of this warpgroup.
  const int n_tiles = int(ceil_div(std::min<int64_t>(a.T, q0 + kRows), kKeys));
  const int wg_last = std::min<int>(int((q0 + 64 * wg + 63) / kKeys), n_tiles - 1);

  load_tile_sw128<HD, kRows>(Qs, qbase, qs, q0, a.T);
  load_tile_sw128<HD, kKeys>(Ks, kbase, kvs, 0, a.T);
  load_tile_sw128<HD, kKeys>(Vs, vbase, kvs, 0, a.T);
  cp_async_commit();

  const float c = a.scale * kLog2e;
  const int g = lane >> 2, c2 = 2 * (lane & 3);
  const int64_t t_lo = q0 + 64 * wg + 16 * warp + g;  // this thread's rows: t_lo, t_lo + 8
  float o[HD / 2], s[kKeys / 2];
#pragma unroll
  for (int i = 0; i < HD / 2; ++i) o[i] = 0.f;
  float m_lo = -INFINITY, m_hi = -INFINITY, l_lo = 0.f, l_hi = 0.f;
  // Every descriptor from one base (Q, K and V sit at fixed offsets): fewer live registers
  // under the cap of 128 that two blocks per SM impose.
  const uint64_t q_desc = kmajor_base(Qs, 64 * wg);
  const uint64_t k_desc = q_desc + uint64_t((kRows * HD - 64 * wg * 64) * 2 / 16);
  const uint64_t v_desc = k_desc + uint64_t(2 * kKeys * HD * 2 / 16) +
                          (uint64_t((kKeys * 128 - 16) >> 4) << 16);  // N-major's LBO

  for (int j = 0; j < n_tiles; ++j) {
    kv_stage_advance<HD>(Ks, Vs, kbase, vbase, kvs, j, n_tiles, a.T);
    if (j <= wg_last) {
      const uint64_t st = stage_offset(j & 1, kKeys * HD);
      // S = Q K^T over HD in k-steps of 16 (32 bytes inside a 64-column block).
      wgmma_fence();
      wgmma_ss_k<KS, kRows, kKeys>(s, q_desc, k_desc + st);
      wgmma_commit();
      wgmma_wait_all();
      pin(s);
      // Row maxima (keys after the row masked on the diagonal tile); then p = 2^(s c - m)
      // as one FFMA.
      const float2 al = update_row_max<kKeys>(s, j == wg_last, int(t_lo - int64_t(j) * kKeys),
                                              c2, c, m_lo, m_hi);
      const float al_lo = al.x, al_hi = al.y;
      float sum_lo = 0.f, sum_hi = 0.f;
      uint32_t p[PV_STEPS][4];
#pragma unroll
      for (int nt = 0; nt < NT; ++nt) {
        const float e0 = fast_exp2(fmaf(s[4 * nt], c, -m_lo));
        const float e1 = fast_exp2(fmaf(s[4 * nt + 1], c, -m_lo));
        const float e2 = fast_exp2(fmaf(s[4 * nt + 2], c, -m_hi));
        const float e3 = fast_exp2(fmaf(s[4 * nt + 3], c, -m_hi));
        sum_lo += e0 + e1;
        sum_hi += e2 + e3;
        // n8 tile nt holds keys 8 nt ..: the low or high half of P V's k-step nt / 2.
        p[nt / 2][2 * (nt & 1)] = pack(e0, e1);
        p[nt / 2][2 * (nt & 1) + 1] = pack(e2, e3);
      }
      l_lo = l_lo * al_lo + sum_lo;  // per-thread partial sums; reduced at the end
      l_hi = l_hi * al_hi + sum_hi;
      rescale_rows<HD>(o, al_lo, al_hi);
      // O += P V, 16 keys per k-step (2048 bytes of the V tile).
      wgmma_fence();
      wgmma_rs_k<HD>(o, p, v_desc + st);
      wgmma_commit();
      wgmma_wait_all();
      pin(o);
    }
    __syncthreads();  // this stage is refilled by the next iteration's loads
  }

  finish_row_sums(l_lo, l_hi, m_lo, m_hi, lse, (b * a.Hq + h) * a.T, t_lo, a.T, lane);
  // The K/V stages are free now: each warp stages its 16 output rows there.
  store_rows_staged<HD>(Ks + (threadIdx.x >> 5) * 16 * (HD + 8), o, 1.f / l_lo, 1.f / l_hi,
                        out + (b * a.T * a.Hq + h) * HD, qs,
                        ConsecutiveRows{q0 + 64 * wg + 16 * warp}, a.T, lane);
#endif
}


// ---------------------------------------------------------------- backward
// D = rowsum(dout * out) comes from attention.cu (its dot-rows kernel, into the backend's
// scratch); then two kernels that never race and need no atomics, as on the mma.sync
// path, with the same numerics (P and dS rounded to bf16 as matrix operands, fp32
// accumulators, exp2 domain):
//   dkdv: a block owns 128 keys of one (b, KV head) (64 per warpgroup) and walks every
//         query tile of 64 that can see them, for each query head of its group:
//         S^T = K Q^T, dP^T = V dO^T, dV += P^T dO, dK += dS^T Q (dO, Q read N-major).
//   dq, version 2 (the default; score_grads given): dkdv also stores each bf16 dS^T tile
//         it computed (64 keys x 64 queries, [key][query position], tiles on and below the
//         diagonal packed per (b, h): score_grad_tile, tile_query), and dq, run after it,
//         is one product per tile: a block owns 128 query rows (64 per warpgroup), walks
//         key tiles of 64 up to the diagonal and accumulates dQ += dS K with both operands
//         read MN-major from shared memory. Five products in all, as FlashAttention-2's,
//         and deterministic; the price is the tiles' bytes, written once and read once
//         (B Hq T^2 bytes: bf16, the causal half; cuda/NOTES.md, "Five products in the
//         backward", has the measurements).
//   dq, version 1 (no score_grads): the block walks the same key tiles recomputing S = Q
//         K^T and dP = dO V^T (both operands K-major), P = exp2(S c - lse2), dS = P (dP -
//         D), dQ += dS K (K read N-major): seven products, dq independent of dkdv.
// dkdv and dq version 1 run one block per SM (128 KB of shared memory): the accumulators
// take most of the registers.
static_assert(kGradTile == kKeys, "dq walks key tiles of the tiles' size");

template <int HD> constexpr size_t dq_smem() {
  return 2 * tile_bytes<HD>(kRows) + 4 * tile_bytes<HD>(kKeys) + 1024;
}
constexpr int kBwdQ = 64;  // queries per tile (dkdv)
template <int HD> constexpr size_t dkdv_smem() {
  return 2 * tile_bytes<HD>(kRows) + 4 * tile_bytes<HD>(kBwdQ) + 4 * kBwdQ * sizeof(float) + 1024;
}

template <int HD>
__global__ void __launch_bounds__(kThreads, 1)
    dq_kernel(bf16* __restrict__ dq, const bf16* __restrict__ dout, const bf16* __restrict__ q,
              const bf16* __restrict__ k, const bf16* __restrict__ v,
              const float* __restrict__ lse, const float* __restrict__ Dsum, AttentionArgs a) {
#ifdef MHAR_NO_WGMMA
  __trap();
#else
  constexpr int KS = HD / 16, NT = kKeys / 8, PV_STEPS = kKeys / 16;
  extern __shared__ unsigned char smem_raw[];
  bf16* Qs = aligned_smem(smem_raw);  // [kRows * HD]
  bf16* dOs = Qs + kRows * HD;        // [kRows * HD]
  bf16* Ks = dOs + kRows * HD;        // [2][kKeys * HD]
  bf16* Vs = Ks + 2 * kKeys * HD;     // [2][kKeys * HD]
  static_assert(size_t(kRows) * HD * 2 >= size_t(kThreads / 32) * 16 * (HD + 8),
                "the output staging reuses Q and dO");

  const int wg = threadIdx.x >> 7, warp = (threadIdx.x >> 5) & 3, lane = threadIdx.x & 31;
  const int64_t b = blockIdx.z, h = blockIdx.y, hkv = h / (a.Hq / a.Hkv);
  const int qb = int(gridDim.x) - 1 - int(blockIdx.x);
  const int64_t q0 = int64_t(qb) * kRows;
  const int64_t qs = a.Hq * HD, kvs = a.Hkv * HD;
  const int64_t qoff = (b * a.T * a.Hq + h) * HD;
  const bf16* kbase = k + (b * a.T * a.Hkv + hkv) * HD;
  const bf16* vbase = v + (b * a.T * a.Hkv + hkv) * HD;
  const int n_tiles = int(ceil_div(std::min<int64_t>(a.T, q0 + kRows), kKeys));
  const int wg_last = std::min<int>(int((q0 + 64 * wg + 63) / kKeys), n_tiles - 1);

  load_tile_sw128<HD, kRows>(Qs, q + qoff, qs, q0, a.T);
  load_tile_sw128<HD, kRows>(dOs, dout + qoff, qs, q0, a.T);
  load_tile_sw128<HD, kKeys>(Ks, kbase, kvs, 0, a.T);
  load_tile_sw128<HD, kKeys>(Vs, vbase, kvs, 0, a.T);
  cp_async_commit();

  const float c = a.scale * kLog2e;
  const int g = lane >> 2, c2 = 2 * (lane & 3);
  const int64_t t_lo = q0 + 64 * wg + 16 * warp + g, t_hi = t_lo + 8;
  const float* lse_bh = lse + (b * a.Hq + h) * a.T;
  const float* D_bh = Dsum + (b * a.Hq + h) * a.T;
  const float lse_lo = t_lo < a.T ? lse_bh[t_lo] * kLog2e : 0.f;
  const float lse_hi = t_hi < a.T ? lse_bh[t_hi] * kLog2e : 0.f;
  const float D_lo = t_lo < a.T ? D_bh[t_lo] : 0.f;
  const float D_hi = t_hi < a.T ? D_bh[t_hi] : 0.f;

  float acc[HD / 2], s[kKeys / 2], dp[kKeys / 2];
#pragma unroll
  for (int i = 0; i < HD / 2; ++i) acc[i] = 0.f;
  const uint64_t q_desc = kmajor_base(Qs, 64 * wg), do_desc = kmajor_base(dOs, 64 * wg),
                 k_desc = kmajor_base(Ks, 0), v_desc = kmajor_base(Vs, 0),
                 kn_desc = nmajor_base<kKeys>(Ks);

  for (int j = 0; j < n_tiles; ++j) {
    kv_stage_advance<HD>(Ks, Vs, kbase, vbase, kvs, j, n_tiles, a.T);
    if (j <= wg_last) {
      const uint64_t st = stage_offset(j & 1, kKeys * HD);
      wgmma_fence();
      wgmma_ss_k<KS, kRows, kKeys>(s, q_desc, k_desc + st);
      wgmma_ss_k<KS, kRows, kKeys>(dp, do_desc, v_desc + st);
      wgmma_commit();
      wgmma_wait_all();
      pin(s);
      pin(dp);
      const bool diag = j == wg_last;
      uint32_t da[PV_STEPS][4];
#pragma unroll
      for (int nt = 0; nt < NT; ++nt) {
        float ds[4];
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const bool hi = e >= 2;
          float p = fast_exp2(fmaf(s[4 * nt + e], c, -(hi ? lse_hi : lse_lo)));
          if (diag) {
            const int64_t key = int64_t(j) * kKeys + nt * 8 + c2 + (e & 1);
            if (key > (hi ? t_hi : t_lo)) p = 0.f;
          }
          ds[e] = p * (dp[4 * nt + e] - (hi ? D_hi : D_lo));
        }
        da[nt / 2][2 * (nt & 1)] = pack(ds[0], ds[1]);
        da[nt / 2][2 * (nt & 1) + 1] = pack(ds[2], ds[3]);
      }
      // dQ += dS K: 16 keys per k-step, K read N-major.
      wgmma_fence();
      wgmma_rs_k<HD>(acc, da, kn_desc + st);
      wgmma_commit();
      wgmma_wait_all();
      pin(acc);
    }
    __syncthreads();
  }
  store_rows_staged<HD>(Qs + (threadIdx.x >> 5) * 16 * (HD + 8), acc, a.scale, a.scale,
                        dq + qoff, qs, ConsecutiveRows{q0 + 64 * wg + 16 * warp}, a.T, lane);
#endif
}

// dq, version 2: dQ = scale * sum over key tiles of dS K, dS^T from dkdv's tiles. Per key
// tile: K (N-major, as version 1's dQ product reads it) and each warpgroup's dS^T tile
// (rows: keys, the product's K dimension; columns: its 64 queries, M), both staged by
// cp.async three deep: the kernel does little but wait for its tiles (one short product
// per stage), so the bytes in flight set its rate; no softmax, so two blocks (97 KB of
// shared memory each) share an SM.
constexpr int kDqStages = 3;
template <int HD> constexpr size_t dq_tiles_smem() {
  return kDqStages * (tile_bytes<HD>(kKeys) + kWarpgroups * tile_bytes<kGradTile>(kGradTile)) +
         1024;
}
template <int HD>
__global__ void __launch_bounds__(kThreads, 2)
    dq_tiles_kernel(bf16* __restrict__ dq, const bf16* __restrict__ k,
                    const bf16* __restrict__ score_grads, AttentionArgs a) {
#ifdef MHAR_NO_WGMMA
  __trap();
#else
  constexpr int KSTEPS = kKeys / 16, TILE = kGradTile * kGradTile;
  extern __shared__ unsigned char smem_raw[];
  bf16* Ks = aligned_smem(smem_raw);       // [kDqStages][kKeys * HD]
  bf16* Ds = Ks + kDqStages * kKeys * HD;  // [kDqStages][kWarpgroups][TILE]
  static_assert(dq_tiles_smem<HD>() - 1024 >= size_t(kThreads / 32) * 16 * (HD + 8) * 2,
                "the output staging reuses the K and dS stages");

  const int wg = threadIdx.x >> 7, warp = (threadIdx.x >> 5) & 3, lane = threadIdx.x & 31;
  const int64_t b = blockIdx.z, h = blockIdx.y, hkv = h / (a.Hq / a.Hkv);
  const int qb = int(gridDim.x) - 1 - int(blockIdx.x);
  const int64_t q0 = int64_t(qb) * kRows;
  const int64_t qs = a.Hq * HD, kvs = a.Hkv * HD;
  const int64_t qoff = (b * a.T * a.Hq + h) * HD;
  const bf16* kbase = k + (b * a.T * a.Hkv + hkv) * HD;
  const int64_t bh = b * a.Hq + h;
  // Warpgroup w's query tile is 2 qb + w; it has tiles for key tiles 0 .. 2 qb + w when
  // its rows start before T (dkdv wrote those), none otherwise.
  const int n_tiles = int(ceil_div(std::min<int64_t>(a.T, q0 + kRows), kKeys));
  auto wg_tiles = [&](int w) { return q0 + 64 * w < a.T ? 2 * qb + w + 1 : 0; };
  const int my_tiles = wg_tiles(wg);

  auto issue = [&](int j) {
    const int st = j % kDqStages;
    load_tile_sw128<HD, kKeys>(Ks + st * kKeys * HD, kbase, kvs, int64_t(j) * kKeys, a.T);
#pragma unroll
    for (int w = 0; w < kWarpgroups; ++w)
      if (j < wg_tiles(w))
        load_tile_sw128<kGradTile, kGradTile>(
            Ds + (st * kWarpgroups + w) * TILE,
            score_grad_tile(score_grads, bh, a.T, 2 * qb + w, j), kGradTile,
            0, kGradTile);
  };
  // Key tile j's copies are commit group j; tiles 0 .. kDqStages - 2 go first, and every
  // iteration commits one group (empty past the last tile), so that waiting for all but
  // the newest kDqStages - 1 groups always means tile j's.
#pragma unroll
  for (int j = 0; j < kDqStages - 1; ++j) {
    if (j < n_tiles) issue(j);
    cp_async_commit();
  }

  float acc[HD / 2];
#pragma unroll
  for (int i = 0; i < HD / 2; ++i) acc[i] = 0.f;
  const uint64_t kn_desc = nmajor_base<kKeys>(Ks);
  const uint64_t ds_desc = nmajor_base<kGradTile>(Ds + wg * TILE);

  for (int j = 0; j < n_tiles; ++j) {
    if (j + kDqStages - 1 < n_tiles) issue(j + kDqStages - 1);
    cp_async_commit();
    cp_async_wait<kDqStages - 1>();
    fence_proxy_async();
    __syncthreads();
    if (j < my_tiles) {
      const uint64_t sk = stage_offset(j % kDqStages, kKeys * HD);
      const uint64_t sd = stage_offset(j % kDqStages, kWarpgroups * TILE);
      wgmma_fence();
#pragma unroll
      for (int ks = 0; ks < KSTEPS; ++ks)
        wgmma_ss_tt<HD>(acc, nmajor_step(ds_desc + sd, ks), nmajor_step(kn_desc + sk, ks));
      wgmma_commit();
      wgmma_wait_all();
      pin(acc);
    }
    __syncthreads();  // this stage is refilled by the next iteration's loads
  }
  // The product's rows are tile positions: position p is query tile_query(p).
  const int64_t wg_q0 = q0 + 64 * wg;
  const int p0 = 16 * warp;
  store_rows_staged<HD>(Ks + (threadIdx.x >> 5) * 16 * (HD + 8), acc, a.scale, a.scale,
                        dq + qoff, qs, [=](int r) { return wg_q0 + tile_query(p0 + r); },
                        a.T, lane);
#endif
}

template <int HD, bool STORE_DS>
__global__ void __launch_bounds__(kThreads, 1)
    dkdv_kernel(bf16* __restrict__ dk, bf16* __restrict__ dv, bf16* __restrict__ score_grads,
                const bf16* __restrict__ dout, const bf16* __restrict__ q,
                const bf16* __restrict__ k, const bf16* __restrict__ v,
                const float* __restrict__ lse, const float* __restrict__ Dsum,
                AttentionArgs a) {
#ifdef MHAR_NO_WGMMA
  __trap();
#else
  constexpr int KS = HD / 16, NT = kBwdQ / 8, QSTEPS = kBwdQ / 16;
  extern __shared__ unsigned char smem_raw[];
  bf16* Ks = aligned_smem(smem_raw);  // [kRows * HD] (this block's keys)
  bf16* Vs = Ks + kRows * HD;         // [kRows * HD]
  bf16* Qs = Vs + kRows * HD;         // [2][kBwdQ * HD]
  bf16* dOs = Qs + 2 * kBwdQ * HD;    // [2][kBwdQ * HD]
  float* lse_s = reinterpret_cast<float*>(dOs + 2 * kBwdQ * HD);  // [2][kBwdQ], exp2 domain
  float* D_s = lse_s + 2 * kBwdQ;                                 // [2][kBwdQ]
  static_assert(size_t(4) * kBwdQ * HD * 2 >= size_t(kThreads / 32) * 16 * (HD + 8),
                "the output staging reuses the Q and dO stages");

  const int wg = threadIdx.x >> 7, warp = (threadIdx.x >> 5) & 3, lane = threadIdx.x & 31;
  const int64_t b = blockIdx.z, hkv = blockIdx.y;
  const int64_t group = a.Hq / a.Hkv;
  const int64_t u0 = int64_t(blockIdx.x) * kRows;
  const int64_t qs = a.Hq * HD, kvs = a.Hkv * HD;
  const int64_t kvoff = (b * a.T * a.Hkv + hkv) * HD;

  load_tile_sw128<HD, kRows>(Ks, k + kvoff, kvs, u0, a.T);
  load_tile_sw128<HD, kRows>(Vs, v + kvoff, kvs, u0, a.T);

  const QueryTileWalk<kBwdQ> walk(hkv, group, u0, a.T);
  const int n_iter = int(group) * walk.tiles;
  auto issue = [&](int it) {
    const int st = it & 1;
    const int64_t hq = walk.head(it), t0 = walk.t0(it);
    const int64_t qoff = (b * a.T * a.Hq + hq) * HD;
    load_tile_sw128<HD, kBwdQ>(Qs + st * kBwdQ * HD, q + qoff, qs, t0, a.T);
    load_tile_sw128<HD, kBwdQ>(dOs + st * kBwdQ * HD, dout + qoff, qs, t0, a.T);
    stage_query_stats<kBwdQ>(lse_s + st * kBwdQ, D_s + st * kBwdQ, lse, Dsum,
                             (b * a.Hq + hq) * a.T, t0, a.T);
  };
  issue(0);
  cp_async_commit();

  const float c = a.scale * kLog2e;
  const int g = lane >> 2, c2 = 2 * (lane & 3);
  const int64_t wg_u0 = u0 + 64 * wg;                 // this warpgroup's first key
  const int64_t u_lo = wg_u0 + 16 * warp + g, u_hi = u_lo + 8;  // this thread's two keys
  float dk_acc[HD / 2], dv_acc[HD / 2], s[kBwdQ / 2], dp[kBwdQ / 2];
#pragma unroll
  for (int i = 0; i < HD / 2; ++i) dk_acc[i] = dv_acc[i] = 0.f;
  const uint64_t k_desc = kmajor_base(Ks, 64 * wg), v_desc = kmajor_base(Vs, 64 * wg),
                 q_desc = kmajor_base(Qs, 0), do_desc = kmajor_base(dOs, 0),
                 qn_desc = nmajor_base<kBwdQ>(Qs), don_desc = nmajor_base<kBwdQ>(dOs);

  for (int it = 0; it < n_iter; ++it) {
    stage_advance(issue, it, n_iter);
    const int st = it & 1;
    const int64_t t0 = walk.t0(it);
    // Tiles wholly before this warpgroup's keys see none of them.
    if (t0 + kBwdQ > wg_u0) {
      const uint64_t so = stage_offset(st, kBwdQ * HD);
      const float* lse_t = lse_s + st * kBwdQ;
      const float* D_t = D_s + st * kBwdQ;
      wgmma_fence();
      wgmma_ss_k<KS, kRows, kBwdQ>(s, k_desc, q_desc + so);
      wgmma_ss_k<KS, kRows, kBwdQ>(dp, v_desc, do_desc + so);
      wgmma_commit();
      wgmma_wait_all();
      pin(s);
      pin(dp);
      // P^T and dS^T (rows: keys, columns: queries); a query before a key sees nothing.
      const bool masked = t0 < wg_u0 + 63;
      uint32_t pa[QSTEPS][4], da[QSTEPS][4];
#pragma unroll
      for (int nt = 0; nt < NT; ++nt) {
        // This thread's two query columns of the n8 tile, for both of its key rows.
        const float2 lse2 = *reinterpret_cast<const float2*>(lse_t + nt * 8 + c2);
        const float2 D2 = *reinterpret_cast<const float2*>(D_t + nt * 8 + c2);
        float p[4], ds[4];
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int col = nt * 8 + c2 + (e & 1);
          float pe = fast_exp2(fmaf(s[4 * nt + e], c, -((e & 1) ? lse2.y : lse2.x)));
          if (masked && t0 + col < (e < 2 ? u_lo : u_hi)) pe = 0.f;
          p[e] = pe;
          ds[e] = pe * (dp[4 * nt + e] - ((e & 1) ? D2.y : D2.x));
        }
        pa[nt / 2][2 * (nt & 1)] = pack(p[0], p[1]);
        pa[nt / 2][2 * (nt & 1) + 1] = pack(p[2], p[3]);
        da[nt / 2][2 * (nt & 1)] = pack(ds[0], ds[1]);
        da[nt / 2][2 * (nt & 1) + 1] = pack(ds[2], ds[3]);
      }
      // dV += P^T dO and dK += dS^T Q: 16 queries per k-step, dO and Q read N-major.
      wgmma_fence();
      wgmma_rs_k<HD>(dv_acc, pa, don_desc + so);
      wgmma_rs_k<HD>(dk_acc, da, qn_desc + so);
      wgmma_commit();
      if constexpr (STORE_DS) {
        // While the products run (they only read da): this warp's 16 key rows of the
        // tile, the bf16 values dK's product reads. A warpgroup wholly past T stores
        // nothing (no dq reads its keys).
        if (wg_u0 < a.T)
          store_score_grad_rows(score_grad_tile(score_grads, b * a.Hq + walk.head(it), a.T,
                                                int(t0 / kGradTile), int(wg_u0 / kGradTile)),
                                warp, lane, da);
      }
      wgmma_wait_all();
      pin(dv_acc);
      pin(dk_acc);
    }
    __syncthreads();
  }
  // The Q and dO stages are free now: each warp stages its 16 rows there.
  bf16* stage = Qs + (threadIdx.x >> 5) * 16 * (HD + 8);
  const int64_t row0 = wg_u0 + 16 * warp;
  store_rows_staged<HD>(stage, dk_acc, a.scale, a.scale, dk + kvoff, kvs, ConsecutiveRows{row0},
                        a.T, lane);
  store_rows_staged<HD>(stage, dv_acc, 1.f, 1.f, dv + kvoff, kvs, ConsecutiveRows{row0}, a.T,
                        lane);
#endif
}

template <int HD> bool configure() {
  static const bool ok = [] {
    cudaFuncAttributes fa{};
    if (cudaFuncGetAttributes(&fa, forward_kernel<HD>) != cudaSuccess) {
      (void)cudaGetLastError();
      return false;
    }
    CUDA_CHECK(cudaFuncSetAttribute(forward_kernel<HD>,
                                    cudaFuncAttributeMaxDynamicSharedMemorySize,
                                    int(forward_smem<HD>())));
    CUDA_CHECK(cudaFuncSetAttribute(dq_kernel<HD>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                    int(dq_smem<HD>())));
    CUDA_CHECK(cudaFuncSetAttribute(dq_tiles_kernel<HD>,
                                    cudaFuncAttributeMaxDynamicSharedMemorySize,
                                    int(dq_tiles_smem<HD>())));
    CUDA_CHECK(cudaFuncSetAttribute(dkdv_kernel<HD, false>,
                                    cudaFuncAttributeMaxDynamicSharedMemorySize,
                                    int(dkdv_smem<HD>())));
    CUDA_CHECK(cudaFuncSetAttribute(dkdv_kernel<HD, true>,
                                    cudaFuncAttributeMaxDynamicSharedMemorySize,
                                    int(dkdv_smem<HD>())));
    return fa.binaryVersion == 90;
  }();
  return ok;
}

}  // namespace

bool available() {
  static const bool ok = [] {
    int dev = 0, major = 0, minor = 0;
    if (cudaGetDevice(&dev) != cudaSuccess ||
        cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev) != cudaSuccess ||
        cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, dev) != cudaSuccess) {
      (void)cudaGetLastError();
      return false;
    }
    // sm_90a machine code runs on compute capability 9.0 only.
    return major == 9 && minor == 0 && configure<64>() && configure<128>();
  }();
  return ok;
}

template <int HD>
void forward(cudaStream_t s, bf16* out, float* lse, const bf16* q, const bf16* k, const bf16* v,
             const AttentionArgs& a) {
  MHAR_CHECK(available(), "hopper::forward called without a compute capability 9.0 device");
  dim3 grid(unsigned(ceil_div(a.T, kRows)), unsigned(a.Hq), unsigned(a.B));
  forward_kernel<HD><<<grid, kThreads, forward_smem<HD>(), s>>>(out, lse, q, k, v, a);
  CUDA_CHECK_LAUNCH();
}

size_t score_grad_bytes(const AttentionArgs& a) {
  return size_t(a.B * a.Hq * grad_tiles_per_head(a.T)) * kGradTile * kGradTile * sizeof(bf16);
}

template <int HD>
void backward(cudaStream_t s, bf16* dq, bf16* dk, bf16* dv, const bf16* dout, const bf16* q,
              const bf16* k, const bf16* v, const float* lse, const float* Dsum,
              bf16* score_grads, bool warp_specialized, const AttentionArgs& a) {
  MHAR_CHECK(available(), "hopper::backward called without a compute capability 9.0 device");
  MHAR_CHECK(reinterpret_cast<uintptr_t>(score_grads) % 16 == 0,
             "hopper::backward: score-gradient tiles not 16-byte aligned");
  dim3 gq(unsigned(ceil_div(a.T, kRows)), unsigned(a.Hq), unsigned(a.B));
  dim3 gk(unsigned(ceil_div(a.T, kRows)), unsigned(a.Hkv), unsigned(a.B));
  if (score_grads) {
    if (warp_specialized) {
      dkdv_ws<HD>(s, dk, dv, score_grads, dout, q, k, v, lse, Dsum, a);
    } else {
      dkdv_kernel<HD, true><<<gk, kThreads, dkdv_smem<HD>(), s>>>(dk, dv, score_grads, dout, q,
                                                                  k, v, lse, Dsum, a);
      CUDA_CHECK_LAUNCH();
    }
    dq_tiles_kernel<HD><<<gq, kThreads, dq_tiles_smem<HD>(), s>>>(dq, k, score_grads, a);
    CUDA_CHECK_LAUNCH();
    return;
  }
  dq_kernel<HD><<<gq, kThreads, dq_smem<HD>(), s>>>(dq, dout, q, k, v, lse, Dsum, a);
  CUDA_CHECK_LAUNCH();
  dkdv_kernel<HD, false><<<gk, kThreads, dkdv_smem<HD>(), s>>>(dk, dv, nullptr, dout, q, k, v,
                                                               lse, Dsum, a);
  CUDA_CHECK_LAUNCH();
}

template void backward<64>(cudaStream_t, bf16*, bf16*, bf16*, const bf16*, const bf16*,
                           const bf16*, const bf16*, const float*, const float*, bf16*,
                           bool, const AttentionArgs&);
template void backward<128>(cudaStream_t, bf16*, bf16*, bf16*, const bf16*, const bf16*,
                            const bf16*, const bf16*, const float*, const float*, bf16*,
                            bool, const AttentionArgs&);
template void forward<64>(cudaStream_t, bf16*, float*, const bf16*, const bf16*, const bf16*,
                          const AttentionArgs&);
template void forward<128>(cudaStream_t, bf16*, float*, const bf16*, const bf16*, const bf16*,
                           const AttentionArgs&);

}  // namespace mhar::cuda::hopper
