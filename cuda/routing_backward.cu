// routing_backward.cu: routing_source_backward, routing_source_backward_tile and
// routing_delta_site_backward (backend.h): one slot's gradient from the input gradients of
// every later site (source-stationary), its value path and softmax backward in token
// kernels, its key path fused or by GEMM (its key gradients: routing_key_grads.cu; a
// backward depth tile's two slots in one pass over their sites: routing_backward_tile.cu);
// the kernel lab's versions of each. Conventions: cuda/routing.cu.
#include <algorithm>

#include "cuda/routing_backward_rows.cuh"
#include "cuda/routing_pair_mma.h"  // pair_mma_applies (routing_backward_sum_order)

namespace mhar::cuda {
namespace routing_detail {
namespace {

// ---------------------------------------------------------------- source backward
// Slot i's gradient (backend.h) in three parts:
//   value kernel (one warp per token, streams the input gradients dx_k of the sites
//     k = i .. last that read the slot, one row each): ubar_i, u_k = dx_k . v per head,
//     ds_k = a_k (u_k - ubar_k) (written back as ds_k * r into the pair, for the key
//     gradients), and the value path val = sum_k a_k dx_k, kept in fp32 (scratch [N, d]);
//   key GEMM (cuBLAS, fp32, batched over heads):
//     key[n, c] = sum_k (ds_k r)[head(c), n] qg_k[c]   (qg token-independent, as in the
//     logits), so the per-token loop carries no q, g or key-path arithmetic;
//   finish kernel: dv = val + key - v r^2/d (v . key)  (the last term is the gradient
//     through inv_rms: r^3/d sum_k sum_c ds_k qg_k v = r^2/d v . key).
template <int NT>
__device__ __forceinline__ void store_row_f32(float* row, const float (&f)[NT][8], int nchunks) {
  const int lane = threadIdx.x & 31;
  float4* p = reinterpret_cast<float4*>(row);
#pragma unroll
  for (int t = 0; t < NT; ++t) {
    const int ch = lane + 32 * t;
    if (ch < nchunks) {
      store8_f32(p + 2 * ch, f[t]);
    }
  }
}

template <int NT>
__device__ __forceinline__ void load_row_f32(float (&f)[NT][8], const float* row, int nchunks) {
  const int lane = threadIdx.x & 31;
  const float4* p = reinterpret_cast<const float4*>(row);
#pragma unroll
  for (int t = 0; t < NT; ++t) {
    const int ch = lane + 32 * t;
    const float4 lo = ch < nchunks ? p[2 * ch] : make_float4(0.f, 0.f, 0.f, 0.f);
    const float4 hi = ch < nchunks ? p[2 * ch + 1] : make_float4(0.f, 0.f, 0.f, 0.f);
    f[t][0] = lo.x, f[t][1] = lo.y, f[t][2] = lo.z, f[t][3] = lo.w;
    f[t][4] = hi.x, f[t][5] = hi.y, f[t][6] = hi.z, f[t][7] = hi.w;
  }
}

template <int NT, bool ALIGNED>
__global__ void __launch_bounds__(32 * kWarpsPerBlock)
    source_value_kernel(float* __restrict__ val, float* __restrict__ weights,
                        float* __restrict__ ubar, const SiteRows site_dx,
                        const bf16* __restrict__ x, const bf16* __restrict__ v,
                        const float* __restrict__ inv_rms, const Geometry g, int source) {
  const LaneHeads<NT> L = lane_heads<NT>(g);
  const int64_t warps = int64_t(gridDim.x) * (blockDim.x >> 5);
  float* w_src = weights + g.lay.pair_base(source) * g.H * g.N;
  const int last = g.lay.last_site(source);
  for (int64_t n = int64_t(blockIdx.x) * (blockDim.x >> 5) + (threadIdx.x >> 5); n < g.N;
       n += warps) {
    const float r = inv_rms[n];
    constexpr int W = kHeadVals<ALIGNED>;
    Row<NT> rv, rdx, nxt;
    load_row(rv, v + n * g.d, g.nchunks);
    load_row(rdx, site_dx.dx[source] + n * g.d, g.nchunks);
    float ub[NT][W], a[NT][W];  // the current site's ubar and weight per head
    {                           // ubar of site `source`, from its input and input gradient
      Row<NT> rx;
      load_row(rx, x + n * g.d, g.nchunks);
      float prod[NT][8];
#pragma unroll
      for (int t = 0; t < NT; ++t)
#pragma unroll
        for (int e = 0; e < 8; ++e) prod[t][e] = elem(rdx.raw[t], e) * elem(rx.raw[t], e);
      head_totals<NT, ALIGNED>(prod, ub, g, L);
      float* u = ubar + int64_t(source) * g.H * g.N + n;
      for_head_leaders<NT, ALIGNED>(
          g, L, [&](int t, int e, int h) { u[int64_t(h) * g.N] = hv<ALIGNED>(ub, t, e); });
    }
    load_per_head<NT, ALIGNED>(a, w_src + n, g, L);
    float acc[NT][8];
#pragma unroll
    for (int t = 0; t < NT; ++t)
#pragma unroll
      for (int e = 0; e < 8; ++e) acc[t][e] = 0.f;
    for (int k = source; k <= last; ++k) {
      float* w = w_src + int64_t(k - source) * g.H * g.N + n;
      float a_nxt[NT][W], ub_nxt[NT][W];
      // Prefetch the next site's input gradient (and, ALIGNED, its weight and ubar: the
      // per-feature copies of the unaligned path would not fit in registers).
      if (k + 1 <= last) {
        load_row(nxt, site_dx.dx[k + 1] + n * g.d, g.nchunks);
        if constexpr (ALIGNED) {
          load_per_head<NT, ALIGNED>(a_nxt, w + int64_t(g.H) * g.N, g, L);
          load_per_head<NT, ALIGNED>(ub_nxt, ubar + int64_t(k + 1) * g.H * g.N + n, g, L);
        }
      }
      float prod[NT][8], u[NT][W], ds[NT][W];
#pragma unroll
      for (int t = 0; t < NT; ++t)
#pragma unroll
        for (int e = 0; e < 8; ++e) {
          const float dxe = elem(rdx.raw[t], e);
          prod[t][e] = dxe * elem(rv.raw[t], e);
          acc[t][e] += hv<ALIGNED>(a, t, e) * dxe;
        }
      head_totals<NT, ALIGNED>(prod, u, g, L);
#pragma unroll
      for (int t = 0; t < NT; ++t)
#pragma unroll
        for (int e = 0; e < W; ++e) ds[t][e] = a[t][e] * (u[t][e] - ub[t][e]);
      __syncwarp();  // every lane has read a_k before the leaders overwrite it
      for_head_leaders<NT, ALIGNED>(
          g, L, [&](int t, int e, int h) { w[int64_t(h) * g.N] = hv<ALIGNED>(ds, t, e) * r; });
      if (k + 1 <= last) {
        rdx = nxt;
        if constexpr (ALIGNED) {
#pragma unroll
          for (int t = 0; t < NT; ++t) a[t][0] = a_nxt[t][0], ub[t][0] = ub_nxt[t][0];
        } else {
          load_per_head<NT, ALIGNED>(a, w + int64_t(g.H) * g.N, g, L);
          load_per_head<NT, ALIGNED>(ub, ubar + int64_t(k + 1) * g.H * g.N + n, g, L);
        }
      }
    }
    store_row_f32(val + n * g.d, acc, g.nchunks);
  }
}

template <int NT>
__global__ void __launch_bounds__(32 * kWarpsPerBlock)
    source_finish_kernel(bf16* __restrict__ dv, const float* __restrict__ val,
                         const float* __restrict__ key, const bf16* __restrict__ v,
                         const float* __restrict__ inv_rms, const Geometry g) {
  const int64_t warps = int64_t(gridDim.x) * (blockDim.x >> 5);
  for (int64_t n = int64_t(blockIdx.x) * (blockDim.x >> 5) + (threadIdx.x >> 5); n < g.N;
       n += warps) {
    Row<NT> rv;
    load_row(rv, v + n * g.d, g.nchunks);
    float kf[NT][8], out[NT][8];
    load_row_f32(kf, key + n * g.d, g.nchunks);
    load_row_f32(out, val + n * g.d, g.nchunks);
    float dot = 0.f;
#pragma unroll
    for (int t = 0; t < NT; ++t)
#pragma unroll
      for (int e = 0; e < 8; ++e) dot += elem(rv.raw[t], e) * kf[t][e];
    const float r = inv_rms[n];
    const float coef = r * r / float(g.d) * warp_sum(dot);
#pragma unroll
    for (int t = 0; t < NT; ++t)
#pragma unroll
      for (int e = 0; e < 8; ++e) out[t][e] += kf[t][e] - coef * elem(rv.raw[t], e);
    store_row(dv + n * g.d, out, g.nchunks);
  }
}

// The backward's value kernel (see source_value_kernel above), span layout. FUSED (for
// slots read by few sites, e.g. block routing's partial sums): the key path is done here
// too, from the fp32 q*g table `qg` [ns, d] (L1/L2-resident), and dv written directly,
// instead of the fp32 value row + key GEMM + finish kernel, whose ~9 extra row-sized
// reads and writes would outweigh a slot's few site rows.
// Sites source..last are read; inside a backward depth tile (source_value_pair_span_kernel
// below) `last` stops before the tile's first slot and the value row starts from the
// tile's partial `resume` (their share), else from zero (resume null, last = last_site).
// DELTA (FUSED, a slot read by its own site only: Backend::delta_site_backward): the
// delta scheme's steps around the slot's backward run here on the rows already in
// registers, each with the operations and roundings of its op (cuda/delta.cu), so the
// same bits: before, dresid += dx and dr = alpha dx (dr is the site's gradient the slot
// reads); after, slot = dv (+ next) and out = dresid + slot. dalpha's sum of dx r goes
// by lane, warp and block into dl.partial[blockIdx.x] (summed by delta_add_partials).
struct DeltaRows {
  bf16* dresid;
  bf16* dr;
  bf16* out;
  const bf16* dx;
  const bf16* next;  // may be null
  const bf16* alpha;
  float* partial;
};

// DELTA's steps before the slot's backward, token n, on the rows rg (dx), dres (dresid)
// and rx (x) this lane holds: dresid + dx and dr = alpha dx stored (rdx = dr and dres =
// dresid + dx as stored), this lane's share of dalpha's sum dx . x, and the site's ubar
// (returned).
template <int NT>
__device__ __forceinline__ float delta_site_prologue(Row<NT>& rdx, Row<NT>& dres, float& dalpha,
                                                     const Row<NT>& rg, const Row<NT>& rx,
                                                     const DeltaRows& dl, float* ubar,
                                                     const Geometry& g, int source, int64_t n) {
  const float al = load(dl.alpha[0]);
  float sum[NT][8], scaled[NT][8];
#pragma unroll
  for (int t = 0; t < NT; ++t)
#pragma unroll
    for (int e = 0; e < 8; ++e) {
      const float gx = elem(rg.raw[t], e);
      sum[t][e] = __fadd_rn(elem(dres.raw[t], e), gx);
      scaled[t][e] = __fmul_rn(al, gx);
      dalpha = __fmaf_rn(gx, elem(rx.raw[t], e), dalpha);
    }
  store_span(dl.dresid + n * g.d, sum);
  store_span(dl.dr + n * g.d, scaled);
#pragma unroll
  for (int t = 0; t < NT; ++t) dres.raw[t] = pack8(sum[t]), rdx.raw[t] = pack8(scaled[t]);
  return span_ubar_row(ubar, rdx, rx, g, source, n);
}

// DELTA's steps after, delta_source_grad: the slot's gradient acc (as stored) + next
// (next_row(nx) gives it, where dl.next is set), stored as dv; out = dresid + slot.
template <int NT, class NextRow>
__device__ __forceinline__ void delta_site_epilogue(float (&acc)[NT][8], const Row<NT>& dres,
                                                    bf16* dv, const DeltaRows& dl,
                                                    const Geometry& g, int64_t n,
                                                    NextRow&& next_row) {
  Row<NT> nx;
  if (dl.next) next_row(nx);
#pragma unroll
  for (int t = 0; t < NT; ++t) {
    const uint4 stored_dv = pack8(acc[t]);
#pragma unroll
    for (int e = 0; e < 8; ++e) acc[t][e] = elem(stored_dv, e);
  }
  if (dl.next) {
#pragma unroll
    for (int t = 0; t < NT; ++t) {
#pragma unroll
      for (int e = 0; e < 8; ++e) acc[t][e] = __fadd_rn(acc[t][e], elem(nx.raw[t], e));
      const uint4 stored_slot = pack8(acc[t]);
#pragma unroll
      for (int e = 0; e < 8; ++e) acc[t][e] = elem(stored_slot, e);
    }
  }
  store_span(dv + n * g.d, acc);
#pragma unroll
  for (int t = 0; t < NT; ++t)
#pragma unroll
    for (int e = 0; e < 8; ++e) acc[t][e] = __fadd_rn(elem(dres.raw[t], e), acc[t][e]);
  store_span(dl.out + n * g.d, acc);
}

// Kernel-lab versions of the DELTA kernel (routing_set_kernel_version(DeltaSite, v); the
// same operations, so the same bits): 1 runs the general site loop (2 blocks per SM); 2
// fixes it at one site at compile time (the prefetch of a next site's row and its
// registers go); 3 is 2 with 3 blocks per SM where NT <= 5 (<= 168 registers). A version
// 4, 3 with its rows staged in shared memory by cp.async a few rows ahead across tokens
// (as pair version 8), lost and was removed (code at 3776da1). Measured at 1B
// (OpTiming.DISABLED_DeltaRouting1B, the 64 one-site slots, twenty-second session), ms,
// v1 / v2 / v3 / v4: H200 10.53 / 10.42 / 12.10 / 11.02; H100 12.79 / 12.72 / 14.90 /
// 13.78. Version 2 is the default: staging did not pay here as it did for the pair kernel
// (a token's work is short and its rows few, so the ring's copies and waits cost more than
// the latency they hide).
constexpr int value_span_blocks_per_sm(int NT, bool fused, int delta) {
  return !fused ? span_blocks_per_sm(NT) : delta == 3 && NT <= 5 ? 3 : 2;
}

template <int NT, bool FUSED, int DELTA = 0>  // DELTA: 0 none, else the lab's version
__global__ void __launch_bounds__(32 * kWarpsPerBlock, value_span_blocks_per_sm(NT, FUSED, DELTA))
    source_value_span_kernel(float* __restrict__ val, bf16* __restrict__ dv,
                             float* __restrict__ weights, float* __restrict__ ubar,
                             const SiteRows site_dx, const bf16* __restrict__ x,
                             const bf16* __restrict__ v, const float* __restrict__ inv_rms,
                             const float* __restrict__ qg, const float* __restrict__ resume,
                             const Geometry g, int source, int last, const DeltaRows dl = {}) {
  static_assert(!DELTA || FUSED, "the delta steps ride on the fused kernel");
  if constexpr (DELTA >= 2) last = source;  // the slot's own site only, known here
  const int lane = threadIdx.x & 31, G = 32 / g.H, h = lane / G;
  float dalpha = 0.f;  // DELTA: this lane's share of sum dx r
  const bool leader = lane % G == 0;
  const int64_t warps = int64_t(gridDim.x) * (blockDim.x >> 5);
  float* w_src = weights + (g.lay.pair_base(source) * g.H + h) * g.N;  // head h's rows
  const float* ub_h = ubar + int64_t(h) * g.N;
  for (int64_t n = int64_t(blockIdx.x) * (blockDim.x >> 5) + (threadIdx.x >> 5); n < g.N;
       n += warps) {
    const float r = inv_rms[n];
    Row<NT> rv, rdx, nxt;
    load_span(rv, v + n * g.d);
    float ub;
    Row<NT> dres;  // DELTA: dresid + dx, as stored
    if constexpr (DELTA) {
      Row<NT> rg, rx;
      load_span(rg, dl.dx + n * g.d);
      load_span(dres, dl.dresid + n * g.d);
      load_span(rx, x + n * g.d);
      ub = delta_site_prologue(rdx, dres, dalpha, rg, rx, dl, ubar, g, source, n);
    } else {
      load_span(rdx, site_dx.dx[source] + n * g.d);
      ub = span_ubar(ubar, rdx, x, g, source, n);
    }
    float a = w_src[n];
    float acc[NT][8];
    if (resume) {
      load_span_f32(acc, resume + n * g.d);
    } else {
#pragma unroll
      for (int t = 0; t < NT; ++t)
#pragma unroll
        for (int e = 0; e < 8; ++e) acc[t][e] = 0.f;
    }
    float radial = 0.f;  // FUSED: sum_k ds_k[h] (qg_k . v)[h] of this lane's head (leaders)
    for (int k = source; k <= last; ++k) {
      float* w = w_src + int64_t(k - source) * g.H * g.N + n;
      float a_nxt = 0.f, ub_nxt = 0.f;
      if (k + 1 <= last) {
        load_span(nxt, site_dx.dx[k + 1] + n * g.d);
        a_nxt = w[int64_t(g.H) * g.N];
        ub_nxt = ub_h[int64_t(k + 1) * g.H * g.N + n];
      }
      const float ds = value_site(acc, rdx, rv, a, ub, G);
      if constexpr (FUSED) {
        const float4* qrow =
            reinterpret_cast<const float4*>(qg + int64_t(k - source) * g.d) + lane * 2 * NT;
        key_site(acc, radial, rv, qrow, r, ds, G, leader);
      }
      // head_sum's shuffles synchronise the warp: every lane has read a_k (one iteration
      // earlier) before the leader overwrites it; with G = 1 the lane is its own leader.
      if (leader) *w = ds * r;
      if (k + 1 <= last) rdx = nxt, a = a_nxt, ub = ub_nxt;
    }
    if constexpr (FUSED) {
      subtract_radial(acc, rv, r, warp_sum(radial), g.d);
      if constexpr (DELTA) {
        delta_site_epilogue(acc, dres, dv, dl, g, n,
                            [&](Row<NT>& nx) { load_span(nx, dl.next + n * g.d); });
      } else {
        store_span(dv + n * g.d, acc);
      }
    } else {
      store_span_f32(val + n * g.d, acc);
    }
  }
  if constexpr (DELTA) {
    const float block = block_sum(dalpha);
    if (threadIdx.x == 0) dl.partial[blockIdx.x] = block;
  }
}

// Kernel-lab versions of the unfused value kernel (routing_set_kernel_version(SourceValue,
// v)):
// 1 source_value_span_kernel<NT, false>: the next site's row, weight and ubar loaded one
//   site ahead;
// 2 source_value_ring_span_kernel where d <= 768 (NT <= 3): value_ring(NT) sites ahead,
//   from a ring of rows in registers. ncu of version 1 at 100M (slot 12 of 25, d 512,
//   seventeenth session): 2.45 TB/s, 59% of the stall samples waiting for the next site's
//   row at the top of each site, whose ~70 instructions of work cannot cover a DRAM round
//   trip; 16 warps an SM with 1 KB rows keep ~16 KB an SM in flight.
// 3, 4 the ring kernel on row parts (RowPart) of at most 2 (version 3) or 1 (version 4)
//   chunks a lane, where the heads split evenly over the parts (else version 2): 350M's
//   d 1024, whose whole-row ring spills, then runs as two parts of d 512 with the ring.
// 5 every slot's key path fused into the value pass, on the ring and on row parts of at
//   most 2 chunks where the row splits so (else version 2 with the usual fused rule):
//   source_value_fused_ring_kernel, and for the backward tiles the pair kernel's fused
//   form (source_value_pair_fused_kernel, in one of two forms by the pair version: see
//   there). No fp32 value and key rows, no key GEMM and finish kernel.
// Versions 1 and 2 compute the same bits. Parts change the order of each per-head dot
// product's sum (a lane's run of chunks is shorter, the shuffle tree wider), so versions
// 3-4 give other bits of the logit gradients, ubar and (through the key path) dv where
// they split the row; the value rows' sums keep their order. Version 5 sums the key path
// in its own order too (routing_backward_sum_order tells the parity test).
// Measured (OpTiming.DISABLED_RoutingBackwardFusedLimit, a step's backward, ms):
// - seventeenth session, v1 / v2: 100M untiled 5.05 / 4.68, with the backward tiles
//   (which leave the plain calls the fused slots and each tile's older slot) 4.54 / 4.51;
//   350M and 1B within 0.2% (their rows take version 1's kernel);
// - eighteenth session, tiled (as the step runs), v2 / v3 / v4 / v5: 100M 4.469 / 4.463 /
//   4.611 / **4.254**; 350M 22.285 / **21.908** / 22.649 / 23.504 (an earlier call: v2
//   22.277, v3 21.852); 1B 50.14-50.28 for all (its 5-chunk rows split into no parts).
//   The fused key path pays at d 512 and loses at 1024, where its pair kernel holds two
//   slots' rows, values and key paths in 150 registers with 2 sites in flight (the
//   4-ahead form, 212 registers at 2 blocks an SM: 28.6 ms). Untiled, v3 and v5 lose at
//   350M (24.74 / 25.33 / 25.39).
// 6 source_value_stream_kernel, version 2 on pair version 8's stream (rows staged in shared
//   memory, whole rows, d <= 1280; wider rows take version 2); version 2's bits. Measured
//   (twentieth session, same test, tiled, v2 / v3 / v5 / v6): 100M 4.143 / 4.145 / 4.186
//   / 4.097 (but v5's fused pair form with pair version 9 is 4.022); 350M 21.186 /
//   **20.754** / 22.937 / 20.933; 1B 46.490 / 46.487 / 46.538 / **46.016** (untiled 56.77
//   -> 55.74).
// 7 is 5 with the radial sum formed once a token from the accumulator (key_site_chunks:
//   v . acc less the value path's sum_k a_k u_k and the resumed row's share, over r) instead
//   of a qg_k . v dot product and head sum a site (ptxas at d 512: 122 registers, 126 for
//   5). Its sums run in another order (routing_backward_sum_order). (An earlier version 7,
//   5 with the lanes a head a compile-time constant, tied with 5 at 100M and lost at 350M
//   in the twenty-first session; dropped, the code is f4f3731: cuda/NOTES.md.) Measured
//   (thirty-second session, the tiled backward, pair version 16's list): 100M -1.3% alone,
//   -3.6% with pair 16; 350M +11% and 1B +1.4% (there it runs as 5 does, on parts or
//   not fused by default).
// 8, 9 are 7 and 3 with the logit gradients stored a token at a time, as pair version 17
//   does in the tiles: where the heads are 4 or 8, a site's ds r of the warp's heads is
//   gathered to its first lanes by one shuffle and stored as one run into the RoutingPairDs
//   scratch ([site][token][head]: a token's parts are consecutive warps, so the runs of its
//   parts are adjacent), and ds_by_token_to_pairs moves them to the pairs' [pair][head][token]
//   rows after the value pass; in place, each head's 4 bytes take a sector of their own (H
//   store requests a site and token beside the row's d / 16 sectors). The same bits as 7
//   and 3. Measured (fifty-fifth session, BENCHMARKS.md; a step's tiled backward, three
//   alternating rounds, H100): 9 at 350M 20.95 -> 20.82 ms (-0.6%; in the 350M step a tie,
//   163.3 against 163.45 ms over six runs each); 8 at 100M 2.93 -> 2.99 (+2%): with 4 heads
//   a site's stores are 4 requests beside the 1 KB row's 8, and the transpose after the
//   call costs more than they did.
// The default is therefore by width (version 0: source_value_version): 7 (5 before the
// thirty-second session) where a lane holds the whole row in at most 2 chunks (d <= 512),
// 9 (3 before the fifty-fifth session) at 4 chunks (d 1024), 6 at 5 (d 1280), else 2.
// Whether a value version fuses every slot's key path (and the backward tiles' pair kernel
// then takes its fused form): 5 and 7.
constexpr bool value_fuses_every_slot(int version) { return version == 5 || version == 7; }
// Whether a version's ring kernels store ds r a token at a time (heads 4 or 8): 8 and 9, which
// otherwise run the kernels of value_kernels_of(version), 7 and 3; every rule below the
// launch (fusion, row parts, sum order) is that version's.
constexpr bool value_ds_by_token(int version, int heads) {
  return (version == 8 || version == 9) && lanes_a_head_constant(heads);
}
constexpr int value_kernels_of(int version) {
  return version == 8 ? 7 : version == 9 ? 3 : version;
}
int source_value_version(int64_t d) {
  if (g_source_value_version > 0) return g_source_value_version;
  return d <= 512 ? 7 : d / 256 == 4 ? 9 : d / 256 == 5 ? 6 : 2;
}
// Sites in flight a warp (ptxas at 4 blocks an SM, <= 128 registers: no spills).
constexpr int value_ring(int NT) { return NT <= 2 ? 4 : 2; }
constexpr int kValueRingMaxNT = 3;  // NT 4 spills 200 bytes at 2 sites ahead (ptxas)

// ---------------------------------------------------------------- fused key path on the ring
// Value kernel version 5 (routing_set_kernel_version(SourceValue, 5)): every slot's key path
// inside the value pass, as the FUSED kernel does for slots read by few sites, but on the
// ring (value_ring sites in flight) and on row parts of at most 2 chunks a lane, so that it
// holds for slots read by every later site. Per site it adds to the value row r ds_k qg_k
// (the key row the unfused slots get from the key GEMM) and to the slot's radial sum
// ds_k (qg_k . v) per head; at the end dv = acc - r^3/d radial v, written in bf16. What it
// removes against the unfused slots' value kernel + key GEMM + finish kernel: the fp32 value
// and key rows, each written and read back, and the finish's reads of v: about 9 of the
// ns + 14 row-sized transfers of a slot (cuda/NOTES.md, "Depth tiling of the backward").
// The qg rows (ns d fp32, the same for every token) come from L1/L2.
// The radial sum runs over the whole row; with parts, each part's warp sum goes through
// shared memory to the token's other parts (parts_sum), in part order.
// The backward tile's pair kernel takes the same form (source_value_pair_fused_kernel): the
// tile's first slot is finished there, the older slot's share leaves the kernel as its fp32
// partial row plus its radial sum so far (after the row in the RoutingBackTile scratch),
// from which its own call resumes.
// Bits: the key path's sums run per site in the kernel's order, not cuBLAS's, and the
// radial sum in another order than the finish kernel's dot: versions 1-4's dv differ in
// their last bits (the parity tests hold it to the CPU reference's bounds).
// Measured (the version list above): 5% faster than version 2 at d 512, 5% slower at 1024.
// The plain ring kernel (version 2-4) and this one share one body, value_ring_token; the
// pair kernel's two forms share pair_ring_token.

// One token's row part (warp item wi) through a slot's value path on the ring: value_site
// per site, and with KEY the key path (key_site) and dv finished from the radial sum
// (xch: the block's exchange for parts_sum; round: this warp's token count); else the
// fp32 value row into val. Ring slot u holds site k = source + u (mod PF): its row,
// weight and ubar.
// BY_TOKEN (value versions 8-9): ds r into ds_by_token, [site - source][token][head], a
// token's heads of this part as one run (see the version list), not in place.
template <int NT, int PF, bool KEY, bool RADIAL = false, bool BY_TOKEN = false>
__device__ __forceinline__ void value_ring_token(
    float* val, bf16* dv, float* weights, float* ubar, const SiteRows& site_dx, const bf16* x,
    const bf16* v, const float* inv_rms, const float* qg, const float* resume, const Geometry& g,
    int source, int last, int parts_log2, int64_t wi, float (*xch)[kWarpsPerBlock], int round,
    float* ds_by_token) {
  const int lane = threadIdx.x & 31;
  const int64_t HN = int64_t(g.H) * g.N;
  const RowPart rp = row_part(wi, parts_log2, NT, g.H);
  const int64_t n = rp.n, row = n * g.d + rp.off;
  const bool leader = lane % rp.G == 0;
  float* w_src = weights + (g.lay.pair_base(source) * g.H + rp.h) * g.N;  // head h's rows
  const float* ub_h = ubar + int64_t(rp.h) * g.N;
  const float r = inv_rms[n];
  Row<NT> rv, ring[PF];
  float ra[PF], rub[PF];
  load_span(rv, v + row);
  load_span(ring[0], site_dx.dx[source] + row);
#pragma unroll
  for (int u = 1; u < PF; ++u)
    if (source + u <= last) {
      load_span(ring[u], site_dx.dx[source + u] + row);
      ra[u] = w_src[u * HN + n];
      rub[u] = ub_h[(source + u) * HN + n];
    }
  rub[0] = part_ubar(ubar, ring[0], x, g, rp, source);
  ra[0] = w_src[n];
  static_assert(!RADIAL || KEY, "value version 7 is version 5 with the radial sum at the end");
  float acc[NT][8];
  // KEY: this lane's head's share (leaders), from `resume` on; RADIAL: sum_k a_k u_k
  // (key_site_chunks), and the resumed row's share of v . acc, left out at the end.
  float radial = 0.f;
  [[maybe_unused]] float resumed_dot = 0.f;
  if (resume) {
    load_span_f32(acc, resume + row);
    if constexpr (RADIAL) resumed_dot = acc_dot(acc, rv);
  } else {
#pragma unroll
    for (int t = 0; t < NT; ++t)
#pragma unroll
      for (int e = 0; e < 8; ++e) acc[t][e] = 0.f;
  }
  for (int k0 = source; k0 <= last; k0 += PF) {
#pragma unroll
    for (int u = 0; u < PF; ++u) {
      const int k = k0 + u;
      if (k > last) break;
      const Row<NT> rdx = ring[u];
      const float a = ra[u], ub = rub[u];
      if (k + PF <= last) {
        load_span(ring[u], site_dx.dx[k + PF] + row);
        ra[u] = w_src[(k + PF - source) * HN + n];
        rub[u] = ub_h[(k + PF) * HN + n];
      }
      [[maybe_unused]] float u_k;
      const float ds = value_site(acc, rdx, rv, a, ub, rp.G, RADIAL ? &u_k : nullptr);
      if constexpr (KEY) {
        const float4* qrow =
            reinterpret_cast<const float4*>(qg + rp.off) + lane * 2 * NT + (k - source) * (g.d / 4);
        if constexpr (RADIAL) {
          radial += a * u_k;
          key_site<false>(acc, radial, rv, qrow, r, ds, rp.G, leader);
        } else {
          key_site(acc, radial, rv, qrow, r, ds, rp.G, leader);
        }
      }
      if constexpr (BY_TOKEN) {
        // The part's Hp heads from lanes 0, G, 2 G, ... to lanes 0 .. Hp - 1, one run.
        const int Hp = 32 / rp.G, from = (lane % Hp) * rp.G;
        const float head_ds = __shfl_sync(0xffffffffu, ds, from);
        if (lane < Hp)
          ds_by_token[((k - source) * g.N + n) * g.H + (rp.h - lane / rp.G) + lane] = head_ds * r;
      } else {
        // head_sum's shuffles synchronise the warp: every lane has used a_k (read PF
        // sites ago) before the leader overwrites it.
        if (leader) w_src[(k - source) * HN + n] = ds * r;
      }
    }
  }
  if constexpr (KEY) {
    float total;
    if constexpr (RADIAL) {
      const float own = acc_dot(acc, rv) - resumed_dot - (leader ? radial : 0.f);
      total = parts_sum(warp_sum(own), xch, parts_log2, round) / r;
    } else {
      total = parts_sum(warp_sum(radial), xch, parts_log2, round);
    }
    if (resume) total += resume[g.N * g.d + n];  // the tile's sites' radial sum
    store_fused_dv(dv + row, acc, rv, r, total, g.d);
  } else {
    store_span_f32(val + row, acc);
  }
}

template <int NT, int PF, bool BY_TOKEN = false>
__global__ void __launch_bounds__(32 * kWarpsPerBlock, span_blocks_per_sm(NT))
    source_value_ring_span_kernel(float* __restrict__ val, float* __restrict__ weights,
                                  float* __restrict__ ubar, const SiteRows site_dx,
                                  const bf16* __restrict__ x, const bf16* __restrict__ v,
                                  const float* __restrict__ inv_rms,
                                  const float* __restrict__ resume, const Geometry g, int source,
                                  int last, int parts_log2, float* __restrict__ ds_by_token) {
  const int64_t warps = int64_t(gridDim.x) * (blockDim.x >> 5);
  for (int64_t wi = int64_t(blockIdx.x) * (blockDim.x >> 5) + (threadIdx.x >> 5);
       wi < (g.N << parts_log2); wi += warps)
    value_ring_token<NT, PF, false, false, BY_TOKEN>(val, nullptr, weights, ubar, site_dx, x, v,
                                                     inv_rms, nullptr, resume, g, source, last,
                                                     parts_log2, wi, nullptr, 0, ds_by_token);
}

template <int NT, int PF, bool RADIAL = false, bool BY_TOKEN = false>
__global__ void __launch_bounds__(32 * kWarpsPerBlock, span_blocks_per_sm(NT))
    source_value_fused_ring_kernel(bf16* __restrict__ dv, float* __restrict__ weights,
                                   float* __restrict__ ubar, const SiteRows site_dx,
                                   const bf16* __restrict__ x, const bf16* __restrict__ v,
                                   const float* __restrict__ inv_rms, const float* __restrict__ qg,
                                   const float* __restrict__ resume, const Geometry g, int source,
                                   int last, int parts_log2, float* __restrict__ ds_by_token) {
  __shared__ float xch[2][kWarpsPerBlock];
  const int64_t warps = int64_t(gridDim.x) * (blockDim.x >> 5);
  int round = 0;
  for (int64_t wi = int64_t(blockIdx.x) * (blockDim.x >> 5) + (threadIdx.x >> 5);
       wi < (g.N << parts_log2); wi += warps, ++round)
    value_ring_token<NT, PF, true, RADIAL, BY_TOKEN>(nullptr, dv, weights, ubar, site_dx, x, v,
                                                     inv_rms, qg, resume, g, source, last,
                                                     parts_log2, wi, xch, round, ds_by_token);
}

// Version 6 of the unfused value kernel (routing_set_kernel_version(SourceValue, 6); the
// default at d 1280 since the twentieth session, -1% of 1B's tiled backward): the plain calls'
// value pass on pair version 8's stream, whole rows, with version 2's arithmetic
// (value_site, span_ubar_row: version 2's bits). Per token the items are the v row (with
// inv_rms), the x row, where the call resumes a tile's older slot its fp32 row so far (two
// items of NT * 32 chunks: lanes 0-15 read theirs from the first, 16-31 from the second),
// then the site rows with their weights and ubar. The tiles' resume calls read one site a
// token, so their time is each token's first loads, which the stream has in flight while
// the previous token finishes.
template <int NT, int MIN_BLOCKS>
__global__ void __launch_bounds__(32 * kWarpsPerBlock, MIN_BLOCKS)
    source_value_stream_kernel(float* __restrict__ val, float* __restrict__ weights,
                               float* __restrict__ ubar, const SiteRows site_dx,
                               const bf16* __restrict__ x, const bf16* __restrict__ v,
                               const float* __restrict__ inv_rms, const float* __restrict__ resume,
                               const Geometry g, int source, int last) {
  constexpr int R = stream_slots(NT);
  extern __shared__ float4 value_stream_smem_raw[];
  const int lane = threadIdx.x & 31, G = 32 / g.H, h = lane / G;
  const bool leader = lane % G == 0;
  SlotRing<NT, R, true> ring{reinterpret_cast<StreamSlot<NT>*>(value_stream_smem_raw) +
                             (threadIdx.x >> 5) * R};
  const int64_t warps = int64_t(gridDim.x) * (blockDim.x >> 5), HN = int64_t(g.H) * g.N;
  float* w_src = weights + g.lay.pair_base(source) * HN;
  const int lead = resume ? 4 : 2;  // items before the site rows
  const int items = lead + last - source + 1;
  const int64_t first = int64_t(blockIdx.x) * (blockDim.x >> 5) + (threadIdx.x >> 5);
  int64_t cn = first;  // the cursor: item ci of token cn is the next to copy
  int ci = 0;
  auto issue = [&](StreamSlot<NT>& slot) {
    if (cn >= g.N) return;
    if (ci < 2) {
      copy_chunks_async(slot, reinterpret_cast<const uint4*>((ci == 0 ? v : x) + cn * g.d));
      if (ci == 0 && lane == 0) cp_async_ca(&slot.scalar[0][0], inv_rms + cn, 4);
    } else if (ci < lead) {
      copy_chunks_async(slot,
                        reinterpret_cast<const uint4*>(resume + cn * g.d) + (ci - 2) * 32 * NT);
    } else {
      const int k = source + ci - lead;
      copy_chunks_async(slot, reinterpret_cast<const uint4*>(site_dx.dx[k] + cn * g.d));
      if (lane < g.H) {
        cp_async_ca(&slot.scalar[0][lane],
                    w_src + int64_t(k - source) * HN + int64_t(lane) * g.N + cn, 4);
        if (k > source)
          cp_async_ca(&slot.scalar[2][lane], ubar + (int64_t(k) * g.H + lane) * g.N + cn, 4);
      }
    }
    if (++ci == items) ci = 0, cn += warps;
  };
#pragma unroll 1
  for (int u = 0; u < R - 1; ++u) ring.refill(issue);
  for (int64_t n = first; n < g.N; n += warps) {
    Row<NT> rv, rx, rdx;
    const StreamSlot<NT>& sv = ring.take(issue);
    slot_span(sv, rv);
    const float r = sv.scalar[0][0];
    slot_span(ring.take(issue), rx);
    float acc[NT][8];
#pragma unroll
    for (int t = 0; t < NT; ++t)
#pragma unroll
      for (int e = 0; e < 8; ++e) acc[t][e] = 0.f;
    if (resume) {
      // Lane l's chunk t of the fp32 row is 16-byte units 2 (NT l + t) and + 1, in the
      // first half (item) for l < 16.
#pragma unroll 1
      for (int half = 0; half < 2; ++half) {
        const StreamSlot<NT>& sr = ring.take(issue);
        if ((lane >> 4) == half) {
          const int base = 2 * NT * (lane & 15);
#pragma unroll
          for (int t = 0; t < NT; ++t) {
            const uint4 lo = sr.row[stream_pos<NT>(base + 2 * t)];
            const uint4 hi = sr.row[stream_pos<NT>(base + 2 * t + 1)];
            acc[t][0] = __uint_as_float(lo.x), acc[t][1] = __uint_as_float(lo.y);
            acc[t][2] = __uint_as_float(lo.z), acc[t][3] = __uint_as_float(lo.w);
            acc[t][4] = __uint_as_float(hi.x), acc[t][5] = __uint_as_float(hi.y);
            acc[t][6] = __uint_as_float(hi.z), acc[t][7] = __uint_as_float(hi.w);
          }
        }
      }
    }
    slot_span(ring.take(issue), rdx);
    float ub = span_ubar_row(ubar, rdx, rx, g, source, n);
    float a = ring.taken().scalar[0][h];
    float* w_h = w_src + int64_t(h) * g.N;
#pragma unroll 1
    for (int k = source;; ++k) {
      const float ds = value_site(acc, rdx, rv, a, ub, G);
      // head_sum's shuffles synchronise the warp: every lane has used a_k.
      if (leader) w_h[(k - source) * HN + n] = ds * r;
      if (k == last) break;
      const StreamSlot<NT>& s = ring.take(issue);
      slot_span(s, rdx);
      a = s.scalar[0][h], ub = s.scalar[2][h];
    }
    store_span_f32(val + n * g.d, acc);
  }
  cp_async_wait_groups<0>();  // nothing in flight into shared memory at exit
}

// Whether a routing backward call for `source` leaves the depth tile in flight: a slot
// strictly between the tile's older and first slots (a block layout's partial slots,
// running their own backward between the two; backend.h) on the same tensors.
bool between_tile_slots(const BackTile& tile, const void* weights, const void* ubar,
                        const RoutingLayout& layout, int source) {
  return tile.first >= 0 && source > tile.older() && source < tile.first &&
         weights == tile.weights && ubar == tile.ubar && layout == tile.layout;
}

// One slot's backward (routing_source_backward), in one of three forms: plain; the first
// slot of a backward depth tile (`older` set: that slot rides along, its share of the
// sites >= source left in the RoutingBackTile scratch); or the tile's older slot
// (`resume_last` >= source: its value row starts from that share and reads only the sites
// source .. resume_last).
// `delta` (routing_delta_site_backward): the fused slot's kernel does the delta steps too.
void source_backward(cudaStream_t s, RoutingContext& ctx, Tensor dv, Tensor weights, Tensor ubar,
                     Tensor gsum, const std::vector<Tensor>& site_dx, Tensor x, Tensor v,
                     Tensor inv_rms, const RoutingParams& params, const RoutingLayout& layout,
                     int source, int heads, const TileSlot* older, int resume_last,
                     const DeltaRows* delta = nullptr, Tensor dalpha = Tensor()) {
  const char* what = "routing_source_backward";
  const Geometry g = source_geometry(what, weights, inv_rms, v, params, layout, source, heads);
  const int64_t N = g.N;
  const int S = layout.sites;
  check_dtype(ubar, DType::F32, what, "ubar");
  check_numel(ubar, int64_t(S) * heads * N, what, "ubar");
  check_dtype(gsum, DType::F32, what, "gsum");
  MHAR_CHECK(gsum.ndim == 3 && gsum.dim(1) == S && gsum.dim(2) == g.d, "CUDA ", what,
             ": gsum must be [C, ", S, ", ", g.d, "], got ", gsum.shape_str());
  for (const Tensor* t : {&dv, &x}) check_dtype(*t, DType::BF16, what, "dv/x");
  MHAR_CHECK(int(site_dx.size()) == S, "CUDA ", what, ": ", site_dx.size(),
             " sites' gradients for ", S, " sites");
  SiteRows rows{};
  for (int k = source; k <= layout.last_site(source); ++k) {
    check_dtype(site_dx[size_t(k)], DType::BF16, what, "site_dx");
    check_numel(site_dx[size_t(k)], N * g.d, what, "site_dx");
    rows.dx[k] = static_cast<const bf16*>(site_dx[size_t(k)].data);
  }
  check_numel(x, N * g.d, what, "x");
  check_numel(dv, N * g.d, what, "dv");
  const SiteParams sp = site_params(what, params, g.d);
  const int ns = layout.last_site(source) - source + 1;
  const float* qg = qg_rows_f32(s, ctx, sp, params.sites(), source, ns, g.d);
  const float* w_src = weights.ptr<float>() + g.lay.pair_base(source) * g.H * N;
  auto* dv_out = static_cast<bf16*>(dv.data);
  const auto* x_in = static_cast<const bf16*>(x.data);
  const auto* v_in = static_cast<const bf16*>(v.data);
  // Slots read by few sites take the fused span kernel (key path inside, dv written);
  // the others write the fp32 value row for the key GEMM and finish kernel below. Value
  // versions 5 and 7 fuse every slot's key path (source_value_fused_ring_kernel).
  const int value_choice = source_value_version(g.d);
  const int value_version = value_kernels_of(value_choice);
  const bool fuses_every_slot = value_fuses_every_slot(value_version);
  const int fused_parts_log2 = !delta && fuses_every_slot && span_layout(g)
                                   ? parts_log2_for(g, value_part_chunks(value_version))
                                   : -1;
  const bool ring_fused = fused_parts_log2 >= 0;
  const bool fused = ring_fused || (span_layout(g) && ns <= g_fused_key_max_sites);
  float* val = fused ? nullptr
                     : static_cast<float*>(ctx.scratch(ScratchSlot::RoutingValueGrad, N * g.d * 4));
  MHAR_CHECK(!fused || ring_fused || (!older && resume_last < 0), "CUDA ", what,
             ": a backward depth tile of fused slots (source ", source, ")");
  MHAR_CHECK(!delta || (fused && ns == 1 && resume_last < 0), "CUDA ", what,
             ": the delta steps need a fused slot read by its own site (source ", source, ")");
  if (older) {  // routing_backward_tile.cu
    BackTileLaunch t{weights, ubar, inv_rms, rows,  x_in,   v_in, older,           qg,
                     dv_out,  val,  g,       heads, source, ns,   fused_parts_log2};
    backward_tile(s, ctx, t);
  } else if (span_layout(g)) {
    const float* resume =
        resume_last >= 0 ? static_cast<const float*>(ctx.scratch(ScratchSlot::RoutingBackTile, 0))
                         : nullptr;
    const int last = resume_last >= 0 ? resume_last : layout.last_site(source);
    // Value versions 8-9: the ring kernels' ds r by token, moved into the pairs after them.
    // The scratch is taken only where a ring kernel runs, so ds_by_token set means the
    // call's ds r wait there.
    const bool by_token = value_ds_by_token(value_choice, heads);
    float* ds_by_token = nullptr;
    auto by_token_scratch = [&]() -> float* {
      if (!by_token) return nullptr;
      ds_by_token = static_cast<float*>(ctx.scratch(
          ScratchSlot::RoutingPairDs, routing_value_ds_bytes(N, last - source + 1, heads)));
      return ds_by_token;
    };
    auto value_ring_kernel = [&](auto ntp, int parts_log2) {
      constexpr int NT = decltype(ntp)::value;
      auto kernel = by_token ? source_value_ring_span_kernel<NT, value_ring(NT), true>
                             : source_value_ring_span_kernel<NT, value_ring(NT)>;
      kernel<<<token_blocks(N << parts_log2), 32 * kWarpsPerBlock, 0, s>>>(
          val, weights.ptr<float>(), ubar.ptr<float>(), rows, x_in, v_in, inv_rms.ptr<float>(),
          resume, g, source, last, parts_log2, by_token_scratch());
      CUDA_CHECK_LAUNCH();
    };
    // Versions 3-4: the ring on row parts, where the row splits.
    const int parts_log2 =
        !fused && !delta ? parts_log2_for(g, value_part_chunks(value_version)) : 0;
    if (ring_fused) {
      dispatch_part_span(g.d / 256 >> fused_parts_log2, [&](auto ntp) {
        constexpr int NT = decltype(ntp)::value;
        constexpr int PF = value_ring(NT);
        // Version 7 (by token: 8) forms its radial sums at the end, 5 a site at a time.
        auto kernel = value_version != 7 ? source_value_fused_ring_kernel<NT, PF>
                      : by_token         ? source_value_fused_ring_kernel<NT, PF, true, true>
                                         : source_value_fused_ring_kernel<NT, PF, true>;
        kernel<<<token_blocks(N << fused_parts_log2), 32 * kWarpsPerBlock, 0, s>>>(
            dv_out, weights.ptr<float>(), ubar.ptr<float>(), rows, x_in, v_in, inv_rms.ptr<float>(),
            qg, resume, g, source, last, fused_parts_log2, by_token_scratch());
        CUDA_CHECK_LAUNCH();
      });
    } else if (parts_log2 > 0) {
      dispatch_part_span(g.d / 256 >> parts_log2,
                         [&](auto ntp) { value_ring_kernel(ntp, parts_log2); });
    } else
      dispatch_span(g, [&](auto nt) {
        constexpr int NT = decltype(nt)::value;
        if constexpr (NT <= kBackTileMaxNT) {
          if (!fused && !delta && value_version == 6) {  // rows staged in shared memory
            constexpr int B = pair_blocks_per_sm(NT, 2);
            launch_stream(s, source_value_stream_kernel<NT, B>, stream_smem<NT>(), B, N, val,
                          weights.ptr<float>(), ubar.ptr<float>(), rows, x_in, v_in,
                          inv_rms.ptr<float>(), resume, g, source, last);
            return;
          }
        }
        if constexpr (NT <= kValueRingMaxNT) {
          if (!fused && !delta && value_version >= 2) {
            value_ring_kernel(nt, 0);
            return;
          }
        }
        auto kernel =
            !delta
                ? (fused ? source_value_span_kernel<NT, true> : source_value_span_kernel<NT, false>)
            : g_delta_site_version == 1 ? source_value_span_kernel<NT, true, 1>
            : g_delta_site_version == 2 ? source_value_span_kernel<NT, true, 2>
                                        : source_value_span_kernel<NT, true, 3>;
        kernel<<<token_blocks(N), 32 * kWarpsPerBlock, 0, s>>>(
            val, fused ? dv_out : nullptr, weights.ptr<float>(), ubar.ptr<float>(), rows, x_in,
            v_in, inv_rms.ptr<float>(), fused ? qg : nullptr, resume, g, source, last,
            delta ? *delta : DeltaRows{});
        CUDA_CHECK_LAUNCH();
      });
    if (ds_by_token)
      ds_by_token_to_pairs(s, weights.ptr<float>() + g.lay.pair_base(source) * g.H * N, nullptr,
                           ds_by_token, N, last - source + 1, heads, 1);
    if (delta) delta_add_partials(s, dalpha, delta->partial, token_blocks(N));
  } else {
    MHAR_CHECK(resume_last < 0, "CUDA ", what, ": a backward depth tile outside the span layout");
    dispatch_rows(g, [&](auto nt, auto al) {
      auto kernel = source_value_kernel<decltype(nt)::value, decltype(al)::value>;
      kernel<<<token_blocks(N), 32 * kWarpsPerBlock, 0, s>>>(val, weights.ptr<float>(),
                                                             ubar.ptr<float>(), rows, x_in, v_in,
                                                             inv_rms.ptr<float>(), g, source);
      CUDA_CHECK_LAUNCH();
    });
  }
  // The unfused slots' key path and finish: one kernel (SourceFinish versions 2-4,
  // routing_finish_key.cu), or the key GEMM into an fp32 row and the finish kernel.
  if (!fused && !source_finish_key(s, dv_out, val, w_src, qg, v_in, inv_rms.ptr<float>(), g, ns,
                                   g_source_finish_version)) {
    auto* key = static_cast<float*>(ctx.scratch(ScratchSlot::RoutingKeyGrad, N * g.d * 4));
    // The key path: key = (ds r) qg per head, from the pairs the value kernel just wrote.
    head_gemm(s, ctx.blas, CUBLAS_OP_N, CUBLAS_OP_T, g.dh, N, ns, qg, CUDA_R_32F, g.d, g.dh, w_src,
              CUDA_R_32F, int64_t(g.H) * N, N, 0.f, key, g.d, g.dh, g.H);
    dispatch_rows(g, [&](auto nt, auto) {
      source_finish_kernel<decltype(nt)::value><<<token_blocks(N), 32 * kWarpsPerBlock, 0, s>>>(
          dv_out, val, key, v_in, inv_rms.ptr<float>(), g);
      CUDA_CHECK_LAUNCH();
    });
  }
  // The key gradients: gsum[.][k] += G_k for the slot's sites k (routing_key_grads.cu).
  slot_key_grads(s, ctx, gsum, w_src, v_in, g, source, ns);
}

}  // namespace
}  // namespace routing_detail

using namespace routing_detail;

int routing_backward_sum_order(int64_t d, int heads) {
  // The key gradients' sums: version 2's kernel past 8 sites, versions 3-4's tensor cores
  // at every slot (where their shapes do not allow them, the fallback's: the default and an
  // explicit version 3 or 4 still run the same code).
  const int key_grads = g_key_grad_version >= 3 ? 1024 : g_key_grad_version == 2 ? 512 : 0;
  // The unfused slots' key path in one kernel (SourceFinish 2-4) sums each key in its order.
  const int finish_key = source_finish_key_fits(d, heads, g_source_finish_version) ? 16384 : 0;
  if (!span_layout(d, heads) || d > 256 * kMaxNT) return key_grads + finish_key;
  Geometry g{};
  g.d = int(d);
  g.H = heads;
  auto lane_chunks = [&](int parts_log2) { return g.d / 256 >> std::max(parts_log2, 0); };
  const int value = value_kernels_of(source_value_version(d));
  const int value_parts = parts_log2_for(g, value_part_chunks(value));
  if (value_fuses_every_slot(value) && value_parts >= 0) {  // every slot fused, the pair's form too
    // The radial sums at the end (key_site_chunks): value version 7's plain calls, pair
    // version 16's stream kernel (whole rows).
    return key_grads + 256 + lane_chunks(value_parts) + (value == 7 ? 4096 : 0) +
           (pair_sums_radial_at_end(g_pair_version, value_parts, heads) ? 8192 : 0);
  }
  const int pair_mma_order =
      pair_on_tensor_cores(g_pair_version) && pair_mma_applies(g.d, heads) ? 2048 : 0;
  return key_grads + pair_mma_order + finish_key +
         16 * lane_chunks(parts_log2_for(g, pair_part_chunks(g_pair_version))) +
         lane_chunks(value_parts);
}

void routing_source_backward(cudaStream_t s, RoutingContext& ctx, Tensor dv, Tensor weights,
                             Tensor ubar, Tensor gsum, const std::vector<Tensor>& site_dx, Tensor x,
                             Tensor v, Tensor inv_rms, const RoutingParams& params,
                             const RoutingLayout& layout, int source, int heads) {
  // The older slot of the backward depth tile in flight: its share of the tile's sites is
  // in the scratch. A slot between the two leaves the tile in flight; any other call
  // ends it.
  const BackTile tile = ctx.back_tile;
  ctx.back_tile = BackTile{};
  const bool resume = tile.first >= 0 && source == tile.older() && weights.data == tile.weights &&
                      ubar.data == tile.ubar && v.data == tile.older_v && layout == tile.layout &&
                      heads == tile.heads && size_t(tile.first) < site_dx.size() &&
                      site_dx[size_t(tile.first)].data == tile.first_dx;
  // The tile's first call overwrote the older slot's pairs with the tile's sites by ds r:
  // that slot computed afresh would read them as softmax weights. A call for it that is
  // not the tile's continuation breaks backend.h's promise; say so rather than compute a
  // wrong gradient. (A tile left over from an aborted pass never gets here: the next
  // pass's first call, a later slot, ends it.)
  MHAR_CHECK(resume || tile.first < 0 || source != tile.older(),
             "CUDA routing_source_backward: "
             "slot ",
             source, " is the older slot of the backward depth tile started at slot ", tile.first,
             " but came with other tensors (weights, ubar, its history row or the "
             "site gradients); routing_source_backward_tile's promise (backend.h) is broken");
  if (between_tile_slots(tile, weights.data, ubar.data, layout, source)) ctx.back_tile = tile;
  source_backward(s, ctx, dv, weights, ubar, gsum, site_dx, x, v, inv_rms, params, layout, source,
                  heads, nullptr, resume ? tile.first - 1 : -1);
}

bool routing_delta_site_backward_fuses(const DeltaSiteBackward& a) {
  const int64_t n = a.dx.numel();
  if (a.inv_rms.numel() <= 0 || a.heads < 1 || n % a.inv_rms.numel() != 0) return false;
  const int64_t N = a.inv_rms.numel(), d = n / N;
  // (g_fused_key_max_sites: the kernel lab may turn fusion off)
  bool ok = span_layout(d, a.heads) && d <= 256 * kMaxNT && g_fused_key_max_sites >= 1 &&
            a.layout.last_site(a.site) == a.site && a.alpha.dtype == DType::BF16 &&
            a.alpha.numel() == 1 && a.dalpha.dtype == DType::F32 && a.dalpha.numel() == 1 &&
            a.scratch.dtype == DType::F32 && a.scratch.numel() >= token_blocks(N);
  for (const Tensor* t : {&a.dresid, &a.dr, &a.dx, &a.r, &a.slot, &a.v, &a.out, &a.next}) {
    if (t == &a.next && t->empty()) continue;
    ok = ok && t->dtype == DType::BF16 && t->numel() == n && aligned16(t->data);
  }
  return ok;
}

bool routing_delta_site_backward(cudaStream_t s, RoutingContext& ctx, const DeltaSiteBackward& a) {
  const char* what = "delta_site_backward";
  const int j = a.site;
  const RoutingLayout& lay = a.layout;
  MHAR_CHECK(a.site_dx && a.params, "CUDA ", what, ": site_dx and params must be given");
  MHAR_CHECK(j >= 1 && j < lay.sources && lay.last_site(j) == j, "CUDA ", what, ": site ", j,
             " must be >= 1 and read only its own slot (layout of ", lay.sources,
             " sources, block ", lay.block, ")");
  MHAR_CHECK(size_t(j) < a.site_dx->size() && (*a.site_dx)[size_t(j)].data == a.dr.data, "CUDA ",
             what, ": site_dx[", j, "] must be dr");
  if (!routing_delta_site_backward_fuses(a)) return false;
  // A partial slot between a depth tile's two closed slots leaves the tile in flight.
  if (!between_tile_slots(ctx.back_tile, a.weights.data, a.ubar.data, lay, j))
    ctx.back_tile = BackTile{};
  const DeltaRows rows{static_cast<bf16*>(a.dresid.data),
                       static_cast<bf16*>(a.dr.data),
                       static_cast<bf16*>(a.out.data),
                       static_cast<const bf16*>(a.dx.data),
                       a.next.empty() ? nullptr : static_cast<const bf16*>(a.next.data),
                       static_cast<const bf16*>(a.alpha.data),
                       a.scratch.ptr<float>()};
  source_backward(s, ctx, a.slot, a.weights, a.ubar, a.gsum, *a.site_dx, a.r, a.v, a.inv_rms,
                  *a.params, lay, j, a.heads, nullptr, -1, &rows, a.dalpha);
  return true;
}

size_t routing_pair_ds_bytes(int64_t N, int sites, int heads) {
  return 2 * routing_value_ds_bytes(N, sites, heads);
}
size_t routing_value_ds_bytes(int64_t N, int sites, int heads) {
  return lanes_a_head_constant(heads) ? size_t(N) * size_t(sites) * size_t(heads) * sizeof(float)
                                      : 0;
}

int routing_backward_tile_slots(const RoutingLayout& layout, int64_t d, int heads) {
  // The pair kernel: span layout, both slots' rows and value rows in registers (d <= 1280;
  // wider rows would spill). Full routing pairs every slot with the one before it, block
  // layouts their closed slots (RoutingLayout::back_tile_count).
  (void)layout;
  const bool span = heads >= 1 && 32 % heads == 0 && d % 256 == 0 && d / 256 <= kBackTileMaxNT;
  return span ? 2 : 1;
}

void routing_source_backward_tile(cudaStream_t s, RoutingContext& ctx, Tensor dv, Tensor weights,
                                  Tensor ubar, Tensor gsum, const std::vector<Tensor>& site_dx,
                                  Tensor x, Tensor history, Tensor inv_rms,
                                  const RoutingParams& params, const RoutingLayout& layout,
                                  int source, int count, int heads) {
  const char* what = "routing_source_backward_tile";
  ctx.back_tile = BackTile{};
  MHAR_CHECK(history.ndim == 3 && history.dim(0) == layout.sources, what, ": history must be [",
             layout.sources, ", N, d], got ", history.shape_str());
  MHAR_CHECK(inv_rms.ndim == 2 && inv_rms.dim(0) == layout.sources, what, ": inv_rms must be [",
             layout.sources, ", N], got ", inv_rms.shape_str());
  MHAR_CHECK(source >= 0 && source < layout.sources && count >= 1 && count <= source + 1, what,
             ": source ", source, ", count ", count, " of ", layout.sources, " sources");
  MHAR_CHECK(count == 1 || (layout.closes_block(source) && source >= (count - 1) * layout.block),
             what, ": a backward tile of ", count, " slots cannot start at slot ", source,
             " (block ", layout.block,
             ": its slots are source, source - block, ..., closed "
             "slots; RoutingLayout::back_tile_count)");
  const int ns = layout.last_site(source) - source + 1, older_slot = source - layout.block;
  // Tiles pair unfused slots only (the fused ones read few sites and have no value row).
  const bool tile =
      std::min(count, routing_backward_tile_slots(layout, history.dim(2), heads)) >= 2 &&
      ns > g_fused_key_max_sites && history.dim(1) > 0;
  if (!tile) {
    source_backward(s, ctx, dv, weights, ubar, gsum, site_dx, x, history[source], inv_rms[source],
                    params, layout, source, heads, nullptr, -1);
    return;
  }
  const TileSlot older{static_cast<const bf16*>(history[older_slot].data),
                       static_cast<const float*>(inv_rms[older_slot].data)};
  source_backward(s, ctx, dv, weights, ubar, gsum, site_dx, x, history[source], inv_rms[source],
                  params, layout, source, heads, &older, -1);
  ctx.back_tile = BackTile{
      weights.data, ubar.data, history[older_slot].data, site_dx[size_t(source)].data, layout,
      heads,        source};
}

}  // namespace mhar::cuda
