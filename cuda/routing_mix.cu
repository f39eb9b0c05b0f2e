// routing_mix.cu: routing_mix, routing_mix_rmsnorm and routing_mix_tile (backend.h): a
// site's softmax over its sources and their weighted sum, one site at a time or, in full
// routing, in depth tiles whose first site's kernel reads each old slot once for the
// tile's later sites (fp32 partial rows, then a finish kernel a site), with the consumer's
// input norm inside the finish where it can. Conventions: cuda/routing.cu.
#include <algorithm>

#include "cuda/rmsnorm_row.cuh"  // store_row_normed: rmsnorm_forward's arithmetic
#include "cuda/routing_host.h"

namespace mhar::cuda {
namespace routing_detail {
namespace {

// The consumer's input norm of a mixed row (routing_mix_rmsnorm): its output y [N, d],
// rstd [N] and weight w [d]. y null: no norm (the kernels' plain instantiations).
struct RowNorm {
  bf16* y = nullptr;
  float* rstd = nullptr;
  const bf16* w = nullptr;
  float eps = 0.f;
};

// store_row of token n's row into x, then its norm, with the bits of rmsnorm_forward's
// vector kernel (norm.cu, rmsnorm_forward_vec_kernel; the host checked
// rmsnorm_forward_row_fusable): that kernel's lane holds the same chunks lane + 32 t of
// the row (t ascending) and runs the same code on them (rmsnorm_row.cuh: the stored bf16
// values' squares, the lanes' butterfly, rstd, y); where its rows are narrower than a warp
// (d <= 128), the lanes past the row add exact zeros here.
// The norm's second half, token n: rstd from the lanes' sums of squares ss, then y from the
// row's bf16 chunks lane + 32 t that this lane holds in xv.
template <int NT>
__device__ __forceinline__ void norm_held_row(const uint4 (&xv)[NT], float ss, const RowNorm& nm,
                                              int64_t n, int d, int nchunks) {
  const int lane = threadIdx.x & 31;
  const float r = rms_rstd(group_sum<32>(ss), d, nm.eps);
#pragma unroll
  for (int t = 0; t < NT; ++t) {
    const int ch = lane + 32 * t;
    if (ch >= nchunks) continue;
    float wf[8], v[8];
    load8(nm.w + 8 * ch, wf);
    unpack8(xv[t], v);
    norm_chunk8(v, r, wf);
    store8(nm.y + n * d + 8 * ch, v);
  }
  if (lane == 0) nm.rstd[n] = r;
}

template <int NT>
__device__ __forceinline__ void store_row_normed(bf16* x, const float (&f)[NT][8],
                                                 const RowNorm& nm, int64_t n, int d, int nchunks) {
  const int lane = threadIdx.x & 31;
  uint4 xv[NT];
  float ss = 0.f;
#pragma unroll
  for (int t = 0; t < NT; ++t) {
    const int ch = lane + 32 * t;
    if (ch >= nchunks) continue;
    xv[t] = pack8(f[t]);
    reinterpret_cast<uint4*>(x + n * d)[ch] = xv[t];
    add_squares8(ss, xv[t]);
  }
  norm_held_row(xv, ss, nm, n, d, nchunks);
}

// The norm of token n's row once the lane's chunks lane + 32 t (t ascending) are stored in
// x and their squares summed into ss in that order (add_squares8), as the tile kernel
// does pass by pass: rmsnorm_forward's bits, as store_row_normed gives them. The chunks
// come back from x (the lane's own stores, still in L1 or L2), so no pass keeps them.
__device__ __forceinline__ void norm_stored_row(const bf16* x, float ss, const RowNorm& nm,
                                                int64_t n, int d, int nchunks) {
  const int lane = threadIdx.x & 31;
  const float r = rms_rstd(group_sum<32>(ss), d, nm.eps);
  for (int ch = lane; ch < nchunks; ch += 32) {
    float wf[8], v[8];
    load8(nm.w + 8 * ch, wf);
    unpack8(reinterpret_cast<const uint4*>(x + n * d)[ch], v);
    norm_chunk8(v, r, wf);
    store8(nm.y + n * d + 8 * ch, v);
  }
  if (lane == 0) nm.rstd[n] = r;
}

// The norm of token n's row x once the warp has stored it in another order than the
// norm's (the span layout: lane l holds chunks l NT .. l NT + NT - 1): each lane reads the
// norm's chunks lane + 32 t back (L2; the warp barrier orders the other lanes' stores
// before the loads) and runs store_row_normed's arithmetic on them: rmsnorm_forward's bits.
// Its load loop mirrors store_row_normed's store loop on purpose: one helper for both
// (chunks from a callable) changed the PTX of 35 finish kernels (tools/ptx_same.py,
// 2026-12-08), which needs a GPU parity run before it can replace the tested form.
template <int NT>
__device__ __forceinline__ void norm_row_stored_by_warp(const bf16* x, const RowNorm& nm, int64_t n,
                                                        int d, int nchunks) {
  __syncwarp();
  const int lane = threadIdx.x & 31;
  uint4 xv[NT];
  float ss = 0.f;
#pragma unroll
  for (int t = 0; t < NT; ++t) {
    const int ch = lane + 32 * t;
    if (ch >= nchunks) continue;
    xv[t] = reinterpret_cast<const uint4*>(x + n * d)[ch];
    add_squares8(ss, xv[t]);
  }
  norm_held_row(xv, ss, nm, n, d, nchunks);
}

// ---------------------------------------------------------------- mix (one site)
// NORM (MixNorm version 4): the consumer's norm `nm` of each token's x as it is stored.
template <int NT, bool ALIGNED, bool NORM = false>
__global__ void __launch_bounds__(32 * kWarpsPerBlock)
    mix_kernel(bf16* __restrict__ x, float* __restrict__ weights, const bf16* __restrict__ hist,
               const Geometry g, int site, const RowNorm nm) {
  extern __shared__ float smem[];
  float* m_sh = smem + (threadIdx.x >> 5) * 2 * g.H;  // per head: max, 1/sum
  float* linv_sh = m_sh + g.H;
  const int lane = threadIdx.x & 31;
  const LaneHeads<NT> L = lane_heads<NT>(g);
  const bool lane_heads_fit = g.H <= 32;  // lane h owns head h's weights
  const int64_t warps = int64_t(gridDim.x) * (blockDim.x >> 5);
  // The site's sources t = 0 .. src-1 (oldest first): slot site_source(site, t).
  const int src = g.lay.site_sources(site), closed = site / g.lay.block;
  auto slot = [&](int t) { return t <= closed ? t * g.lay.block : site; };
  for (int64_t n = int64_t(blockIdx.x) * (blockDim.x >> 5) + (threadIdx.x >> 5); n < g.N;
       n += warps) {
    auto wptr = [&](int t) { return weights + g.lay.site_pair(site, t, closed) * g.H * g.N + n; };
    // Softmax statistics per head, the lanes spread over the sources (independent loads).
    for (int h = 0; h < g.H; ++h) {
      float m = -INFINITY;
      for (int i = lane; i < src; i += 32) m = fmaxf(m, wptr(i)[int64_t(h) * g.N]);
      m = warp_max(m);
      float l = 0.f;
      for (int i = lane; i < src; i += 32) l += __expf(wptr(i)[int64_t(h) * g.N] - m);
      l = warp_sum(l);
      if (lane == 0) {
        m_sh[h] = m;
        linv_sh[h] = 1.f / l;
      }
    }
    __syncwarp();
    const float m_own = lane_heads_fit && lane < g.H ? m_sh[lane] : 0.f;
    const float linv_own = lane_heads_fit && lane < g.H ? linv_sh[lane] : 0.f;
    float acc[NT][8];
#pragma unroll
    for (int t = 0; t < NT; ++t)
#pragma unroll
      for (int e = 0; e < 8; ++e) acc[t][e] = 0.f;
    Row<NT> cur, nxt;
    load_row(cur, hist + (int64_t(slot(0)) * g.N + n) * g.d, g.nchunks);
    float s_cur = lane_heads_fit && lane < g.H ? wptr(0)[int64_t(lane) * g.N] : 0.f, s_nxt = 0.f;
    for (int i = 0; i < src; ++i) {
      if (i + 1 < src) {  // prefetch the next source's row and logit
        load_row(nxt, hist + (int64_t(slot(i + 1)) * g.N + n) * g.d, g.nchunks);
        if (lane_heads_fit && lane < g.H) s_nxt = wptr(i + 1)[int64_t(lane) * g.N];
      }
      float* w = wptr(i);
      float a[NT][kHeadVals<ALIGNED>];
      if (lane_heads_fit) {
        float a_h = 0.f;
        if (lane < g.H) {
          a_h = __expf(s_cur - m_own) * linv_own;
          w[int64_t(lane) * g.N] = a_h;
        }
        if constexpr (ALIGNED) {
#pragma unroll
          for (int t = 0; t < NT; ++t) a[t][0] = __shfl_sync(0xffffffffu, a_h, max(L.head[t], 0));
        } else {
#pragma unroll
          for (int t = 0; t < NT; ++t) {
            const int ch = min(lane + 32 * t, g.nchunks - 1);
#pragma unroll
            for (int e = 0; e < kHeadVals<ALIGNED>; ++e)
              a[t][e] = __shfl_sync(0xffffffffu, a_h, (8 * ch + e) / g.dh);
          }
        }
      } else {
        load_per_head<NT, ALIGNED>(a, w, g, L);  // raw logits
#pragma unroll
        for (int t = 0; t < NT; ++t) {
          const int ch = min(lane + 32 * t, g.nchunks - 1);
#pragma unroll
          for (int e = 0; e < kHeadVals<ALIGNED>; ++e) {
            const int h = ALIGNED ? max(L.head[t], 0) : (8 * ch + e) / g.dh;
            a[t][e] = __expf(a[t][e] - m_sh[h]) * linv_sh[h];
          }
        }
        __syncwarp();  // every lane has read the raw logits
        for (int h = lane; h < g.H; h += 32)
          w[int64_t(h) * g.N] = __expf(w[int64_t(h) * g.N] - m_sh[h]) * linv_sh[h];
      }
#pragma unroll
      for (int t = 0; t < NT; ++t)
#pragma unroll
        for (int e = 0; e < 8; ++e) acc[t][e] += hv<ALIGNED>(a, t, e) * elem(cur.raw[t], e);
      if (i + 1 < src) {
        cur = nxt;
        s_cur = s_nxt;
      }
    }
    if constexpr (NORM)
      store_row_normed(x, acc, nm, n, g.d, g.nchunks);
    else
      store_row(x + n * g.d, acc, g.nchunks);
    __syncwarp();  // m_sh/linv_sh are rewritten for the next token
  }
}

// ---------------------------------------------------------------- depth tiling (mix)
// routing_mix_tile (backend.h) for full routing: the sites j0 .. j0+count-1 all read the
// slots 0 .. j0, so the tile kernel reads each of those rows once and keeps, per later
// site j0+m, the unnormalised sum P_m = sum_{i<=j0} exp(s_i - M_m) v_i (fp32 row) with its
// per-head max M_m and sum L_m; site j0's own mix is finished there. Site j0+m's finish
// kernel then merges the slots j0+1 .. j0+m: with M = max(M_m, new logits) and
// L = L_m e^(M_m - M) + sum_new e^(s - M), x = P_m e^(M_m - M) / L + sum_new a_i v_i, and
// every weight a_i = e^(s_i - M) / L is written as the plain mix writes it. Bytes for a
// tile of k sites from j0 (rows R = N d 2): (j0 + 1) + 1 + 2 (k - 1) rows in the tile
// kernel, 2 + m + 1 in site j0+m's finish; the plain mixes read sum_m (j0 + m + 1) + k.
// routing_tile_plan picks tiles of up to kTileSites - 1 sites (by default; the 8-site
// kernel measured slower a byte) that move the fewest bytes over the depth
// (routing_tile_rows, with the norms; cuda/NOTES.md has the model per size).
constexpr int kTileSites = 8;
constexpr int kTilePrefetch = 8;  // slot rows in flight per lane in the tile kernel

__device__ __forceinline__ int64_t full_pair_base(int i, int S) {
  return int64_t(i) * S - int64_t(i) * (i - 1) / 2;
}

// One warp per token, in three phases. (1) The tile's raw logits, every slot i <= j0,
// tile site m and head h, into this warp's shared table T[(i count + m) H + h]: all 32
// lanes load independent entries, so the logits' latency is paid a few times per token
// rather than once per slot. (2) Lane c = (m, h) turns its column into e^(s - M) (over
// L for site j0) with its online max M and sum L, kept for the partial statistics.
// (3) Passes of 256 features (lane l: chunk l + 32 p, inside one head since
// dh % 8 == 0): each slot's chunk is read once and added into the k accumulators
// (k x 8 fp32 registers) with its weights from T.
template <int K>
__global__ void __launch_bounds__(32 * kWarpsPerBlock, 4)
    mix_tile_kernel(bf16* __restrict__ x, float* __restrict__ weights,
                    const bf16* __restrict__ hist, float* __restrict__ partial,
                    float* __restrict__ pstat, const Geometry g, int site0, int count) {
  extern __shared__ float tile_tables[];  // per warp: (site0 + 1) count H floats
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int S = g.lay.sites, nsrc = site0 + 1, cph = g.dh / 8, CH = count * g.H;
  float* T = tile_tables + int64_t(warp) * nsrc * CH;
  const int64_t HN = int64_t(g.H) * g.N, Nd = g.N * g.d;
  const int64_t warps = int64_t(gridDim.x) * (blockDim.x >> 5);
  for (int64_t n = int64_t(blockIdx.x) * (blockDim.x >> 5) + warp; n < g.N; n += warps) {
    // logit of slot i for site site0 + m, head h: pair(i, site0 + m) = pair(i, site0) + m
    auto logit = [&](int i, int m, int h) {
      return weights + (full_pair_base(i, S) + site0 - i + m) * HN + int64_t(h) * g.N + n;
    };
    __syncwarp();  // the previous token's passes have read T
    // (1) entry e = (i count + m) H + h; H divides 32, so a step of 32 keeps h.
    {
      int i = lane / CH, m = (lane % CH) / g.H;
      const int h = lane % g.H, dm = 32 / g.H;
#pragma unroll 8
      for (int e = lane; e < nsrc * CH; e += 32) {
        T[e] = *logit(i, m, h);
        for (m += dm; m >= count; m -= count) ++i;
      }
    }
    __syncwarp();
    // (2) column c = (m, h)
    for (int c = lane; c < CH; c += 32) {
      const int m = c / g.H, h = c % g.H;
      float mx = -INFINITY, l = 0.f;
      for (int i = 0; i < nsrc; ++i) online_add(mx, l, T[i * CH + c]);
      const float scale = m == 0 ? 1.f / l : 1.f;
      for (int i = 0; i < nsrc; ++i) T[i * CH + c] = __expf(T[i * CH + c] - mx) * scale;
      if (m > 0) {
        pstat[int64_t(m - 1) * 2 * HN + int64_t(h) * g.N + n] = mx;
        pstat[(int64_t(m - 1) * 2 + 1) * HN + int64_t(h) * g.N + n] = l;
      }
    }
    __syncwarp();
    // Site j0's weights are final: write them back (entries (i, 0, h)).
    for (int e = lane; e < nsrc * g.H; e += 32) {
      const int i = e / g.H, h = e % g.H;
      *logit(i, 0, h) = T[i * CH + h];
    }
    // (3)
    for (int pass = 0; 32 * pass < g.nchunks; ++pass) {
      const int ch = lane + 32 * pass;
      const bool on = ch < g.nchunks;
      const float* tw = T + (on ? ch / cph : 0);
      float acc[K][8];
#pragma unroll
      for (int m = 0; m < K; ++m)
#pragma unroll
        for (int e = 0; e < 8; ++e) acc[m][e] = 0.f;
      const uint4* row = reinterpret_cast<const uint4*>(hist + n * g.d) + ch;
      for (int i0 = 0; i0 < nsrc; i0 += kTilePrefetch) {
        uint4 v[kTilePrefetch];
#pragma unroll
        for (int u = 0; u < kTilePrefetch; ++u)
          v[u] = on && i0 + u < nsrc ? row[(i0 + u) * (Nd / 8)] : make_uint4(0, 0, 0, 0);
#pragma unroll
        for (int u = 0; u < kTilePrefetch; ++u) {
          const int i = i0 + u;
          if (i >= nsrc) break;
#pragma unroll
          for (int m = 0; m < K; ++m) {
            if (m >= count) break;
            const float a = tw[(i * count + m) * g.H];
#pragma unroll
            for (int e = 0; e < 8; ++e) acc[m][e] += a * elem(v[u], e);
          }
        }
      }
      if (!on) continue;
      reinterpret_cast<uint4*>(x + n * g.d)[ch] = pack8(acc[0]);
#pragma unroll
      for (int m = 1; m < K; ++m) {
        if (m >= count) break;
        store8_f32(reinterpret_cast<float4*>(partial + (m - 1) * Nd + n * g.d) + 2 * ch, acc[m]);
      }
    }
  }
}

// Version 2 of the tile kernel (kernel lab: routing_set_kernel_version; version 1 is
// mix_tile_kernel above). The same three phases and, per output value, the same
// operations in the same order (so the same bits), with more bytes in flight per warp.
// Version 1 issues 8 slot chunks, waits for them, then spends ~600 instructions on them
// with nothing of its own in flight; with 12-16 warps per SM that left the loads idle
// most of the time (ncu: 62% of stalls on the L1TEX scoreboard). Here:
// - the (pass, slot) steps stream through a ring of R chunks per lane: the load for step
//   s + R is issued when step s is taken from the ring, so each lane always has R loads
//   in flight, across the passes' boundaries too;
// - the ring's first loads are issued before phases (1) and (2), which then overlap them,
//   and phase (1) keeps 16 logit loads in flight per lane, not 8;
// - the weight table is laid out [slot][head][site, padded to KP = 4 ceil(K/4)], so a
//   lane reads its head's K weights of a slot with KP/4 16-byte shared loads, not K;
// - the accumulators are exactly the tile's K sites (one instantiation per k <= 8): no
//   idle predicated sites.
// R (versions 2, 3): 8 where the 128 registers of 4 blocks per SM hold it beside K
// accumulator rows (ptxas: 108-128 registers, no spills, K <= 6), 6 for K = 7, 8 (R = 8
// spills 36-52 bytes there). Version 4: 3 blocks per SM (168 registers) and R = 12 for
// every K (ptxas: 124-168 registers, no spills): 12 warps per SM, which is what the late
// tiles' tables leave room for anyway, each with twice the chunks in flight.
// Versions 3 and 4 run on a one-wave grid (routing_mix_tile).
// Version 5 (COOP; the default since the nineteenth session) is version 2 with phase (1)
// shared by the block's warps: the
// weights' layout is [pair][head][token] and phase (1) reads each logit as 4 bytes of its
// own 32-byte sector (K H reads a slot and token, about 2 KB of sectors beside each 2.5 KB
// row at 1B), the gather that finish version 6 removed from the finishes (1.8x there). The
// block's warps take 4 consecutive tokens in lockstep, and 4 consecutive threads load one
// (slot, site, head) logit of the 4 tokens: 16 contiguous bytes, half a sector, into each
// token's warp table; two block barriers a token. A whole sector would need 8 tokens'
// tables a block (at 1B up to 150 KB). The values and their order are version 2's.
constexpr int tile_ring(int K) { return K <= 6 ? 8 : 6; }
constexpr int kTileRingDeep = 12;
// Version 5 is the default: the tile kernels of a step, ms, v2 -> v5 (nineteenth session,
// OpTiming.DISABLED_RoutingTileVersions): 100M 0.734 -> 0.708, 350M 3.387 -> 3.119, 1B
// 8.953 -> 8.146 (2.93 TB/s); 3 and 4 were no faster than 2 (cuda/NOTES.md, "Tile kernel
// versions 2 to 4").

// NORM (version 5 in routing_mix_tile_rmsnorm): site j0's row normed by the consumer's
// norm `nm` after its last pass (norm_stored_row), which saves the norm's own launch and
// its read of x.
template <int K, int R, int MIN_BLOCKS, bool COOP = false, bool NORM = false>
__global__ void __launch_bounds__(32 * kWarpsPerBlock, MIN_BLOCKS)
    mix_tile_ring_kernel(bf16* __restrict__ x, float* __restrict__ weights,
                         const bf16* __restrict__ hist, float* __restrict__ partial,
                         float* __restrict__ pstat, const Geometry g, int site0, const RowNorm nm) {
  constexpr int KP = (K + 3) / 4 * 4;
  extern __shared__ float4 ring_tables[];  // per warp: (site0 + 1) H KP floats
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int S = g.lay.sites, nsrc = site0 + 1, cph = g.dh / 8, CH = K * g.H, HK = g.H * KP;
  float* T = reinterpret_cast<float*>(ring_tables) + int64_t(warp) * nsrc * HK;
  const int64_t HN = int64_t(g.H) * g.N, Nd = g.N * g.d;
  const int passes = (g.nchunks + 31) / 32, steps = passes * nsrc;
  const int64_t warps = int64_t(gridDim.x) * (blockDim.x >> 5);
  static_assert(!COOP || kWarpsPerBlock == 4, "COOP: 4 threads a token in phase (1)");
  // COOP: the block's warps take consecutive tokens n0 + warp in lockstep (block barriers),
  // so the loop runs while the block's first token is in range.
  for (int64_t n0 = int64_t(blockIdx.x) * (blockDim.x >> 5) + (COOP ? 0 : warp); n0 < g.N;
       n0 += warps) {
    const int64_t n = COOP ? n0 + warp : n0;
    const bool active = !COOP || n < g.N;
    auto logit = [&](int i, int m, int h) {
      return weights + (full_pair_base(i, S) + site0 - i + m) * HN + int64_t(h) * g.N + n;
    };
    // Step (p, i) reads slot i's chunk lane + 32 p. The next step to load: slot li of
    // pass lp at lptr (a running pointer: no 64-bit index products per step).
    const uint4* rows = reinterpret_cast<const uint4*>(hist + n * g.d) + lane;
    const uint4* lptr = rows;
    int li = 0, lp = 0;
    bool lon = active && lane < g.nchunks;
    auto load_next = [&](uint4& dst) {
      dst = lon ? *lptr : make_uint4(0, 0, 0, 0);
      lptr += Nd / 8;
      if (++li == nsrc) {
        li = 0, ++lp;
        lptr = rows + 32 * lp;
        lon = active && lp < passes && lane + 32 * lp < g.nchunks;
      }
    };
    uint4 ring[R];
#pragma unroll
    for (int u = 0; u < R; ++u) load_next(ring[u]);
    if constexpr (COOP) {
      __syncthreads();  // every warp's passes have read its table
      // (1) for the block's 4 tokens: thread t loads entry e = t / 4 + 32 s of token
      // n0 + t % 4 into that token's warp table, so 4 consecutive threads read 16
      // contiguous bytes of one logit row.
      const int j = threadIdx.x & 3, lane_j = threadIdx.x >> 2;
      if (n0 + j < g.N) {
        float* Tj = reinterpret_cast<float*>(ring_tables) + int64_t(j) * nsrc * HK;
        int i = lane_j / CH, m = (lane_j % CH) / g.H;
        const int h = lane_j % g.H, dm = 32 / g.H;
#pragma unroll 16
        for (int e = lane_j; e < nsrc * CH; e += 32) {
          Tj[(i * g.H + h) * KP + m] =
              weights[(full_pair_base(i, S) + site0 - i + m) * HN + int64_t(h) * g.N + n0 + j];
          for (m += dm; m >= K; m -= K) ++i;
        }
      }
      __syncthreads();
      if (!active) continue;  // past the last token: the barriers above only
    } else {
      __syncwarp();  // the previous token's passes have read T
      // (1) entry (i, m, h) at T[(i H + h) KP + m]; lanes walk e = (i K + m) H + h as in
      // version 1 (H divides 32, so a step of 32 keeps h).
      {
        int i = lane / CH, m = (lane % CH) / g.H;
        const int h = lane % g.H, dm = 32 / g.H;
#pragma unroll 16
        for (int e = lane; e < nsrc * CH; e += 32) {
          T[(i * g.H + h) * KP + m] = *logit(i, m, h);
          for (m += dm; m >= K; m -= K) ++i;
        }
      }
      __syncwarp();
    }
    // (2) column c = (m, h): the same online statistics and weights as version 1.
    for (int c = lane; c < CH; c += 32) {
      const int m = c / g.H, h = c % g.H;
      float* col = T + h * KP + m;
      float mx = -INFINITY, l = 0.f;
      for (int i = 0; i < nsrc; ++i) online_add(mx, l, col[i * HK]);
      const float scale = m == 0 ? 1.f / l : 1.f;
      for (int i = 0; i < nsrc; ++i) col[i * HK] = __expf(col[i * HK] - mx) * scale;
      if (m > 0) {
        pstat[int64_t(m - 1) * 2 * HN + int64_t(h) * g.N + n] = mx;
        pstat[(int64_t(m - 1) * 2 + 1) * HN + int64_t(h) * g.N + n] = l;
      }
    }
    __syncwarp();
    for (int e = lane; e < nsrc * g.H; e += 32) *logit(e / g.H, 0, e % g.H) = T[e * KP];
    // (3) the steps, R at a time from the ring; a pass's outputs are stored when
    // its last slot is in.
    float acc[K][8];
#pragma unroll
    for (int m = 0; m < K; ++m)
#pragma unroll
      for (int e = 0; e < 8; ++e) acc[m][e] = 0.f;
    int i = 0, p = 0;
    float ss = 0.f;  // NORM: the squares of the lane's stored x chunks, pass after pass
    const float4* tw =
        reinterpret_cast<const float4*>(T + (lane < g.nchunks ? lane / cph : 0) * KP);
    // Whole rounds of the ring: the steps past the last (at most R - 1 per token)
    // add 0 x (a valid weight) into accumulators that are then dropped (their pass p is
    // past the row), which keeps the unrolled body free of exits (an exit per step cost
    // ptxas ~1.8 KB of spills at K = 7).
    for (int s0 = 0; s0 < steps; s0 += R) {
#pragma unroll
      for (int u = 0; u < R; ++u) {
        const uint4 v = ring[u];
        load_next(ring[u]);
        float a[KP];
#pragma unroll
        for (int q = 0; q < KP / 4; ++q) {
          const float4 w = tw[i * (HK / 4) + q];
          a[4 * q] = w.x, a[4 * q + 1] = w.y, a[4 * q + 2] = w.z, a[4 * q + 3] = w.w;
        }
#pragma unroll
        for (int m = 0; m < K; ++m)
#pragma unroll
          for (int e = 0; e < 8; ++e) acc[m][e] += a[m] * elem(v, e);
        if (++i == nsrc) {
          const int ch = lane + 32 * p;
          if (ch < g.nchunks) {
            const uint4 xv = pack8(acc[0]);
            reinterpret_cast<uint4*>(x + n * g.d)[ch] = xv;
            if constexpr (NORM) add_squares8(ss, xv);
            float4* out = reinterpret_cast<float4*>(partial + n * g.d) + 2 * ch;
#pragma unroll
            for (int m = 1; m < K; ++m, out += Nd / 4) store8_f32(out, acc[m]);
          }
#pragma unroll
          for (int m = 0; m < K; ++m)
#pragma unroll
            for (int e = 0; e < 8; ++e) acc[m][e] = 0.f;
          i = 0, ++p;
          tw =
              reinterpret_cast<const float4*>(T + (ch + 32 < g.nchunks ? (ch + 32) / cph : 0) * KP);
        }
      }
    }
    if constexpr (NORM) norm_stored_row(x, ss, nm, n, g.d, g.nchunks);
  }
}

// Site site0 + m of a tile (m >= 1): P, M_m, L_m from the tile kernel (partial, pstat
// already offset to this site), the slots site0+1 .. site merged in.
// Kernel-lab versions (routing_set_kernel_version(MixFinish, v); the same operations in
// the same order, so the same bits):
// 1 (mix_tile_finish_kernel<NT, 0>) each token's loads in turn: the softmax statistics
//   (pstat, the logits), then the partial row, then each newer slot row, loaded and then
//   used: 3 + m DRAM round trips a token, one row in flight a warp (the finishes were
//   ~14.5 ms of the 1B step, well under the copy rate: cuda/NOTES.md lead 3);
// 2 (mix_tile_finish_early_kernel) the partial row and the first newer slot row issued at
//   the token's start, in flight during the statistics, and each later slot row loaded
//   one ahead of its use;
// 3 version 2 bounded to 4 blocks an SM (128 registers), for the wide rows, where version
//   2's extra rows leave fewer warps (ptxas, d 1280: version 1 96 registers, 5 blocks an
//   SM; version 2 133, 3 blocks; version 3 128, no spill; at d 1536 and 2048 version 3
//   spills 144 and 460 bytes);
// 4 (the default; mix_tile_finish_kernel<NT, kNormBatch>) version 1 with the site's
//   weights normalised in batches: each lane loads kNormBatch (8) of its weights, then
//   rewrites them (normalise_strided). In versions 1-3 each weight's load
//   follows the previous weight's store (the compiler cannot prove the addresses apart),
//   so a lane made (site + 1) / (32 / H) dependent round trips to L2 or DRAM a token:
//   ncu of version 1 at 1B (seventeenth session) put 53% of the kernel's stall samples
//   on that one load, at 1.28 TB/s;
// 5 version 3 with batches of kNormBatchEarly (4) weights (the rows loaded ahead may pay
//   once the normalisation no longer dominates);
// 6 (the default where H >= 4, else version 4) mix_tile_finish_grouped_kernel: the
//   statistics and normalisation with lanes over a group of 8 tokens, whole sectors of the
//   weights (see there).
// Measured (sixteenth session, OpTiming.DISABLED_RoutingTileVersions: a step's finishes,
// as the tiled step less its tile kernels, ms, v1 / v2 / v3): 100M 1.05 / 1.21 / 1.20,
// 350M 7.36 / 7.30 / 7.30, 1B 14.59 / 16.64 / 14.40. Loading ahead does not pay: the
// finishes are not bound by their rows' load latency (see cuda/NOTES.md lead 3 for what
// else they move). Seventeenth session (same test, v1 / v4): 100M 1.08 / 1.05, 350M 7.55 /
// 6.45, 1B 14.98 / 12.21. Eighteenth session (same test, v4 / v6): 100M 1.033 / 0.714,
// 350M 6.316 / 3.570, 1B 11.898 / 6.733 ms (2.67-2.73 TB/s): version 6 is the default.

// Weights a lane normalises per batch in finish_softmax (versions 4, 5): its loads in flight
// at once (ptxas, d 1280: version 4 122 registers, no spill; version 5 at the 128-register
// bound spilled 80 bytes with batches of 8, and spills 48 with batches of 4).
constexpr int kNormBatch = 8, kNormBatchEarly = 4;

// The site's softmax over the tile's state (M_m, L_m in pstat) and its newer slots'
// logits: every weight of the site normalised in place, and each head's scale of the
// partial row, exp(M_m - max) / sum, into st_scale[warp][head]. BATCH > 0 (versions 4,
// 5): the weights are loaded BATCH at a time before any is rewritten; each weight's value
// is the same expression either way.
template <int BATCH>
__device__ __forceinline__ void finish_softmax(float* weights, const float* pstat,
                                               float (&st_scale)[kWarpsPerBlock][32],
                                               const Geometry& g, int site0, int site, int64_t n) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int G = 32 / g.H, h = lane / G, sub = lane % G;
  const int S = g.lay.sites;
  const int64_t HN = int64_t(g.H) * g.N;
  auto logit = [&](int i) {
    return weights + (full_pair_base(i, S) + site - i) * HN + int64_t(h) * g.N + n;
  };
  const float m_old = pstat[int64_t(h) * g.N + n], l_old = pstat[HN + int64_t(h) * g.N + n];
  float mx = sub == 0 ? m_old : -INFINITY, l = sub == 0 ? l_old : 0.f;
  if constexpr (BATCH > 0)
    online_add_strided(mx, l, logit, site0 + 1 + sub, site + 1, G);
  else
    for (int i = site0 + 1 + sub; i <= site; i += G) online_add(mx, l, *logit(i));
  online_merge_lanes(mx, l, G);
  const float linv = 1.f / l;
  if constexpr (BATCH > 0) {
    normalise_strided<BATCH>(logit, sub, site + 1, G, mx, linv);
  } else {
    for (int i = sub; i <= site; i += G) {  // every weight of the site, normalised in place
      float* p = logit(i);
      *p = __expf(*p - mx) * linv;
    }
  }
  if (sub == 0) st_scale[warp][h] = __expf(m_old - mx) * linv;
  __syncwarp();  // the normalised weights and the scales are visible to the warp
}

// acc += the weighted slot row v of slot i (its normalised weight for `site`).
template <int NT>
__device__ __forceinline__ void finish_merge(float (&acc)[NT][8], const Row<NT>& v,
                                             const float* weights, const LaneHeads<NT>& L,
                                             const Geometry& g, int i, int site, int64_t n) {
  const int64_t HN = int64_t(g.H) * g.N;
  const float* w = weights + (full_pair_base(i, g.lay.sites) + site - i) * HN + n;
#pragma unroll
  for (int t = 0; t < NT; ++t) {
    if (L.head[t] < 0) continue;
    const float a = w[int64_t(L.head[t]) * g.N];
#pragma unroll
    for (int e = 0; e < 8; ++e) acc[t][e] += a * elem(v.raw[t], e);
  }
}

// acc = this lane's chunks of the partial row (a, b: its two float4 halves of chunk t),
// each scaled by its head's st_scale.
template <int NT, class Part>
__device__ __forceinline__ void finish_start(float (&acc)[NT][8], Part&& part,
                                             const float (&st_scale)[kWarpsPerBlock][32],
                                             const LaneHeads<NT>& L, const Geometry& g) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
#pragma unroll
  for (int t = 0; t < NT; ++t) {
    const int ch = lane + 32 * t;
    if (ch >= g.nchunks) continue;
    const float sc = st_scale[warp][L.head[t]];
    float4 a, b;
    part(t, ch, a, b);
    acc[t][0] = a.x * sc, acc[t][1] = a.y * sc, acc[t][2] = a.z * sc, acc[t][3] = a.w * sc;
    acc[t][4] = b.x * sc, acc[t][5] = b.y * sc, acc[t][6] = b.z * sc, acc[t][7] = b.w * sc;
  }
}

template <int NT, int BATCH, bool NORM = false>
__global__ void __launch_bounds__(32 * kWarpsPerBlock)
    mix_tile_finish_kernel(bf16* __restrict__ x, float* __restrict__ weights,
                           const bf16* __restrict__ hist, const float* __restrict__ partial,
                           const float* __restrict__ pstat, const Geometry g, int site0, int site,
                           RowNorm nm) {
  __shared__ float st_scale[kWarpsPerBlock][32];
  const LaneHeads<NT> L = lane_heads<NT>(g);
  const int64_t warps = int64_t(gridDim.x) * (blockDim.x >> 5);
  for (int64_t n = int64_t(blockIdx.x) * (blockDim.x >> 5) + (threadIdx.x >> 5); n < g.N;
       n += warps) {
    finish_softmax<BATCH>(weights, pstat, st_scale, g, site0, site, n);
    float acc[NT][8];
    const float4* p = reinterpret_cast<const float4*>(partial + n * g.d);
    auto chunk = [&](int, int ch, float4& a, float4& b) { a = p[2 * ch], b = p[2 * ch + 1]; };
    finish_start(acc, chunk, st_scale, L, g);
    for (int i = site0 + 1; i <= site; ++i) {
      Row<NT> v;
      load_row(v, hist + (int64_t(i) * g.N + n) * g.d, g.nchunks);
      finish_merge(acc, v, weights, L, g, i, site, n);
    }
    if constexpr (NORM)
      store_row_normed(x, acc, nm, n, g.d, g.nchunks);
    else
      store_row(x + n * g.d, acc, g.nchunks);
    __syncwarp();  // st_scale is rewritten for the next token
  }
}

template <int NT, int kMinBlocks, int BATCH>
__global__ void __launch_bounds__(32 * kWarpsPerBlock, kMinBlocks)
    mix_tile_finish_early_kernel(bf16* __restrict__ x, float* __restrict__ weights,
                                 const bf16* __restrict__ hist, const float* __restrict__ partial,
                                 const float* __restrict__ pstat, const Geometry g, int site0,
                                 int site) {
  __shared__ float st_scale[kWarpsPerBlock][32];
  const int lane = threadIdx.x & 31;
  const LaneHeads<NT> L = lane_heads<NT>(g);
  const int64_t warps = int64_t(gridDim.x) * (blockDim.x >> 5);
  for (int64_t n = int64_t(blockIdx.x) * (blockDim.x >> 5) + (threadIdx.x >> 5); n < g.N;
       n += warps) {
    auto slot_row = [&](int i) { return hist + (int64_t(i) * g.N + n) * g.d; };
    // This lane's chunks of the partial row and the first slot row to merge (site >
    // site0: at least one), in flight while the statistics are computed.
    const float4* p = reinterpret_cast<const float4*>(partial + n * g.d);
    float4 pa[NT], pb[NT];
#pragma unroll
    for (int t = 0; t < NT; ++t) {
      const int ch = lane + 32 * t;
      pa[t] = pb[t] = make_float4(0.f, 0.f, 0.f, 0.f);
      if (ch < g.nchunks) pa[t] = p[2 * ch], pb[t] = p[2 * ch + 1];
    }
    Row<NT> next;
    load_row(next, slot_row(site0 + 1), g.nchunks);
    finish_softmax<BATCH>(weights, pstat, st_scale, g, site0, site, n);
    float acc[NT][8];
    auto chunk = [&](int t, int, float4& a, float4& b) { a = pa[t], b = pb[t]; };
    finish_start(acc, chunk, st_scale, L, g);
    for (int i = site0 + 1; i <= site; ++i) {
      const Row<NT> v = next;
      if (i < site) load_row(next, slot_row(i + 1), g.nchunks);
      finish_merge(acc, v, weights, L, g, i, site, n);
    }
    store_row(x + n * g.d, acc, g.nchunks);
    __syncwarp();  // st_scale is rewritten for the next token
  }
}

// Version 6 (the default where H >= 4; written in the seventeenth session, first run and
// measured in the eighteenth: 1.8x version 4 at 350M and 1B). The weights' layout is
// [pair][head][token], so versions 1-5, one token a warp, read and
// write each weight as 4 bytes of its own 32-byte sector (ncu of version 1: 8x the ideal L2
// sectors on the normalisation's load and store). Here a warp takes kGroupTokens
// consecutive tokens in two phases:
//   A. lane = token j + kGroupTokens q: lane q of each token takes heads q, q + 4, ...
//      and does that (token, head)'s softmax statistics and the in-place normalisation of
//      the site's weights. The group's 8 lanes of one (slot, head) row then read and write
//      one whole sector. The statistics repeat exactly what versions 1-5 compute with G =
//      32 / H lanes a head: sub-state s takes the new slots site0 + 1 + s, + G, ... in
//      order (s = 0 starting from the tile's M_m, L_m), then online_merge_lanes' butterfly
//      (for o = G/2 .. 1, state s merged with state s ^ o: both lanes of a pair computed
//      the same two terms, which commute, so state 0 is what every lane of the head held).
//      So mx, 1/l, every weight and every scale are versions 1-5's bits.
//   B. each of the group's tokens in turn, lanes over features: version 1's row merge.
// Shapes with G > kGroupMaxSubs (H < 4) take version 4.
constexpr int kGroupTokens = 8;                    // 8 tokens x 4 bytes: one sector
constexpr int kGroupQuarters = 32 / kGroupTokens;  // lanes per token in phase A
constexpr int kGroupMaxSubs = 8;                   // G of the heads versions 1-5 use
constexpr int kGroupBatch = 8;                     // weights a lane loads before rewriting

template <int NT, int G, bool NORM = false>
__global__ void __launch_bounds__(32 * kWarpsPerBlock)
    mix_tile_finish_grouped_kernel(bf16* __restrict__ x, float* __restrict__ weights,
                                   const bf16* __restrict__ hist, const float* __restrict__ partial,
                                   const float* __restrict__ pstat, const Geometry g, int site0,
                                   int site, RowNorm nm) {
  // [token of the group][warp][head]: st_scale[j] is the [warp][head] table finish_start reads.
  __shared__ float st_scale[kGroupTokens][kWarpsPerBlock][32];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int j = lane % kGroupTokens, quarter = lane / kGroupTokens;
  const int S = g.lay.sites, fresh = site - site0;  // new slots: site0 + 1 .. site
  const int64_t HN = int64_t(g.H) * g.N, groups = (g.N + kGroupTokens - 1) / kGroupTokens;
  const LaneHeads<NT> L = lane_heads<NT>(g);
  const int64_t warps = int64_t(gridDim.x) * (blockDim.x >> 5);
  for (int64_t grp = int64_t(blockIdx.x) * (blockDim.x >> 5) + warp; grp < groups; grp += warps) {
    const int64_t n0 = grp * kGroupTokens, n = n0 + j;
    if (n < g.N) {
      for (int h = quarter; h < g.H; h += kGroupQuarters) {  // phase A
        auto logit = [&](int i) {
          return weights + (full_pair_base(i, S) + site - i) * HN + int64_t(h) * g.N + n;
        };
        float fresh_logit[kTileSites - 1];
#pragma unroll
        for (int u = 0; u < kTileSites - 1; ++u)
          if (u < fresh) fresh_logit[u] = *logit(site0 + 1 + u);
        float sm[G], sl[G];
#pragma unroll
        for (int sub = 0; sub < G; ++sub) sm[sub] = -INFINITY, sl[sub] = 0.f;
        const float m_old = pstat[int64_t(h) * g.N + n], l_old = pstat[HN + int64_t(h) * g.N + n];
        sm[0] = m_old, sl[0] = l_old;
#pragma unroll
        for (int u = 0; u < kTileSites - 1; ++u)
          if (u < fresh) online_add(sm[u % G], sl[u % G], fresh_logit[u]);
#pragma unroll
        for (int o = G >> 1; o > 0; o >>= 1) {  // online_merge_lanes, every lane's view
          float mm[G], ll[G];
#pragma unroll
          for (int sub = 0; sub < G; ++sub) {
            mm[sub] = sm[sub], ll[sub] = sl[sub];
            online_merge(mm[sub], ll[sub], sm[sub ^ o], sl[sub ^ o]);
          }
#pragma unroll
          for (int sub = 0; sub < G; ++sub) sm[sub] = mm[sub], sl[sub] = ll[sub];
        }
        const float mx = sm[0], linv = 1.f / sl[0];
        normalise_strided<kGroupBatch>(logit, 0, site + 1, 1, mx, linv);
        st_scale[j][warp][h] = __expf(m_old - mx) * linv;
      }
    }
    __syncwarp();  // the normalised weights and the scales are visible to the warp
    for (int t = 0; t < kGroupTokens; ++t) {  // phase B
      const int64_t nt = n0 + t;
      if (nt >= g.N) break;
      float acc[NT][8];
      const float4* p = reinterpret_cast<const float4*>(partial + nt * g.d);
      auto chunk = [&](int, int ch, float4& a, float4& b) { a = p[2 * ch], b = p[2 * ch + 1]; };
      finish_start(acc, chunk, st_scale[t], L, g);
      for (int i = site0 + 1; i <= site; ++i) {
        Row<NT> v;
        load_row(v, hist + (int64_t(i) * g.N + nt) * g.d, g.nchunks);
        finish_merge(acc, v, weights, L, g, i, site, nt);
      }
      if constexpr (NORM)
        store_row_normed(x, acc, nm, nt, g.d, g.nchunks);
      else
        store_row(x + nt * g.d, acc, g.nchunks);
    }
    __syncwarp();  // st_scale is rewritten for the next group
  }
}

template <int NT, bool NORM = false>
__global__ void __launch_bounds__(32 * kWarpsPerBlock, span_blocks_per_sm(NT))
    mix_span_kernel(bf16* __restrict__ x, float* __restrict__ weights,
                    const bf16* __restrict__ hist, const Geometry g, int site, const RowNorm nm) {
  const int64_t warps = int64_t(gridDim.x) * (blockDim.x >> 5);
  for (int64_t n = int64_t(blockIdx.x) * (blockDim.x >> 5) + (threadIdx.x >> 5); n < g.N;
       n += warps) {
    float acc[NT][8];
    mix_span_token<NT, false>(acc, weights, hist, g, site, n, Row<NT>{});
    store_span(x + n * g.d, acc);
    if constexpr (NORM) norm_row_stored_by_warp<NT>(x, nm, n, g.d, g.nchunks);
  }
}

// routing_mix; with nm.y set, also the consumer's norm where the site is a depth tile's
// later one and its finish kernel has the fused form (versions 4 and 6), and with
// `plain_norm` where it is mixed on its own: true when y and rstd were written.
bool mix_site(cudaStream_t s, RoutingContext& ctx, Tensor x, Tensor weights, Tensor history,
              const RoutingLayout& layout, int site, int heads, const RowNorm& nm,
              bool plain_norm = false) {
  const char* what = "routing_mix";
  MHAR_CHECK(history.ndim == 3 && history.dim(0) == layout.sources, what, ": history must be [",
             layout.sources, ", N, d], got ", history.shape_str());
  const Geometry g = geometry(what, history.dim(1), history.dim(2), heads, layout);
  MHAR_CHECK(site >= 0 && site < layout.sites, what, ": site ", site, " of ", layout.sites);
  check_weights(what, weights, g);
  check_dtype(history, DType::BF16, what, "history");
  check_dtype(x, DType::BF16, what, "x");
  check_numel(x, g.N * g.d, what, "x");
  // The next site of the depth tile in flight (routing_mix_tile): its partial sums hold
  // the older slots. Any other call ends the tile (the plain mix reads every slot).
  const MixTile tile = ctx.tile;
  ctx.tile = MixTile{};
  if (tile.first >= 0 && site == tile.next && weights.data == tile.weights &&
      history.data == tile.history && layout == tile.layout && heads == tile.heads && g.N > 0) {
    const int m = site - tile.first;
    const int64_t partial_floats = int64_t(tile.count - 1) * g.N * g.d;
    auto* partial = static_cast<float*>(ctx.scratch(ScratchSlot::RoutingTile, 0));
    const float* pstat = partial + partial_floats + int64_t(m - 1) * 2 * g.H * g.N;
    const float* site_partial = partial + int64_t(m - 1) * g.N * g.d;
    auto* xp = static_cast<bf16*>(x.data);
    auto* hp = static_cast<const bf16*>(history.data);
    const int version = g_mix_finish_version;
    const bool norm = nm.y != nullptr && (version == 4 || version == 6);
    dispatch_rows(g, [&](auto nt, auto) {
      constexpr int NT = decltype(nt)::value;
      if (version == 6 && g.H * kGroupMaxSubs >= 32) {
        const int64_t groups = ceil_div(g.N, int64_t(kGroupTokens));
        auto grouped = [&](auto subs) {
          auto launch = [&](auto fused) {
            mix_tile_finish_grouped_kernel<NT, decltype(subs)::value, decltype(fused)::value>
                <<<grid_stride_blocks(groups * 32, 32 * kWarpsPerBlock), 32 * kWarpsPerBlock, 0,
                   s>>>(xp, weights.ptr<float>(), hp, site_partial, pstat, g, tile.first, site, nm);
          };
          if (norm)
            launch(std::true_type{});
          else
            launch(std::false_type{});
        };
        // clang-format off
        switch (32 / g.H) {  // the lanes a head takes in versions 1-5
          case 1: grouped(std::integral_constant<int, 1>{}); break;
          case 2: grouped(std::integral_constant<int, 2>{}); break;
          case 4: grouped(std::integral_constant<int, 4>{}); break;
          default: grouped(std::integral_constant<int, 8>{}); break;
        }
        // clang-format on
      } else if (version == 2 || version == 3 || version == 5) {
        auto kernel = version == 2   ? mix_tile_finish_early_kernel<NT, 1, 0>
                      : version == 3 ? mix_tile_finish_early_kernel<NT, 4, 0>
                                     : mix_tile_finish_early_kernel<NT, 4, kNormBatchEarly>;
        kernel<<<token_blocks(g.N), 32 * kWarpsPerBlock, 0, s>>>(
            xp, weights.ptr<float>(), hp, site_partial, pstat, g, tile.first, site);
      } else {
        auto kernel = version == 1 ? mix_tile_finish_kernel<NT, 0>
                      : norm       ? mix_tile_finish_kernel<NT, kNormBatch, true>
                                   : mix_tile_finish_kernel<NT, kNormBatch>;  // 4; 6 at H < 4
        kernel<<<token_blocks(g.N), 32 * kWarpsPerBlock, 0, s>>>(
            xp, weights.ptr<float>(), hp, site_partial, pstat, g, tile.first, site, nm);
      }
      CUDA_CHECK_LAUNCH();
    });
    if (site + 1 < tile.first + tile.count) {
      ctx.tile = tile;
      ctx.tile.next = site + 1;
    }
    return norm;
  }
  if (g.N == 0) return false;
  const bool norm = plain_norm && nm.y != nullptr;
  auto* xp = static_cast<bf16*>(x.data);
  auto* hp = static_cast<const bf16*>(history.data);
  if (span_layout(g)) {
    dispatch_span(g, [&](auto nt) {
      constexpr int NT = decltype(nt)::value;
      auto kernel = norm ? mix_span_kernel<NT, true> : mix_span_kernel<NT>;
      kernel<<<token_blocks(g.N), 32 * kWarpsPerBlock, 0, s>>>(xp, weights.ptr<float>(), hp, g,
                                                               site, nm);
      CUDA_CHECK_LAUNCH();
    });
    return norm;
  }
  const size_t smem = sizeof(float) * kWarpsPerBlock * 2 * heads;
  dispatch_rows(g, [&](auto nt, auto al) {
    constexpr int NT = decltype(nt)::value;
    constexpr bool AL = decltype(al)::value;
    auto kernel = norm ? mix_kernel<NT, AL, true> : mix_kernel<NT, AL>;
    allow_smem(kernel, smem);
    kernel<<<token_blocks(g.N), 32 * kWarpsPerBlock, smem, s>>>(xp, weights.ptr<float>(), hp, g,
                                                                site, nm);
    CUDA_CHECK_LAUNCH();
  });
  return norm;
}

}  // namespace
}  // namespace routing_detail

using namespace routing_detail;

void routing_mix(cudaStream_t s, RoutingContext& ctx, Tensor x, Tensor weights, Tensor history,
                 const RoutingLayout& layout, int site, int heads) {
  mix_site(s, ctx, x, weights, history, layout, site, heads, RowNorm{});
}

// routing_mix_rmsnorm and routing_mix_tile_rmsnorm (kernel lab,
// routing_set_kernel_version(MixNorm, v)): 1 the mix, then rmsnorm_forward's own launch;
// 2 the norm inside the finish kernel of a depth tile's later site (finish versions 4 and
// 6) and inside the tile kernel at its first site (tile version 5), elsewhere as 1 (with
// tiles of at most 7, a step's mixes 0.04-0.08 ms faster than 3 at 100M, 350M and 1B, H100,
// 2026-12-08; it lost only to 8-site tiles, whose NORM form spills); 3 the finishes' norm
// only; 4 (the default) version 2 and the norm inside the plain mix kernels too (a site
// mixed on its own: the plan's first sites, every site of a block layout, which never
// tiles), whose lanes read their norm chunks back where the warp stored the row in the span
// layout's order (norm_row_stored_by_warp): a full-routing step's mixes 0.02-0.06 ms faster
// than 2 at every size (H100, 2026-12-08). The same bits.
void routing_mix_rmsnorm(cudaStream_t s, RoutingContext& ctx, Tensor x, Tensor y, Tensor rstd,
                         Tensor weights, Tensor history, const RoutingLayout& layout, int site,
                         int heads, Tensor norm_w, double eps) {
  RowNorm nm;
  if (g_mix_norm_version >= 2 && rmsnorm_forward_row_fusable(y, rstd, x, norm_w))
    nm = RowNorm{static_cast<bf16*>(y.data), rstd.ptr<float>(),
                 static_cast<const bf16*>(norm_w.data), float(eps)};
  if (!mix_site(s, ctx, x, weights, history, layout, site, heads, nm, g_mix_norm_version == 4))
    rmsnorm_forward(s, y, rstd, x, norm_w, eps);
}

// mix_tile_kernel's shared weight tables: one per warp, `slots` x count x H floats.
size_t tile_table_bytes(int slots, int count, int heads) {
  return size_t(kWarpsPerBlock) * size_t(slots) * size_t(count) * size_t(heads) * sizeof(float);
}
constexpr size_t kTileTableMaxBytes = 96 * 1024;  // leaves room for 2 blocks per SM

int routing_tile_sites(const RoutingLayout& layout, int64_t d, int heads) {
  // Full routing only: in block layouts a tile's later sites read few closed slots and
  // their own partial block sum, so the fp32 partial rows would cost about what they save
  // (cuda/NOTES.md). The kernels need every 16-byte chunk inside one head and the heads'
  // lanes to tile the warp.
  const bool shape = heads >= 1 && heads <= 32 && 32 % heads == 0 && d % heads == 0 &&
                     (d / heads) % 8 == 0 && d <= 256 * kMaxNT;
  if (layout.block != 1 || !shape ||
      tile_table_bytes(layout.sites, kTileSites, heads) > kTileTableMaxBytes)
    return 1;
  return kTileSites;
}

// The traffic model of the mixes with their consumers' norms, in rows of N d bf16 (an fp32
// partial row is 2), as the routed scheme calls them (routing_mix_tile_rmsnorm at a
// tile's first site, routing_mix_rmsnorm at the others):
// - a site on its own (count 1): its j0 + 1 slots read, x written; the norm's own launch
//   reads x back and writes y;
// - a tile of count >= 2 from site j0: the tile kernel reads the j0 + 1 slots and writes x,
//   y and count - 1 fp32 partial rows; each later site j0 + m's finish reads its partial
//   and the m newer slots and writes x and y (the norm inside both kernels).
// The weights' and statistics' bytes (4 H per pair and token against 2 d per row: 1-3%)
// are left out.
int64_t routing_tile_rows(int j0, int count) {
  if (count <= 1) return (j0 + 1) + 1 + 2;
  int64_t rows = (j0 + 1) + 1 + 2 * (count - 1) + 1;
  for (int m = 1; m < count; ++m) rows += 2 + m + 1 + 1;
  return rows;
}
int64_t routing_plan_rows(const std::vector<int>& plan) {
  int64_t rows = 0;
  int j0 = 0;
  for (int count : plan) rows += routing_tile_rows(j0, count), j0 += count;
  return rows;
}

// RoutingKernel::TilePlan (kernel lab). 2: the tiles with the fewest rows moved, of at
// most routing_tile_sites() sites each: a shortest path over the sites (best[j]: the fewest
// rows for sites j .. S - 1). Tiles pay where their sites read many slots, so the plan runs
// from sites mixed on their own at the start to the largest tiles at the end; on ties the
// smaller tile (fewer partial rows in memory). 3: the same with tiles of at most 7, because
// the 8-site tile kernel moves its bytes 6-11% slower than the 7-site one (H100, 2026-12-07:
// the plan's 8s made 350M and 1B 2% and 5% slower than fixed 7s for 4.6% and 7% fewer
// rows; cuda/NOTES.md "Tiles that grow with the depth"). 1: tiles of the one fixed count
// with the fewest rows, from site 0 (the rule before the fifty-seventh session).
std::vector<int> routing_tile_plan(const RoutingLayout& layout, int64_t d, int heads) {
  const int S = layout.sites, kmax = routing_tile_sites(layout, d, heads);
  if (kmax <= 1) return std::vector<int>(size_t(std::max(S, 0)), 1);
  if (g_tile_plan_version == 1) {
    std::vector<int> best = layout.uniform_tiles(1);
    for (int k = 2; k <= kmax; ++k)
      if (std::vector<int> tiles = layout.uniform_tiles(k);
          routing_plan_rows(tiles) < routing_plan_rows(best))
        best = std::move(tiles);
    return best;
  }
  const int cap = g_tile_plan_version == 3 ? std::min(kmax, kTileSites - 1) : kmax;
  std::vector<int64_t> best(size_t(S) + 1, 0);
  std::vector<int> first(size_t(S) + 1, 1);
  for (int j = S - 1; j >= 0; --j) {
    best[size_t(j)] = -1;
    for (int count = 1; count <= std::min(cap, S - j); ++count) {
      const int64_t rows = routing_tile_rows(j, count) + best[size_t(j + count)];
      if (best[size_t(j)] < 0 || rows < best[size_t(j)])
        best[size_t(j)] = rows, first[size_t(j)] = count;
    }
  }
  std::vector<int> plan;
  for (int j = 0; j < S; j += first[size_t(j)]) plan.push_back(first[size_t(j)]);
  return plan;
}

// routing_mix_tile, and with `nm` the norm of site j0's x inside the tile kernel (version
// 5) where it can: true when y and rstd are written.
static bool mix_tile_site(cudaStream_t s, RoutingContext& ctx, Tensor x, Tensor weights,
                          Tensor history, const RoutingLayout& layout, int site, int count,
                          int heads, const RowNorm& nm) {
  const char* what = "routing_mix_tile";
  ctx.tile = MixTile{};
  MHAR_CHECK(count >= 1 && site >= 0 && site + count <= layout.sites, what, ": sites ", site, " + ",
             count, " of ", layout.sites);
  MHAR_CHECK(history.ndim == 3 && history.dim(0) == layout.sources, what, ": history must be [",
             layout.sources, ", N, d], got ", history.shape_str());
  const int k = std::min(count, routing_tile_sites(layout, history.dim(2), heads));
  if (k <= 1 || history.dim(1) == 0) {
    routing_mix(s, ctx, x, weights, history, layout, site, heads);
    return false;
  }
  const bool norm = nm.y != nullptr && g_mix_tile_version == 5;
  const Geometry g = geometry(what, history.dim(1), history.dim(2), heads, layout);
  check_weights(what, weights, g);
  check_dtype(history, DType::BF16, what, "history");
  check_dtype(x, DType::BF16, what, "x");
  check_numel(x, g.N * g.d, what, "x");
  const int64_t partial_floats = int64_t(k - 1) * g.N * g.d;
  const int64_t stat_floats = int64_t(k - 1) * 2 * g.H * g.N;
  auto* partial = static_cast<float*>(
      ctx.scratch(ScratchSlot::RoutingTile, size_t(partial_floats + stat_floats) * sizeof(float)));
  if (g_mix_tile_version >= 2) {
    // Version 2: exactly k accumulators, the table padded to 4 ceil(k/4) sites. Version 3:
    // the same kernel on a grid of the blocks that fit at once (one wave: 8 blocks per SM
    // over the 3 that the late tiles' tables leave room for would end on a two-thirds
    // full wave). Version 4: version 3 at 3 blocks per SM with a ring of 12. Version 5:
    // version 2 with phase (1) shared by the block's warps (COOP).
    const size_t smem = tile_table_bytes(site + 1, (k + 3) / 4 * 4, g.H);
    auto launch = [&](auto kernel) {
      allow_smem(kernel, smem);
      int blocks = token_blocks(g.N);
      if (g_mix_tile_version == 3 || g_mix_tile_version == 4) {
        int per_sm = 0;
        CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel,
                                                                 32 * kWarpsPerBlock, smem));
        blocks = std::min(blocks, sm_count() * std::max(per_sm, 1));
      }
      kernel<<<blocks, 32 * kWarpsPerBlock, smem, s>>>(
          static_cast<bf16*>(x.data), weights.ptr<float>(), static_cast<const bf16*>(history.data),
          partial, partial + partial_floats, g, site, nm);
      CUDA_CHECK_LAUNCH();
    };
    auto ring = [&](auto k_tag) {
      constexpr int K = decltype(k_tag)::value;
      if (g_mix_tile_version == 5 && norm)
        launch(mix_tile_ring_kernel<K, tile_ring(K), 4, true, true>);
      else if (g_mix_tile_version == 5)
        launch(mix_tile_ring_kernel<K, tile_ring(K), 4, true>);
      else if (g_mix_tile_version == 4)
        launch(mix_tile_ring_kernel<K, kTileRingDeep, 3>);
      else
        launch(mix_tile_ring_kernel<K, tile_ring(K), 4>);
    };
    dispatch_int<2, kTileSites>(std::min(k, kTileSites), ring);  // k >= 2 here
  } else {
    // Version 1: accumulators for 4 sites where that is enough (fewer registers, no idle
    // predicates), else 8.
    const size_t smem = tile_table_bytes(site + 1, k, g.H);
    auto launch = [&](auto kernel) {
      allow_smem(kernel, smem);
      kernel<<<token_blocks(g.N), 32 * kWarpsPerBlock, smem, s>>>(
          static_cast<bf16*>(x.data), weights.ptr<float>(), static_cast<const bf16*>(history.data),
          partial, partial + partial_floats, g, site, k);
      CUDA_CHECK_LAUNCH();
    };
    if (k <= 4)
      launch(mix_tile_kernel<4>);
    else
      launch(mix_tile_kernel<kTileSites>);
  }
  ctx.tile = MixTile{weights.data, history.data, layout, heads, site, k, site + 1};
  return norm;
}

void routing_mix_tile(cudaStream_t s, RoutingContext& ctx, Tensor x, Tensor weights, Tensor history,
                      const RoutingLayout& layout, int site, int count, int heads) {
  mix_tile_site(s, ctx, x, weights, history, layout, site, count, heads, RowNorm{});
}

// routing_mix_tile_rmsnorm: the norm inside tile kernel version 5 at MixNorm versions 2 and
// 4 where rmsnorm_forward_row_fusable, else the tile then rmsnorm_forward. The same bits.
void routing_mix_tile_rmsnorm(cudaStream_t s, RoutingContext& ctx, Tensor x, Tensor y, Tensor rstd,
                              Tensor weights, Tensor history, const RoutingLayout& layout, int site,
                              int count, int heads, Tensor norm_w, double eps) {
  RowNorm nm;
  if ((g_mix_norm_version == 2 || g_mix_norm_version == 4) &&
      rmsnorm_forward_row_fusable(y, rstd, x, norm_w))
    nm = RowNorm{static_cast<bf16*>(y.data), rstd.ptr<float>(),
                 static_cast<const bf16*>(norm_w.data), float(eps)};
  if (!mix_tile_site(s, ctx, x, weights, history, layout, site, count, heads, nm))
    rmsnorm_forward(s, y, rstd, x, norm_w, eps);
}

}  // namespace mhar::cuda
