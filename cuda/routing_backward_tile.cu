// routing_backward_tile.cu: the backward depth tile (backend.h routing_source_backward_tile;
// DESIGN.md section 3): a tile's two slots in one pass over the site gradients both read,
// on CUDA cores (the pair kernels: registers, a ring, rows staged in shared memory, the
// fused key path) or on tensor cores (routing_pair_mma.cu), by the pair version in force;
// backward_tile launches it for routing_backward.cu's source_backward. Conventions:
// cuda/routing.cu.
#include "cuda/routing_backward_rows.cuh"
#include "cuda/routing_pair_mma.h"

namespace mhar::cuda {
namespace routing_detail {
namespace {

// One site k of both slots of a backward tile, token n: value_site for each slot from the
// one dx_k row, each accumulator's operations in value_site's order (written out, not two
// value_site calls, so that each dx_k element is unpacked once: the pair kernels are
// register-bound).
// Its lane-local part: the value paths and this lane's shares p0, p1 of the head dot
// products, which pair_site then sums over the head's lanes (pair version 17 sums a site's
// one site later, so that the shuffles overlap the next site's FMAs).
template <int NT, class RV>
__device__ __forceinline__ void pair_site_dots(float (&acc0)[NT][8], float (&acc1)[NT][8],
                                               float& p0, float& p1, const Row<NT>& rdx,
                                               const RV& rv0, const RV& rv1, float a0, float a1) {
  p0 = 0.f, p1 = 0.f;
#pragma unroll
  for (int t = 0; t < NT; ++t)
#pragma unroll
    for (int e = 0; e < 8; ++e) {
      const float dxe = elem(rdx.raw[t], e);
      p0 += dxe * at(rv0, t, e);
      p1 += dxe * at(rv1, t, e);
      acc0[t][e] += a0 * dxe;
      acc1[t][e] += a1 * dxe;
    }
}
template <int NT, class RV>
__device__ __forceinline__ void pair_site(float (&acc0)[NT][8], float (&acc1)[NT][8], float& ds0,
                                          float& ds1, const Row<NT>& rdx, const RV& rv0,
                                          const RV& rv1, float a0, float a1, float ub, int G,
                                          float* u0 = nullptr, float* u1 = nullptr) {
  float p0, p1;
  pair_site_dots(acc0, acc1, p0, p1, rdx, rv0, rv1, a0, a1);
  const float h0 = head_sum(p0, G);
  ds0 = a0 * (h0 - ub);
  const float h1 = head_sum(p1, G);
  ds1 = a1 * (h1 - ub);
  if (u0) *u0 = h0, *u1 = h1;  // (pair version 16's radial sums)
}

// Depth tiling of the backward (backend.h routing_source_backward_tile; unfused slots,
// span layout): slots p0 = source and p1 = older (source - 1 in full routing, the
// previous closed slot source - block in a block layout) in one pass over the site
// gradients dx_j, j = source .. last_site(source), each read once for both: slot p0's
// whole value row (val, as source_value_span_kernel writes it), slot p1's share of the
// same sites (partial), and the logit gradients ds r of both slots' pairs with those
// sites. Slot p1's own call then reads only its sites before p0 (resume). Both slot rows
// and both value rows stay in registers (234 at d = 1280, 2 blocks per SM), so each
// dx_j chunk serves two slots: half the site-gradient reads of two plain calls.
// Numbered versions (kernel lab, routing_set_kernel_version; 1-4 the same code, so the
// same bits): 1 asks for 2 blocks per SM at every width (193 registers at d = 1024: 8 warps per
// SM) on the usual grid of 8 blocks per SM; 2 for 3 blocks where that does not spill
// (ptxas: 168 registers at d = 1024, 155 at 768; at 1280 the bound of 3 spills, so 1B keeps
// 2); 3 is 2 on a grid of exactly the resident blocks (one wave: 8 blocks per SM over 3
// resident ones would leave the last of 2.67 waves two-thirds full); 4 is 3 with the
// site rows from a ring kPairRing sites ahead (source_value_pair_ring_span_kernel) where
// d <= 512 (NT <= 2), whose short rows left a warp ~70 instructions of work per site to
// cover the next row's DRAM round trip (as the value kernel's version 1: ncu there).
// Measured (seventeenth session, a step's tiled backward, ms, v3 / v4): 100M 4.571 /
// 4.509; 350M 22.46 / 22.42 and 1B 50.88 / 50.94 (the same kernel as version 3 there).
// 5 and 6 are 4 on row parts of at most 2 and 1 chunks a lane (RowPart; else 4), so the
// ring reaches 350M's d 1024 as two parts of d 512; like the value kernel's versions 3-4,
// they change the per-head dot products' order of summation where they split the row.
// Measured (eighteenth session, same test, v4 / v5 / v6): 350M 22.30 / 22.44 / 26.27 ms, so
// the pair kernel is not bound by its rows in flight; 100M and 1B within 0.1 ms but v6 at
// 100M (4.81 against 4.56).
// 7 and 8 stage the rows in shared memory by cp.async (source_value_pair_stream_kernel,
// below; version 3's arithmetic and bits). Nineteenth session, same test at the default
// fused limit, v3 / v7 / v8: 350M 21.99 / 22.75 / **20.90** ms, 1B 50.78 / 53.65 /
// **46.75** (100M takes value version 5's fused pair form, which neither changes). So the
// rows in flight did bound it, once they no longer cost registers or L1 lines.
// 9 is 8 plus that fused form on the stream (100M); the default since the twentieth
// session: 100M 4.183 (v8) -> **4.022** ms, 350M and 1B as version 8 (the same kernel).
// 10 is 9 with the fused form at 4 blocks an SM where NT <= 2 (ptxas gives version 9 120
// registers at d 512, so 4 fit; its 39 KB of slots a block then take a 164 KiB carveout,
// leaving 64 KiB of L1 for the q*g rows): 16 warps an SM against 12, for 100M's tiles,
// whose stream keeps ~72 KB an SM in flight already, so more warps would help only if
// the kernel is bound by its warps' issue. Measured (twentieth session, call 3, 100M's
// tiled backward): v9 3.635 ms, v10 3.643: no gain, so it is not short of warps.
// 11 (the default from the twenty-first session to the thirtieth) is 9 with the lanes a
// head, G = 32 / H, a compile-time constant where H is 4 or 8 (the paper shapes: G 8 at
// 100M, 4 at 350M and 1B). Why: the PTX of version 9's fused kernel at d
// 512 has ~416 instructions (moves not counted) a site and token a warp, ~0.9 G warp
// instructions for 100M's tiles, which at the measured 1.91 ms is over half the issue
// rate. Each of its four head sums a site (pair_site's two, key_site's two) is a loop over
// G's shuffles, 5 instructions an iteration, and the two slots' chains cannot overlap;
// with G known they unroll (3 shuffles and adds at G 8) and interleave: ~346 a site. The
// same operations in the same order: the same bits. Of the rest: ~260 of arithmetic
// (128 FMAs, the bf16 unpacks), ~80 of the item's copy issue (64-bit offsets, the item
// kind's branches, the scalar copies of lanes below H). Measured (twenty-first session,
// call 1, a step's tiled backward at the default fused limit, v9 -> v11): 100M 3.630 ->
// **3.458** ms, 350M 20.785 -> 20.721, 1B 45.885 -> 45.296.
// Tried and dropped before any run: the two slot rows unpacked to fp32 once a token (a
// fp32 copy of each, passed to the site helpers): NVVM sinks the unpacks back into the
// site loop (identical PTX), so they stay ~32 of a site's instructions at d 512. Version
// 14 (below) does it with each value made opaque to the compiler (unpacked), which holds.
// 12 is 11 with the unfused tiles' pass on tensor cores (routing_pair_mma.cu) where
// pair_mma_applies (the paper's widths); the fused form (100M's default) stays 11's. Its
// sums run in another order (routing_backward_sum_order says so). Measured (twenty-eighth
// session, a step's tiled backward, v11 / v12): 350M 19.47 / 22.14 ms, 1B 44.17 / 52.42;
// ncu: 8 warps an SM, latency-bound, most of its instructions the copies' address
// arithmetic (cuda/NOTES.md, "The backward tile's pass on tensor cores"). Then (twenty-ninth
// session, the same test) with the copies' address arithmetic cut and U's mma chain split
// in two, and 13 as 12 at 2 stages a warp (16 warps an SM at 350M and 1B; 12: 8): 350M
// 19.50 / 21.67 / 20.78 ms (default / 12 / 13), 1B 44.20 / 51.64 / 48.79. Still slower:
// each warp's item (a token's head, 16 sites) is a serial chain of ~3 us. The rows by the
// copy engine (versions 14-16, code at 11c7861) lost too: bulk copies take uniform
// operands, so a warp's 16 row copies became a loop of 16.
// 14 (since then; the number reused) is 11 with the fused form's two slot rows widened to
// fp32 once a token and held in registers (RowF32, unpacked) where NT <= 2 (100M's d 512):
// the compiler otherwise re-unpacks them at every site (~32 of a site's ~273 instructions
// at d 512; the kernel is issue-bound there, cuda/NOTES.md). The same operations in the
// same order: version 11's bits. Elsewhere it runs 11. Measured (twenty-ninth session, a
// step's tiled backward at 100M, three rounds): v11 3.062-3.069 ms, v14 2.982-2.986
// (-2.7%); 350M and 1B the same. The default since the thirtieth session, when
// RoutingParity (SpanLayout's d 512, ModelWidths' 100M case) gave version 11's bits on
// the H200; 100M's mhar step the same within noise (39.8 / 40.0 ms medians of 3 rounds:
// the kernel's 0.08 ms is 0.2% of the step).
// 15 is 14 with each site's qg chunks loaded while the site before runs (one site ahead,
// 16 more registers a lane: 146 at d 512). Why: ncu of version 14 at 100M (thirtieth
// session, BENCHMARKS.md) put ~21% of its stall samples on the key path's first FFMA
// waiting for its qg row, loaded (ptxas placed it so) right after the site's head-sum
// shuffles; 0.49 instructions issued a scheduler cycle, 12 warps an SM. The same
// operations in the same order: version 14's bits (RoutingParity, thirtieth session).
// Measured (thirty-first session, a step's tiled backward, three rounds): 100M v14
// 2.971-2.980 ms, v15 2.808-2.810 (-5.6%); 350M and 1B the same within 0.1%. The
// default since then; 100M's mhar step the same within noise (39.4 / 39.4 ms medians of
// 3 rounds: the kernel's 0.17 ms is 0.4% of the step).
// 16 is 15 with both slots' radial sums formed once a token from the accumulators
// (key_site_chunks: v . acc less the value path's sum_k a_k u_k, over r) instead of a
// qg_k . v dot product and head sum a slot and site: 32 FMAs, 6 shuffles and adds a site
// fewer at d 512 (ptxas: 150 registers, 146 for 15). Its sums run in another order, so it
// is held to the CPU's bounds (routing_backward_sum_order). Where it differs from 15: the
// fused form's stream kernel with the lanes a head constant (whole rows, H 4 or 8).
// Measured (thirty-second session, a step's tiled backward at 100M, three rounds, ms):
// pair 15 + value 5 (then the defaults) 2.818-2.838, 16 + 5 2.757-2.764, 15 + 7
// 2.787-2.789, **16 + 7 2.722-2.724** (-3.6%); 350M and 1B: 16 as 15 (the unfused form).
// 100M's mhar step, 3 alternating rounds: 38.7 / 38.6 ms (medians). The default since then,
// with value version 7 at d <= 512.
// 17 is 16 with the unfused form's site loop reshaped (source_value_pair_lean_kernel, below:
// each site's head sums one site later, running offsets in the copy issue, ds r stored a
// token's run at a time and moved to the pairs by a transpose kernel); the fused form is
// 16's. Its bits are 16's (RoutingParity).
// 18 is 17 with the fused form's ds r stored the same way (source_value_pair_stream_kernel
// with BY_TOKEN; 100M's tiles, whose 4 heads' stores are 8 requests a site and token beside
// the 1 KB row's 8). Its bits are 16's (RoutingParity, fifty-fifth session). Measured then
// (BENCHMARKS.md; a step's tiled backward at 100M, three alternating rounds, H100): 2.930 ms
// at the defaults, 3.022 with 18 (+3%), 3.076 with 18 and value version 8: at 4 heads the
// transpose kernel after each tile costs more than the scattered stores it replaces. Not
// the default; kept in the lab (the fused form at 8 heads, d <= 512, is untried).

template <int NT, int MIN_BLOCKS>
__global__ void __launch_bounds__(32 * kWarpsPerBlock, MIN_BLOCKS)
    source_value_pair_span_kernel(float* __restrict__ val, float* __restrict__ partial,
                                  float* __restrict__ weights, float* __restrict__ ubar,
                                  const SiteRows site_dx, const bf16* __restrict__ x,
                                  const bf16* __restrict__ v0, const bf16* __restrict__ v1,
                                  const float* __restrict__ inv_rms0,
                                  const float* __restrict__ inv_rms1, const Geometry g,
                                  int source) {
  const int lane = threadIdx.x & 31, G = 32 / g.H, h = lane / G;
  const bool leader = lane % G == 0;
  const int64_t warps = int64_t(gridDim.x) * (blockDim.x >> 5);
  // Head h's pair rows of both slots from site `source` on: pair(p, j) = pair_base(p) +
  // j - p for a slot read by every later site (full routing; a block layout's closed slots).
  const int older = source - g.lay.block;  // RoutingLayout::back_tile_count's pairing
  float* w0 = weights + (g.lay.pair_base(source) * g.H + h) * g.N;
  float* w1 = weights + ((g.lay.pair_base(older) + (source - older)) * g.H + h) * g.N;
  const float* ub_h = ubar + int64_t(h) * g.N;
  const int last = g.lay.last_site(source);
  for (int64_t n = int64_t(blockIdx.x) * (blockDim.x >> 5) + (threadIdx.x >> 5); n < g.N;
       n += warps) {
    const float r0 = inv_rms0[n], r1 = inv_rms1[n];
    Row<NT> rv0, rv1, rdx, nxt;
    load_span(rv0, v0 + n * g.d);
    load_span(rv1, v1 + n * g.d);
    load_span(rdx, site_dx.dx[source] + n * g.d);
    float ub = span_ubar(ubar, rdx, x, g, source, n);
    float a0 = w0[n], a1 = w1[n];
    float acc0[NT][8], acc1[NT][8];
#pragma unroll
    for (int t = 0; t < NT; ++t)
#pragma unroll
      for (int e = 0; e < 8; ++e) acc0[t][e] = 0.f, acc1[t][e] = 0.f;
    for (int k = source; k <= last; ++k) {
      const int64_t off = int64_t(k - source) * g.H * g.N + n;
      float a0_nxt = 0.f, a1_nxt = 0.f, ub_nxt = 0.f;
      if (k + 1 <= last) {
        load_span(nxt, site_dx.dx[k + 1] + n * g.d);
        a0_nxt = w0[off + int64_t(g.H) * g.N];
        a1_nxt = w1[off + int64_t(g.H) * g.N];
        ub_nxt = ub_h[int64_t(k + 1) * g.H * g.N + n];
      }
      float ds0, ds1;
      pair_site(acc0, acc1, ds0, ds1, rdx, rv0, rv1, a0, a1, ub, G);
      // The shuffles synchronise the warp: a_k was read by every lane an iteration ago.
      if (leader) w0[off] = ds0 * r0, w1[off] = ds1 * r1;
      if (k + 1 <= last) rdx = nxt, a0 = a0_nxt, a1 = a1_nxt, ub = ub_nxt;
    }
    store_span_f32(val + n * g.d, acc0);
    store_span_f32(partial + n * g.d, acc1);
  }
}

// Version 4 of the pair kernel: source_value_pair_span_kernel with site k + PF's row,
// weights and ubar loaded when site k is taken from the ring (value_site's ring, for two
// slots); versions 5 and 6 run it on row parts (RowPart) as the value kernel's versions 3
// and 4 do. With KEY (value version 5: source_value_pair_fused_kernel) the key path too:
// slot p0 = source is finished here (dv0); slot p1 = older leaves its value row so far
// (with its key path) in `partial` and its radial sum over the tile's sites after it
// (partial[N d + n]), from which its own call resumes. One token's row part (warp item wi)
// per call, as value_ring_token.
template <int NT, int PF, bool KEY>
__device__ __forceinline__ void pair_ring_token(
    float* val, bf16* dv0, float* partial, float* weights, float* ubar, const SiteRows& site_dx,
    const bf16* x, const bf16* v0, const bf16* v1, const float* inv_rms0, const float* inv_rms1,
    const float* qg, const Geometry& g, int source, int parts_log2, int64_t wi,
    float (*xch)[kWarpsPerBlock], int round) {
  const int lane = threadIdx.x & 31;
  const int64_t HN = int64_t(g.H) * g.N;
  const int older = source - g.lay.block;  // as in source_value_pair_span_kernel
  const int last = g.lay.last_site(source);
  const RowPart rp = row_part(wi, parts_log2, NT, g.H);
  const int64_t n = rp.n, row = n * g.d + rp.off;
  const bool leader = lane % rp.G == 0;
  float* w0 = weights + (g.lay.pair_base(source) * g.H + rp.h) * g.N;
  float* w1 = weights + ((g.lay.pair_base(older) + (source - older)) * g.H + rp.h) * g.N;
  const float* ub_h = ubar + int64_t(rp.h) * g.N;
  const float r0 = inv_rms0[n], r1 = inv_rms1[n];
  Row<NT> rv0, rv1, ring[PF];
  float ra0[PF], ra1[PF], rub[PF];
  load_span(rv0, v0 + row);
  load_span(rv1, v1 + row);
  load_span(ring[0], site_dx.dx[source] + row);
#pragma unroll
  for (int u = 1; u < PF; ++u)
    if (source + u <= last) {
      load_span(ring[u], site_dx.dx[source + u] + row);
      ra0[u] = w0[u * HN + n], ra1[u] = w1[u * HN + n];
      rub[u] = ub_h[(source + u) * HN + n];
    }
  rub[0] = part_ubar(ubar, ring[0], x, g, rp, source);
  ra0[0] = w0[n], ra1[0] = w1[n];
  float acc0[NT][8], acc1[NT][8], radial0 = 0.f, radial1 = 0.f;  // radials: KEY
#pragma unroll
  for (int t = 0; t < NT; ++t)
#pragma unroll
    for (int e = 0; e < 8; ++e) acc0[t][e] = 0.f, acc1[t][e] = 0.f;
  for (int k0 = source; k0 <= last; k0 += PF) {
#pragma unroll
    for (int u = 0; u < PF; ++u) {
      const int k = k0 + u;
      if (k > last) break;
      const Row<NT> rdx = ring[u];
      const float a0 = ra0[u], a1 = ra1[u], ub = rub[u];
      if (k + PF <= last) {
        load_span(ring[u], site_dx.dx[k + PF] + row);
        ra0[u] = w0[(k + PF - source) * HN + n], ra1[u] = w1[(k + PF - source) * HN + n];
        rub[u] = ub_h[(k + PF) * HN + n];
      }
      float ds0, ds1;
      pair_site(acc0, acc1, ds0, ds1, rdx, rv0, rv1, a0, a1, ub, rp.G);
      if constexpr (KEY) {
        const float4* qrow =
            reinterpret_cast<const float4*>(qg + rp.off) + lane * 2 * NT + (k - source) * (g.d / 4);
        key_site(acc0, radial0, rv0, qrow, r0, ds0, rp.G, leader);
        key_site(acc1, radial1, rv1, qrow, r1, ds1, rp.G, leader);
      }
      // The shuffles synchronise the warp: every lane has used a_k before it is rewritten.
      const int64_t off = (k - source) * HN + n;
      if (leader) w0[off] = ds0 * r0, w1[off] = ds1 * r1;
    }
  }
  if constexpr (KEY) {
    store_fused_dv(dv0 + row, acc0, rv0, r0, parts_sum(warp_sum(radial0), xch, parts_log2, round),
                   g.d);
    store_span_f32(partial + row, acc1);
    const float total1 = parts_sum(warp_sum(radial1), xch, parts_log2, round + 1);
    if (rp.off == 0 && lane == 0) partial[g.N * g.d + n] = total1;
  } else {
    store_span_f32(val + row, acc0);
    store_span_f32(partial + row, acc1);
  }
}

template <int NT, int MIN_BLOCKS, int PF>
__global__ void __launch_bounds__(32 * kWarpsPerBlock, MIN_BLOCKS)
    source_value_pair_ring_span_kernel(float* __restrict__ val, float* __restrict__ partial,
                                       float* __restrict__ weights, float* __restrict__ ubar,
                                       const SiteRows site_dx, const bf16* __restrict__ x,
                                       const bf16* __restrict__ v0, const bf16* __restrict__ v1,
                                       const float* __restrict__ inv_rms0,
                                       const float* __restrict__ inv_rms1, const Geometry g,
                                       int source, int parts_log2) {
  const int64_t warps = int64_t(gridDim.x) * (blockDim.x >> 5);
  for (int64_t wi = int64_t(blockIdx.x) * (blockDim.x >> 5) + (threadIdx.x >> 5);
       wi < (g.N << parts_log2); wi += warps)
    pair_ring_token<NT, PF, false>(val, nullptr, partial, weights, ubar, site_dx, x, v0, v1,
                                   inv_rms0, inv_rms1, nullptr, g, source, parts_log2, wi, nullptr,
                                   0);
}

template <int NT, int MIN_BLOCKS, int PF>
__global__ void __launch_bounds__(32 * kWarpsPerBlock, MIN_BLOCKS)
    source_value_pair_fused_kernel(bf16* __restrict__ dv0, float* __restrict__ partial,
                                   float* __restrict__ weights, float* __restrict__ ubar,
                                   const SiteRows site_dx, const bf16* __restrict__ x,
                                   const bf16* __restrict__ v0, const bf16* __restrict__ v1,
                                   const float* __restrict__ inv_rms0,
                                   const float* __restrict__ inv_rms1, const float* __restrict__ qg,
                                   const Geometry g, int source, int parts_log2) {
  __shared__ float xch[2][kWarpsPerBlock];
  const int64_t warps = int64_t(gridDim.x) * (blockDim.x >> 5);
  int round = 0;
  for (int64_t wi = int64_t(blockIdx.x) * (blockDim.x >> 5) + (threadIdx.x >> 5);
       wi < (g.N << parts_log2); wi += warps, round += 2)
    pair_ring_token<NT, PF, true>(nullptr, dv0, partial, weights, ubar, site_dx, x, v0, v1,
                                  inv_rms0, inv_rms1, qg, g, source, parts_log2, wi, xch, round);
}

// Pair versions 17-18's store of one site's ds r for one token: the 2 H values of both slots
// (ds0, ds1 of head h on each of its lanes, as pair_site leaves them) gathered to lanes
// 0 .. 2 H - 1 and stored as one run, [slot][head], times the slots' inv_rms; `at` is this
// lane's place in the run.
template <int H>
__device__ __forceinline__ void store_ds_by_token(float* at, float ds0, float ds1, float r0,
                                                  float r1) {
  const int lane = threadIdx.x & 31, from = (lane % H) * (32 / H);  // a lane of head lane % H
  const float head_ds0 = __shfl_sync(0xffffffffu, ds0, from);
  const float head_ds1 = __shfl_sync(0xffffffffu, ds1, from);
  if (lane < 2 * H) *at = lane < H ? head_ds0 * r0 : head_ds1 * r1;
}

// ---------------------------------------------------------------- pair kernel, streamed
// A stream pair kernel's item ci of a token: the rows of v0, v1, x, then the site gradients
// from site `source` on.
__device__ __forceinline__ const bf16* stream_item_row(int ci, const bf16* v0, const bf16* v1,
                                                       const bf16* x, const SiteRows& site_dx,
                                                       int source) {
  return ci == 0 ? v0 : ci == 1 ? v1 : ci == 2 ? x : site_dx.dx[source + ci - 3];
}
// A stream kernel's first four items of token n (v0's row with both slots' inv_rms at
// scalar index rs, v1's row, x's row, site `source`'s gradient), taken from the ring and
// read by row_of; x's row then gives ubar of site `source`, stored and returned.
template <int NT, class Ring, class Issue, class RowOf>
__device__ __forceinline__ float take_token_start(Ring& ring, Issue& issue, RowOf&& row_of, int rs,
                                                  Row<NT>& rv0, Row<NT>& rv1, Row<NT>& rdx,
                                                  float& r0, float& r1, float* ubar,
                                                  const Geometry& g, int source, int64_t n, int G) {
  {
    const StreamSlot<NT>& s0 = ring.take(issue);
    row_of(s0, rv0);
    r0 = s0.scalar[0][rs], r1 = s0.scalar[1][rs];
  }
  row_of(ring.take(issue), rv1);
  Row<NT> rx;
  row_of(ring.take(issue), rx);
  row_of(ring.take(issue), rdx);
  return span_ubar_row(ubar, rdx, rx, g, source, n, G);
}
// Versions 7 and 8 of the pair kernel (routing_set_kernel_version(BackwardPair, v)):
// version 3's arithmetic (pair_site, the same bits) with its rows staged in shared memory
// by cp.async, stream_slots(NT) slots a warp, so that the rows in flight no longer
// cost registers.
// Why: ncu of version 3 at 350M (nineteenth session, BENCHMARKS.md): 12 warps an SM (168
// registers, 3 blocks), 2.06 TB/s, 52% of the stall samples at the first use of the site
// row loaded one site ahead (long scoreboard): latency-bound, with ~24 KB an SM in flight
// where ~100 KB would cover DRAM's latency. The ring in registers (version 4) spills past
// d 512, and row parts (5, 6) cost their own prologues.
// The warp's work is one stream of items, token by token: v0's row (with inv_rms of both
// slots), v1's row, x's row, then the site gradients dx_k, k = source .. last (with the
// weights a0, a1 and ubar_k). A cursor runs stream_slots - 1 items ahead of the
// consumer across token boundaries, so a token's first rows are in flight while the
// previous one finishes; one cp.async group an item.
// - Version 7 (COALESCED false): each lane copies the chunks it consumes (its span, 16
//   bytes at a stride of 16 NT: half a sector each, as version 3's loads) with
//   cp.async.ca, and its scalars itself; a lane waits only for its own copies, no warp
//   barrier. Slot layout [chunk t][lane], conflict-free. Measured (nineteenth session,
//   call 3): slower than version 3, 350M 21.84 -> 22.67 ms, 1B 50.23 -> 53.02: the L1
//   left beside ~200 KB of shared memory is what .ca copies allocate in and merge their
//   half sectors through.
// - Version 8 (COALESCED): lane l copies chunks l + 32 u (each instruction 512 contiguous
//   bytes, whole sectors) with cp.async.cg (no L1 allocation) into the row's own order,
//   XOR-swizzled so that the consumer's span reads are conflict-free (stream_pos); one
//   lane a head copies the head's scalars. Lanes read what other lanes copied, so each
//   item's wait is followed by a warp barrier. Measured (call 4): 350M 20.90 ms, 1B 46.75
//   (version 3: 21.99, 50.78). ptxas: 161 registers at d 1024 (3 blocks an
//   SM, 68 KB of shared memory each), 202 at 1280 (2 blocks, 106 KB), no spills.
// - Version 9 (the default; twentieth session: 100M's tiled backward 4.183 -> 4.022 ms,
//   -4%; the same bits as the fused form's version 4, RoutingParity) is version 8, and
//   where value version 5 fuses the key path into the tile (d <= 512, whole rows: 100M)
//   the same stream in that fused form (KEY: key_site per site and slot, slot p0's dv
//   finished, p1's partial row and radial sum left in the scratch, as pair_ring_token
//   with KEY on a whole row: the same operations in the same order, so the same bits as
//   the fused form's default). The q*g rows come from L1, so the carveout leaves L1 room
//   (stream_carveout).

template <int NT, int MIN_BLOCKS, bool COALESCED, bool KEY = false, int GC = 0, bool F32 = false,
          bool QAHEAD = false, bool RADIAL = false, bool BY_TOKEN = false>
__global__ void __launch_bounds__(32 * kWarpsPerBlock, MIN_BLOCKS)
    source_value_pair_stream_kernel(float* __restrict__ val, bf16* __restrict__ dv0,
                                    float* __restrict__ partial, float* __restrict__ weights,
                                    float* __restrict__ ubar, const SiteRows site_dx,
                                    const bf16* __restrict__ x, const bf16* __restrict__ v0,
                                    const bf16* __restrict__ v1, const float* __restrict__ inv_rms0,
                                    const float* __restrict__ inv_rms1,
                                    const float* __restrict__ qg, const Geometry g, int source,
                                    float* __restrict__ ds_by_token) {
  static_assert(!KEY || COALESCED, "the fused form is version 9: version 8's copies");
  static_assert(GC == 0 || (COALESCED && GC <= 32 && (GC & (GC - 1)) == 0),
                "version 11: version 8's copies, G a power of two");
  static_assert(!F32 || (KEY && GC > 0), "version 14 is version 11's fused form");
  static_assert(!QAHEAD || F32, "version 15 is version 14 with qg one site ahead");
  static_assert(!RADIAL || QAHEAD, "version 16 is version 15 with the radial sums at the end");
  static_assert(!BY_TOKEN || RADIAL, "version 18's fused form is version 16's, ds r by token");
  constexpr int R = stream_slots(NT);
  extern __shared__ float4 pair_stream_smem_raw[];
  // GC > 0 (version 11): the lanes a head as a compile-time constant (the host checks
  // 32 / g.H == GC), so every head_sum below unrolls.
  const int lane = threadIdx.x & 31, G = GC > 0 ? GC : 32 / g.H, h = lane / G;
  const bool leader = lane % G == 0;
  // Scalars: version 7's lanes each copy and read their own (index lane); version 8's lane
  // l < H copies head l's into index l, which the head's lanes read (index sc).
  const int sc = COALESCED ? h : lane;
  const bool copies_scalars = !COALESCED || lane < g.H;
  SlotRing<NT, R, COALESCED> ring{reinterpret_cast<StreamSlot<NT>*>(pair_stream_smem_raw) +
                                  (threadIdx.x >> 5) * R};
  const int64_t warps = int64_t(gridDim.x) * (blockDim.x >> 5), HN = int64_t(g.H) * g.N;
  const int older = source - g.lay.block;  // as in source_value_pair_span_kernel
  // Head hc's pair rows (hc: the head whose scalars this lane copies).
  const int hc = COALESCED ? lane : h;
  float* w0 = weights + g.lay.pair_base(source) * HN;
  float* w1 = weights + (g.lay.pair_base(older) + (source - older)) * HN;
  const int last = g.lay.last_site(source), items = last - source + 4;
  const int64_t first = int64_t(blockIdx.x) * (blockDim.x >> 5) + (threadIdx.x >> 5);
  // The cursor: item ci of token cn is the next to copy.
  int64_t cn = first;
  int ci = 0;
  auto issue = [&](StreamSlot<NT>& slot) {
    if (cn >= g.N) return;
    const uint4* p =
        reinterpret_cast<const uint4*>(stream_item_row(ci, v0, v1, x, site_dx, source) + cn * g.d);
    if constexpr (COALESCED) {
      copy_chunks_async(slot, p);
    } else {
#pragma unroll
      for (int t = 0; t < NT; ++t) cp_async_ca(&slot.row[t * 32 + lane], p + lane * NT + t, 16);
    }
    if (copies_scalars) {
      if (ci == 0) {
        cp_async_ca(&slot.scalar[0][lane], inv_rms0 + cn, 4);
        cp_async_ca(&slot.scalar[1][lane], inv_rms1 + cn, 4);
      } else if (ci >= 3) {
        const int64_t off = int64_t(ci - 3) * HN + int64_t(hc) * g.N + cn;
        cp_async_ca(&slot.scalar[0][lane], w0 + off, 4);
        cp_async_ca(&slot.scalar[1][lane], w1 + off, 4);
        if (ci > 3)
          cp_async_ca(&slot.scalar[2][lane],
                      ubar + (int64_t(source + ci - 3) * g.H + hc) * g.N + cn, 4);
      }
    }
    if (++ci == items) ci = 0, cn += warps;
  };
  auto row_of = [&](const StreamSlot<NT>& slot, Row<NT>& r) {
    if constexpr (COALESCED) {
      slot_span(slot, r);
    } else {
#pragma unroll
      for (int t = 0; t < NT; ++t) r.raw[t] = slot.row[t * 32 + lane];
    }
  };
  // r0, r1: version 8 reads lane 0's copy (index 0; lanes < H each copy them).
  const int rs = COALESCED ? 0 : lane;
#pragma unroll 1
  for (int u = 0; u < R - 1; ++u) ring.refill(issue);
  for (int64_t n = first; n < g.N; n += warps) {
    Row<NT> rv0, rv1, rdx;
    float r0, r1;
    float ub =
        take_token_start(ring, issue, row_of, rs, rv0, rv1, rdx, r0, r1, ubar, g, source, n, G);
    // The token's sites and stores, on the slot rows as given (version 14: widened to
    // fp32 once, see unpacked; else the bf16 words): the same operations either way.
    auto token = [&](const auto& v0r, const auto& v1r) {
      float acc0[NT][8], acc1[NT][8];
      [[maybe_unused]] float radial0 = 0.f, radial1 = 0.f;  // KEY; RADIAL: sum_k a_k u_k
#pragma unroll
      for (int t = 0; t < NT; ++t)
#pragma unroll
        for (int e = 0; e < 8; ++e) acc0[t][e] = 0.f, acc1[t][e] = 0.f;
      // Site `source`'s weights sit in the slot just taken; read before the next take.
      float a0 = ring.taken().scalar[0][sc], a1 = ring.taken().scalar[1][sc];
      [[maybe_unused]] float* w0h = w0 + int64_t(h) * g.N;  // not BY_TOKEN: ds r in place
      [[maybe_unused]] float* w1h = w1 + int64_t(h) * g.N;
      auto qrow_of = [&](int k) {
        return reinterpret_cast<const float4*>(qg) + lane * 2 * NT + (k - source) * (g.d / 4);
      };
      // QAHEAD (version 15): site k's qg chunks, loaded while site k - 1 ran.
      [[maybe_unused]] float q_next[NT][8];
      if constexpr (QAHEAD) load_qg_row(q_next, qrow_of(source));
#pragma unroll 1
      for (int k = source;; ++k) {
        float ds0, ds1;
        if constexpr (QAHEAD) {
          // RADIAL (version 16): the radial sums at the end (key_site_chunks).
          [[maybe_unused]] float u0, u1;
          pair_site(acc0, acc1, ds0, ds1, rdx, v0r, v1r, a0, a1, ub, G, RADIAL ? &u0 : nullptr,
                    RADIAL ? &u1 : nullptr);
          if constexpr (RADIAL) radial0 += a0 * u0, radial1 += a1 * u1;
          key_site<!RADIAL>(acc0, radial0, v0r, q_next, r0, ds0, G, leader);
          key_site<!RADIAL>(acc1, radial1, v1r, q_next, r1, ds1, G, leader);
        } else {
          pair_site(acc0, acc1, ds0, ds1, rdx, v0r, v1r, a0, a1, ub, G);
          if constexpr (KEY) {  // as pair_ring_token's, on the whole row
            key_site(acc0, radial0, v0r, qrow_of(k), r0, ds0, G, leader);
            key_site(acc1, radial1, v1r, qrow_of(k), r1, ds1, G, leader);
          }
        }
        if constexpr (BY_TOKEN) {
          // Version 18: the token's 2 H values as one run (pair version 17's store).
          store_ds_by_token<32 / GC>(ds_by_token + ((k - source) * g.N + n) * (2 * 32 / GC) + lane,
                                     ds0, ds1, r0, r1);
        } else {
          // The shuffles synchronise the warp: no lane still needs the weights overwritten here.
          const int64_t off = (k - source) * HN + n;
          if (leader) w0h[off] = ds0 * r0, w1h[off] = ds1 * r1;
        }
        if (k == last) break;
        if constexpr (QAHEAD) load_qg_row(q_next, qrow_of(k + 1));
        const StreamSlot<NT>& s = ring.take(issue);
        row_of(s, rdx);
        a0 = s.scalar[0][sc], a1 = s.scalar[1][sc], ub = s.scalar[2][sc];
      }
      if constexpr (KEY) {
        // A slot's radial sum over the warp; RADIAL: from its accumulator, each head's
        // sum_k a_k u_k counted once, by its leader.
        auto radial_sum = [&](const float(&acc)[NT][8], const auto& vr, float own, float r) {
          if constexpr (RADIAL)
            return warp_sum(acc_dot(acc, vr) - (leader ? own : 0.f)) / r;
          else
            return warp_sum(own);
        };
        store_fused_dv(dv0 + n * g.d, acc0, v0r, r0, radial_sum(acc0, v0r, radial0, r0), g.d);
        store_span_f32(partial + n * g.d, acc1);
        const float total1 = radial_sum(acc1, v1r, radial1, r1);
        if (lane == 0) partial[g.N * g.d + n] = total1;
      } else {
        store_span_f32(val + n * g.d, acc0);
        store_span_f32(partial + n * g.d, acc1);
      }
    };
    if constexpr (F32)
      token(unpacked(rv0), unpacked(rv1));
    else
      token(rv0, rv1);
  }
  cp_async_wait_groups<0>();  // nothing in flight into shared memory at exit
}

// Version 17 (fifty-third session; the default since): version 11's unfused stream kernel
// (350M's and 1B's tiles: whole rows, no key path, the lanes a head G a compile-time
// constant) with its site loop reshaped by what ncu found in version 16's (the same kernel
// there) at 350M (BENCHMARKS.md, fifty-third session: one mid-tile launch,
// 504 us, 21 sites a token, 12 warps an SM, 0.33 instructions issued a scheduler cycle,
// 436 instructions a site): of its stall samples, 14% on the head sums' FADDs waiting for
// their shuffles (each site's dot products are summed at the end of its FMAs, so nothing
// hides the two shuffle round trips), 17% on registers that the copy issue's LDGSTS and the
// ds stores had not yet read (their queue is full: MIO throttle another 11%), and ~125 of
// the 436 instructions the copy issue's 64-bit offsets and item branches. So:
// - each site's head sums, ds and stores come one site later, after the next site's FMAs
//   in the same basic block (pair_site_dots, then pair_site's sums), so the scheduler can
//   put the shuffles among them;
// - the issue keeps running offsets (the row's, and one for the three scalars: weights of
//   both slots and ubar share [site][head][token]) instead of products a copy;
// - ds r goes out a token at a time: its 2 H values (both slots, every head) gathered to
//   lanes 0 .. 2 H - 1 by two shuffles and stored as one run into the RoutingPairDs scratch,
//   [site][token][slot][head]; ds_by_token_to_pairs_kernel then moves them to the pairs'
//   [pair][head][token] rows, which the key gradients read. Version 16 stores each head's
//   4 bytes into a sector of its own, 2 H sectors a site and token.
// Measured as built step by step (fifty-third session, BENCHMARKS.md; a step's tiled
// backward, OpTiming.DISABLED_RoutingPairVersions, three alternating rounds, H100): the
// first two changes alone 350M 23.18 -> 22.92 ms, 1B 54.26 -> 53.57 (-1.1%, -1.3%); the
// same kernel with its ds stores dropped (a timing-only edit, not kept) 20.03 and 47.09,
// with the scalars' copies dropped too 19.20 and 44.40: the scattered stores were the
// largest single cost, the scalars' 4-byte gathers the next (cuda/NOTES.md lead 2).
// The same operations on the same values in the same order: version 16's bits.
template <int NT, int MIN_BLOCKS, int G>
__global__ void __launch_bounds__(32 * kWarpsPerBlock, MIN_BLOCKS)
    source_value_pair_lean_kernel(float* __restrict__ val, float* __restrict__ partial,
                                  const float* __restrict__ weights, float* __restrict__ ubar,
                                  float* __restrict__ ds_by_token, const SiteRows site_dx,
                                  const bf16* __restrict__ x, const bf16* __restrict__ v0,
                                  const bf16* __restrict__ v1, const float* __restrict__ inv_rms0,
                                  const float* __restrict__ inv_rms1, const Geometry g,
                                  int source) {
  static_assert(G >= 1 && G <= 32 && (G & (G - 1)) == 0, "G: the lanes a head, a power of two");
  constexpr int H = 32 / G;
  constexpr int R = stream_slots(NT);
  extern __shared__ float4 pair_stream_smem_raw[];
  const int lane = threadIdx.x & 31, h = lane / G;
  const bool copies_scalars = lane < H;
  SlotRing<NT, R, true> ring{reinterpret_cast<StreamSlot<NT>*>(pair_stream_smem_raw) +
                             (threadIdx.x >> 5) * R};
  const int64_t warps = int64_t(gridDim.x) * (blockDim.x >> 5), HN = int64_t(g.H) * g.N;
  const int older = source - g.lay.block;  // as in source_value_pair_span_kernel
  const float* w0 = weights + g.lay.pair_base(source) * HN;
  const float* w1 = weights + (g.lay.pair_base(older) + (source - older)) * HN;
  const float* ub_sites = ubar + int64_t(source) * HN;  // ubar [site][head][token] from source
  const int last = g.lay.last_site(source), items = last - source + 4;
  const int64_t first = int64_t(blockIdx.x) * (blockDim.x >> 5) + (threadIdx.x >> 5);
  // The cursor: item ci of token cn is the next to copy; crow = cn d, and cs the offset of
  // the scalars of head `lane` (the lanes < H copy one head's each) at item ci's site.
  int64_t cn = first, crow = first * g.d, cs = int64_t(lane) * g.N + first;
  int ci = 0;
  auto issue = [&](StreamSlot<NT>& slot) {
    if (cn >= g.N) return;
    const bf16* src = stream_item_row(ci, v0, v1, x, site_dx, source);
    copy_chunks_async(slot, reinterpret_cast<const uint4*>(src + crow));
    if (ci == 0) {
      if (copies_scalars) {
        cp_async_ca(&slot.scalar[0][lane], inv_rms0 + cn, 4);
        cp_async_ca(&slot.scalar[1][lane], inv_rms1 + cn, 4);
      }
    } else if (ci >= 3) {
      if (copies_scalars) {
        cp_async_ca(&slot.scalar[0][lane], w0 + cs, 4);
        cp_async_ca(&slot.scalar[1][lane], w1 + cs, 4);
        if (ci > 3) cp_async_ca(&slot.scalar[2][lane], ub_sites + cs, 4);
      }
      cs += HN;
    }
    if (++ci == items) ci = 0, cn += warps, crow = cn * g.d, cs = int64_t(lane) * g.N + cn;
  };
#pragma unroll 1
  for (int u = 0; u < R - 1; ++u) ring.refill(issue);
  for (int64_t n = first; n < g.N; n += warps) {
    Row<NT> rv0, rv1, rdx;
    float r0, r1;
    auto row_of = [](const StreamSlot<NT>& slot, Row<NT>& r) { slot_span(slot, r); };
    float ub =
        take_token_start(ring, issue, row_of, 0, rv0, rv1, rdx, r0, r1, ubar, g, source, n, G);
    float acc0[NT][8], acc1[NT][8];
#pragma unroll
    for (int t = 0; t < NT; ++t)
#pragma unroll
      for (int e = 0; e < 8; ++e) acc0[t][e] = 0.f, acc1[t][e] = 0.f;
    // Site k's weights, ubar and lane shares of the head dot products, kept to site k + 1.
    float a0 = ring.taken().scalar[0][h], a1 = ring.taken().scalar[1][h], p0, p1;
    // Site k's ds r of both slots, [site][token][slot][head]: lane l < 2 H stores slot l / H's
    // head l % H (one 2 H-float run a token, where [pair][head][token] took 2 H sectors).
    float* ds_at = ds_by_token + n * 2 * H + lane;
    pair_site_dots(acc0, acc1, p0, p1, rdx, rv0, rv1, a0, a1);
    // Site k - 1's sums, ds and stores (pair_site's), after site k's FMAs.
    auto finish_site = [&] {
      const float ds0 = a0 * (head_sum(p0, G) - ub);
      const float ds1 = a1 * (head_sum(p1, G) - ub);
      store_ds_by_token<H>(ds_at, ds0, ds1, r0, r1);
      ds_at += g.N * 2 * H;
    };
#pragma unroll 1
    for (int k = source + 1; k <= last; ++k) {
      const StreamSlot<NT>& s = ring.take(issue);
      slot_span(s, rdx);
      const float na0 = s.scalar[0][h], na1 = s.scalar[1][h], nub = s.scalar[2][h];
      float q0, q1;
      pair_site_dots(acc0, acc1, q0, q1, rdx, rv0, rv1, na0, na1);
      finish_site();
      a0 = na0, a1 = na1, ub = nub, p0 = q0, p1 = q1;
    }
    finish_site();
    store_span_f32(val + n * g.d, acc0);
    store_span_f32(partial + n * g.d, acc1);
  }
  cp_async_wait_groups<0>();  // nothing in flight into shared memory at exit
}

// Logit gradients stored a token at a time (pair versions 17-18, value versions 8-9): ds r
// of SLOTS slots, [site][token][slot][head] in ds_by_token, into the weights' pairs
// [pair][head][token] from site `source` on (w0: the first slot's, w1: a tile's older
// slot's), where the other versions write them in place: a block takes 128 tokens of one
// site through shared memory, whole sectors read and written.
constexpr int kDsTokens = 128;
template <int H, int SLOTS>
__global__ void __launch_bounds__(256)
    ds_by_token_to_pairs_kernel(float* __restrict__ w0, float* __restrict__ w1,
                                const float* __restrict__ ds_by_token, int64_t N) {
  // Rows slot * H + head; the padding spreads a warp's stores (SLOTS H rows by
  // 32 / (SLOTS H) tokens) over the 32 banks.
  constexpr int kRows = SLOTS * H, kStride = kDsTokens + 32 / kRows;
  __shared__ float tile[kRows][kStride];
  const int j = blockIdx.y;
  const int64_t n0 = int64_t(blockIdx.x) * kDsTokens;
  const int toks = int(N - n0 < kDsTokens ? N - n0 : kDsTokens);
  const float* src = ds_by_token + (int64_t(j) * N + n0) * kRows;
  for (int i = threadIdx.x; i < toks * kRows; i += blockDim.x) tile[i % kRows][i / kRows] = src[i];
  __syncthreads();
  const int64_t at = int64_t(j) * H * N + n0;
  for (int i = threadIdx.x; i < kRows * toks; i += blockDim.x) {
    const int row = i / toks, tok = i % toks;
    float* dst = row < H ? w0 + int64_t(row) * N : w1 + int64_t(row - H) * N;
    dst[at + tok] = tile[row][tok];
  }
}

}  // namespace

void ds_by_token_to_pairs(cudaStream_t s, float* w0, float* w1, const float* ds_by_token, int64_t N,
                          int sites, int heads, int slots) {
  MHAR_CHECK(lanes_a_head_constant(heads) && (slots == 1 || slots == 2),
             "CUDA routing: logit gradients by token for ", heads, " heads and ", slots,
             " slots (4 or 8 heads, 1 or 2 slots)");
  const dim3 grid(unsigned((N + kDsTokens - 1) / kDsTokens), unsigned(sites));
  auto launch = [&](auto kernel) {
    kernel<<<grid, 256, 0, s>>>(w0, w1, ds_by_token, N);
    CUDA_CHECK_LAUNCH();
  };
  if (slots == 1)
    launch(heads == 4 ? ds_by_token_to_pairs_kernel<4, 1> : ds_by_token_to_pairs_kernel<8, 1>);
  else
    launch(heads == 4 ? ds_by_token_to_pairs_kernel<4, 2> : ds_by_token_to_pairs_kernel<8, 2>);
}

void backward_tile(cudaStream_t s, RoutingContext& ctx, const BackTileLaunch& t) {
  const char* what = "routing_source_backward";
  const Geometry& g = t.g;
  const int64_t N = g.N;
  const int heads = t.heads, source = t.source, ns = t.ns, fused_parts_log2 = t.fused_parts_log2;
  const bool ring_fused = fused_parts_log2 >= 0;
  Tensor weights = t.weights, ubar = t.ubar, inv_rms = t.inv_rms;
  const SiteRows& rows = t.rows;
  const bf16* x_in = t.x;
  const bf16* v_in = t.v;
  const TileSlot* older = t.older;
  const float* qg = t.qg;
  bf16* dv_out = t.dv;
  float* val = t.val;
  // Pair versions 7-16, 18 (source_value_pair_stream_kernel).
  auto launch_pair_stream = [&](auto kernel, size_t smem, int blocks_per_sm, float* val_out,
                                bf16* dv0, float* partial, const float* key_qg,
                                float* ds_by_token = nullptr) {
    launch_stream(s, kernel, smem, blocks_per_sm, N, val_out, dv0, partial, weights.ptr<float>(),
                  ubar.ptr<float>(), rows, x_in, v_in, older->v, inv_rms.ptr<float>(),
                  older->inv_rms, key_qg, g, source, ds_by_token);
  };
  // Versions 17-18's ds r by token: the scratch, and its move into the tile's pairs.
  auto ds_scratch = [&] {
    return static_cast<float*>(
        ctx.scratch(ScratchSlot::RoutingPairDs, routing_pair_ds_bytes(N, ns, heads)));
  };
  auto ds_to_pairs = [&](const float* ds) {
    const int64_t HN = int64_t(heads) * N;
    float* w0 = weights.ptr<float>() + g.lay.pair_base(source) * HN;
    float* w1 = weights.ptr<float>() + (g.lay.pair_base(source - g.lay.block) + g.lay.block) * HN;
    ds_by_token_to_pairs(s, w0, w1, ds, N, ns, heads, 2);
  };
  if (ring_fused) {
    // The older slot's radial sum so far follows its partial row.
    auto* partial =
        static_cast<float*>(ctx.scratch(ScratchSlot::RoutingBackTile, N * (g.d + 1) * 4));
    dispatch_part_span(g.d / 256 >> fused_parts_log2, [&](auto ntp) {
      constexpr int NT = decltype(ntp)::value;
      if (g_pair_version >= 9 && fused_parts_log2 == 0) {  // whole rows: the stream
        if constexpr (NT <= 2) {
          if (g_pair_version == 10) {  // 4 blocks an SM
            launch_pair_stream(source_value_pair_stream_kernel<NT, 4, true, true>,
                               stream_smem<NT>(), 4, nullptr, dv_out, partial, qg);
            return;
          }
        }
        constexpr int B = pair_blocks_per_sm(NT, 2);
        // 14: the slot rows held in fp32 registers; 15: and qg one site ahead; 16: and the
        // radial sums at the end (with the constant lanes a head: pair_sums_radial_at_end);
        // 18: and ds r stored by token (17: 16's fused form).
        if (g_pair_version >= 18 && lanes_a_head_constant(heads)) {
          float* ds = ds_scratch();
          launch_pair_stream(
              heads == 4
                  ? source_value_pair_stream_kernel<NT, B, true, true, 8, true, true, true, true>
                  : source_value_pair_stream_kernel<NT, B, true, true, 4, true, true, true, true>,
              stream_smem<NT>(), B, nullptr, dv_out, partial, qg, ds);
          ds_to_pairs(ds);
          return;
        }
        auto lanes_a_head = [&](auto gc) {
          constexpr int GC = decltype(gc)::value;
          return g_pair_version >= 16
                     ? source_value_pair_stream_kernel<NT, B, true, true, GC, true, true, true>
                 : g_pair_version == 15
                     ? source_value_pair_stream_kernel<NT, B, true, true, GC, true, true>
                 : g_pair_version == 14
                     ? source_value_pair_stream_kernel<NT, B, true, true, GC, true>
                     : source_value_pair_stream_kernel<NT, B, true, true, GC>;
        };
        auto stream = with_lanes_a_head(g_pair_version >= 11, heads,
                                        source_value_pair_stream_kernel<NT, B, true, true>,
                                        lanes_a_head(std::integral_constant<int, 8>{}),
                                        lanes_a_head(std::integral_constant<int, 4>{}));
        launch_pair_stream(stream, stream_smem<NT>(), B, nullptr, dv_out, partial, qg);
        return;
      }
      // Two forms (the same bits), picked by the pair version: 3 blocks an SM with 2 sites
      // in flight (ptxas at d 1024's parts: 150 registers; 4 ahead spills 164 bytes), or
      // with pair version 6, 2 blocks and 4 sites (212 registers).
      auto kernel = g_pair_version == 6 ? source_value_pair_fused_kernel<NT, 2, kPairRing>
                                        : source_value_pair_fused_kernel<NT, 3, 2>;
      kernel<<<one_wave_blocks(kernel, N << fused_parts_log2), 32 * kWarpsPerBlock, 0, s>>>(
          dv_out, partial, weights.ptr<float>(), ubar.ptr<float>(), rows, x_in, v_in, older->v,
          inv_rms.ptr<float>(), older->inv_rms, qg, g, source, fused_parts_log2);
      CUDA_CHECK_LAUNCH();
    });
  } else if (pair_on_tensor_cores(g_pair_version) && pair_mma_applies(g.d, heads)) {
    PairMmaArgs pa{};
    pa.val = val;
    pa.partial = static_cast<float*>(ctx.scratch(ScratchSlot::RoutingBackTile, N * g.d * 4));
    // The older slot is source - block, as in the CUDA-core pair kernels.
    pa.w0 = weights.ptr<float>() + g.lay.pair(source, source) * g.H * N;
    pa.w1 = weights.ptr<float>() + g.lay.pair(source - g.lay.block, source) * g.H * N;
    pa.ubar_source = ubar.ptr<float>() + int64_t(source) * g.H * N;
    pa.x = x_in;
    pa.v0 = v_in;
    pa.v1 = older->v;
    pa.inv_rms0 = inv_rms.ptr<float>();
    pa.inv_rms1 = older->inv_rms;
    pa.N = N;
    pa.ns = ns;
    for (int i = 0; i < kPairMmaMaxSites; ++i) pa.dx[i] = i < ns ? rows.dx[source + i] : x_in;
    MHAR_CHECK(pair_mma(s, pa, g.d, heads, g_pair_version == 13, g_grid_cap), "CUDA ", what,
               ": pair version ", g_pair_version, " at d ", g.d, ", ", heads, " heads, ", ns,
               " sites");
  } else {
    auto* partial = static_cast<float*>(ctx.scratch(ScratchSlot::RoutingBackTile, N * g.d * 4));
    // Version 4's ring (3 blocks an SM, one wave) on whole rows or, versions 5-6, on row
    // parts where the row splits.
    auto pair_ring = [&](auto ntp, int parts_log2) {
      constexpr int NT = decltype(ntp)::value;
      auto kernel = source_value_pair_ring_span_kernel<NT, pair_blocks_per_sm(NT, 2), kPairRing>;
      kernel<<<one_wave_blocks(kernel, N << parts_log2), 32 * kWarpsPerBlock, 0, s>>>(
          val, partial, weights.ptr<float>(), ubar.ptr<float>(), rows, x_in, v_in, older->v,
          inv_rms.ptr<float>(), older->inv_rms, g, source, parts_log2);
      CUDA_CHECK_LAUNCH();
    };
    const int parts_log2 = parts_log2_for(g, pair_part_chunks(g_pair_version));
    if (parts_log2 > 0) {
      dispatch_part_span(g.d / 256 >> parts_log2, [&](auto ntp) { pair_ring(ntp, parts_log2); });
    } else
      dispatch_span(g, [&](auto nt) {
        constexpr int NT = decltype(nt)::value;
        if constexpr (NT <= kBackTileMaxNT) {
          if (g_pair_version >= 7) {  // rows staged in shared memory
            constexpr int B = pair_blocks_per_sm(NT, 2);
            if (g_pair_version >= 17 && lanes_a_head_constant(heads)) {
              float* ds = ds_scratch();
              launch_stream(s,
                            heads == 4 ? source_value_pair_lean_kernel<NT, B, 8>
                                       : source_value_pair_lean_kernel<NT, B, 4>,
                            stream_smem<NT>(), B, N, val, partial, weights.ptr<float>(),
                            ubar.ptr<float>(), ds, rows, x_in, v_in, older->v, inv_rms.ptr<float>(),
                            older->inv_rms, g, source);
              ds_to_pairs(ds);
              return;
            }
            auto stream = with_lanes_a_head(g_pair_version >= 11, heads,
                                            g_pair_version >= 8
                                                ? source_value_pair_stream_kernel<NT, B, true>
                                                : source_value_pair_stream_kernel<NT, B, false>,
                                            source_value_pair_stream_kernel<NT, B, true, false, 8>,
                                            source_value_pair_stream_kernel<NT, B, true, false, 4>);
            launch_pair_stream(stream, stream_smem<NT>(), B, val, nullptr, partial, nullptr);
            return;
          }
          if constexpr (NT <= kPairRingMaxNT) {  // wider rows: the ring spills (ptxas)
            if (g_pair_version >= 4 && g_pair_version <= 6) {
              pair_ring(nt, 0);
              return;
            }
          }
          // Versions 1-3: blocks per SM and grid by the version (see the kernel); >= 3: one
          // wave of the resident blocks.
          auto kernel = g_pair_version >= 2
                            ? source_value_pair_span_kernel<NT, pair_blocks_per_sm(NT, 2)>
                            : source_value_pair_span_kernel<NT, pair_blocks_per_sm(NT, 1)>;
          const int blocks = g_pair_version >= 3 ? one_wave_blocks(kernel, N) : token_blocks(N);
          kernel<<<blocks, 32 * kWarpsPerBlock, 0, s>>>(
              val, partial, weights.ptr<float>(), ubar.ptr<float>(), rows, x_in, v_in, older->v,
              inv_rms.ptr<float>(), older->inv_rms, g, source);
          CUDA_CHECK_LAUNCH();
        } else {
          MHAR_CHECK(false, "CUDA ", what, ": a backward depth tile at d = ", g.d);
        }
      });
  }
}

}  // namespace routing_detail
}  // namespace mhar::cuda
