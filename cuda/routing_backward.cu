// routing_backward.cu: routing_source_backward, routing_source_backward_tile and
// routing_delta_site_backward (backend.h): one slot's gradient from the input gradients of
// every later site (source-stationary), its value path and softmax backward in token
// kernels, its key path fused or by GEMM (its key gradients: routing_key_grads.cu); a
// backward depth tile's two slots in one pass over their sites (the pair kernels); the
// kernel lab's versions of each. Conventions: cuda/routing.cu.
#include <algorithm>

#include "cuda/routing_host.h"
#include "cuda/routing_pair_mma.h"

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
  extern __shared__ float smem[];
  float* scratch = smem + (threadIdx.x >> 5) * g.H;
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
      head_totals<NT, ALIGNED>(prod, ub, g, L, scratch);
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
      head_totals<NT, ALIGNED>(prod, u, g, L, scratch);
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

// ubar of site `source` for token n (span layout), from its input gradient dx (this
// lane's chunks, already loaded) and its input x: head h's sum of dx . x; the head's
// leader lane stores it in ubar's row `source`.
// G: the lanes a head, 32 / g.H (a caller that knows it at compile time passes it so, and
// head_sum's loop unrolls).
template <int NT>
__device__ __forceinline__ float span_ubar_row(float* ubar, const Row<NT>& dx, const Row<NT>& rx,
                                               const Geometry& g, int source, int64_t n, int G) {
  const int lane = threadIdx.x & 31, h = lane / G;
  const float ub = head_sum(lane_dot(dx, rx), G);
  if (lane % G == 0) ubar[(int64_t(source) * g.H + h) * g.N + n] = ub;
  return ub;
}
template <int NT>
__device__ __forceinline__ float span_ubar_row(float* ubar, const Row<NT>& dx, const Row<NT>& rx,
                                               const Geometry& g, int source, int64_t n) {
  return span_ubar_row(ubar, dx, rx, g, source, n, 32 / g.H);
}
template <int NT>
__device__ __forceinline__ float span_ubar(float* ubar, const Row<NT>& dx, const bf16* x,
                                           const Geometry& g, int source, int64_t n) {
  Row<NT> rx;
  load_span(rx, x + n * g.d);
  return span_ubar_row(ubar, dx, rx, g, source, n);
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

// This lane's chunks of a site's qg row.
template <int NT>
__device__ __forceinline__ void load_qg_row(float (&q)[NT][8], const float4* qrow) {
#pragma unroll
  for (int t = 0; t < NT; ++t) load_qg8(q[t], qrow, t);
}

// The key path of one site for one slot: acc += (r ds) qg_k, and with kRadial the slot's
// radial term ds (qg_k . v)[head] on the head's leader lane. qg_k: this lane's chunks, from
// qrow, or from q where they were loaded before (pair version 15).
// Without kRadial (pair version 16, value version 7) the radial sum comes from the
// accumulator instead, once a token (acc_dot, below). A slot's radial sum over its sites,
// sum_k sum_h ds_kh (qg_k . v)_h, is v . K with K = sum_k ds_k qg_k (by head), and the
// accumulator holds r K plus the value path sum_k a_k dx_k, whose dot with v is sum_k
// sum_h a_kh u_kh, u_kh = (dx_k . v)_h, which value_site and pair_site already form for
// ds. So radial = (v . acc - sum_k sum_h a_kh u_kh) / r: one dot a token where kRadial
// takes one a site (16 FMAs, a head sum and the leader's FMA a slot and site at d 512).
// The sums run in another order (and the subtraction cancels the value path's share: fp32
// rounding of order |v| |acc| / r, far below dv's bf16 rounding), so those versions are
// held to the CPU reference's bounds, not to the defaults' bits
// (routing_backward_sum_order); `radial` is left untouched.
template <bool kRadial, int NT, class RV, class Chunk>
__device__ __forceinline__ void key_site_chunks(float (&acc)[NT][8], float& radial, const RV& rv,
                                                Chunk&& chunk, float r, float ds, int G,
                                                bool leader) {
  [[maybe_unused]] float vq = 0.f;
  const float rds = r * ds;
#pragma unroll
  for (int t = 0; t < NT; ++t) {
    float q[8];
    chunk(t, q);
#pragma unroll
    for (int e = 0; e < 8; ++e) {
      if constexpr (kRadial) vq += q[e] * at(rv, t, e);
      acc[t][e] += rds * q[e];
    }
  }
  if constexpr (kRadial) {
    vq = head_sum(vq, G);
    if (leader) radial += ds * vq;
  }
}
template <bool kRadial = true, int NT, class RV>
__device__ __forceinline__ void key_site(float (&acc)[NT][8], float& radial, const RV& rv,
                                         const float4* qrow, float r, float ds, int G,
                                         bool leader) {
  key_site_chunks<kRadial>(
      acc, radial, rv, [&](int t, float(&q)[8]) { load_qg8(q, qrow, t); }, r, ds, G, leader);
}
template <bool kRadial = true, int NT, class RV>
__device__ __forceinline__ void key_site(float (&acc)[NT][8], float& radial, const RV& rv,
                                         const float (&q)[NT][8], float r, float ds, int G,
                                         bool leader) {
  key_site_chunks<kRadial>(
      acc, radial, rv,
      [&](int t, float(&c)[8]) {
#pragma unroll
        for (int e = 0; e < 8; ++e) c[e] = q[t][e];
      },
      r, ds, G, leader);
}

// This lane's share of v . acc (either row form).
template <int NT, class RV>
__device__ __forceinline__ float acc_dot(const float (&acc)[NT][8], const RV& rv) {
  float p = 0.f;
#pragma unroll
  for (int t = 0; t < NT; ++t)
#pragma unroll
    for (int e = 0; e < 8; ++e) p += acc[t][e] * at(rv, t, e);
  return p;
}

// The fused key path's last term: acc -= r^3/d radial v (radial: the whole row's sum of
// key_site's radial terms).
template <int NT, class RV>
__device__ __forceinline__ void subtract_radial(float (&acc)[NT][8], const RV& rv, float r,
                                                float radial, int64_t d) {
  const float scale = r * r * r / float(d) * radial;
#pragma unroll
  for (int t = 0; t < NT; ++t)
#pragma unroll
    for (int e = 0; e < 8; ++e) acc[t][e] -= scale * at(rv, t, e);
}

// One site k of a slot's value path, token n (span layout): acc += a_k dx_k, and the
// slot's logit gradient ds_k = a_k (u_k - ubar_k), u_k = head h's sum of dx_k . v. Every
// value kernel (plain, ring, pair) runs its sites through this, so they share the bits.
// u_out (the radial sum from the accumulator, value version 7): u_k itself.
template <int NT>
__device__ __forceinline__ float value_site(float (&acc)[NT][8], const Row<NT>& rdx,
                                            const Row<NT>& rv, float a, float ub, int G,
                                            float* u_out = nullptr) {
  float p = 0.f;
#pragma unroll
  for (int t = 0; t < NT; ++t)
#pragma unroll
    for (int e = 0; e < 8; ++e) {
      const float dxe = elem(rdx.raw[t], e);
      p += dxe * elem(rv.raw[t], e);
      acc[t][e] += a * dxe;
    }
  const float u = head_sum(p, G);
  if (u_out) *u_out = u;
  return a * (u - ub);
}

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
// The default is therefore by width (version 0: source_value_version): 7 (5 before the
// thirty-second session) where a lane holds the whole row in at most 2 chunks (d <= 512),
// 3 at 4 chunks (d 1024), 6 at 5 (d 1280), else 2.
// Whether a value version fuses every slot's key path (and the backward tiles' pair kernel
// then takes its fused form): 5 and 7.
constexpr bool value_fuses_every_slot(int version) { return version == 5 || version == 7; }
int source_value_version(int64_t d) {
  if (g_source_value_version > 0) return g_source_value_version;
  return d <= 512 ? 7 : d / 256 == 4 ? 3 : d / 256 == 5 ? 6 : 2;
}
// Sites in flight a warp (ptxas at 4 blocks an SM, <= 128 registers: no spills).
constexpr int value_ring(int NT) { return NT <= 2 ? 4 : 2; }
constexpr int kValueRingMaxNT = 3;  // NT 4 spills 200 bytes at 2 sites ahead (ptxas)

// Row parts: a token's row split over 2^parts_log2 consecutive warps, part p owning the
// features [p d / P, (p + 1) d / P) and with them the H / P whole heads from p H / P (span
// layout within the part: NT = d / (256 P) chunks a lane, G = 32 P / H lanes a head).
// Fewer chunks a lane leave the registers for a deeper ring of site rows (the value and
// pair kernels' rings): more bytes in flight where a whole row's registers would spill.
// parts_log2 = 0 is the whole row, as the span layout has it.
struct RowPart {
  int64_t n;    // the token
  int64_t off;  // the part's first feature
  int h, G;     // this lane's head, lanes a head
};
__device__ __forceinline__ RowPart row_part(int64_t warp, int parts_log2, int nt, int H) {
  const int p = int(warp & ((int64_t(1) << parts_log2) - 1)), Hp = H >> parts_log2;
  const int G = 32 / Hp;
  return {warp >> parts_log2, int64_t(p) * 256 * nt, p * Hp + int(threadIdx.x & 31) / G, G};
}

// ubar of site `source` for token rp.n, head rp.h (span_ubar_row on a row part).
template <int NT>
__device__ __forceinline__ float part_ubar(float* ubar, const Row<NT>& dx, const bf16* x,
                                           const Geometry& g, const RowPart& rp, int source) {
  Row<NT> rx;
  load_span(rx, x + rp.n * g.d + rp.off);
  const float ub = head_sum(lane_dot(dx, rx), rp.G);
  if ((threadIdx.x & 31) % rp.G == 0) ubar[(int64_t(source) * g.H + rp.h) * g.N + rp.n] = ub;
  return ub;
}

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

// The sum of one float per row part over a token's parts (consecutive warps of one block:
// 2^parts_log2 divides kWarpsPerBlock), in part order, for every lane. xch alternates
// between its two halves by the warp's token count (`round`), so one barrier per token
// suffices: a part cannot rewrite a half before its partners passed the barrier after
// reading it.
__device__ __forceinline__ float parts_sum(float v, float (*xch)[kWarpsPerBlock], int parts_log2,
                                           int round) {
  if (parts_log2 == 0) return v;
  const int warp = threadIdx.x >> 5, parts = 1 << parts_log2, first = warp & ~(parts - 1);
  float* half = xch[round & 1];
  if ((threadIdx.x & 31) == 0) half[warp] = v;
  // Named barrier 1 + (the token's slot in the block) over the token's 32 * parts threads.
  asm volatile("bar.sync %0, %1;" ::"r"(1 + warp / parts), "r"(32 * parts) : "memory");
  float s = 0.f;
  for (int p = 0; p < parts; ++p) s += half[first + p];
  return s;
}

// dv = acc - r^3/d radial v of a token's part (radial: the whole row's sum).
template <int NT, class RV>
__device__ __forceinline__ void store_fused_dv(bf16* dv, float (&acc)[NT][8], const RV& rv, float r,
                                               float radial, int d) {
  subtract_radial(acc, rv, r, radial, d);
  store_span(dv, acc);
}

// One token's row part (warp item wi) through a slot's value path on the ring: value_site
// per site, and with KEY the key path (key_site) and dv finished from the radial sum
// (xch: the block's exchange for parts_sum; round: this warp's token count); else the
// fp32 value row into val. Ring slot u holds site k = source + u (mod PF): its row,
// weight and ubar.
template <int NT, int PF, bool KEY, bool RADIAL = false>
__device__ __forceinline__ void value_ring_token(
    float* val, bf16* dv, float* weights, float* ubar, const SiteRows& site_dx, const bf16* x,
    const bf16* v, const float* inv_rms, const float* qg, const float* resume, const Geometry& g,
    int source, int last, int parts_log2, int64_t wi, float (*xch)[kWarpsPerBlock], int round) {
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
      // head_sum's shuffles synchronise the warp: every lane has used a_k (read PF
      // sites ago) before the leader overwrites it.
      if (leader) w_src[(k - source) * HN + n] = ds * r;
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

template <int NT, int PF>
__global__ void __launch_bounds__(32 * kWarpsPerBlock, span_blocks_per_sm(NT))
    source_value_ring_span_kernel(float* __restrict__ val, float* __restrict__ weights,
                                  float* __restrict__ ubar, const SiteRows site_dx,
                                  const bf16* __restrict__ x, const bf16* __restrict__ v,
                                  const float* __restrict__ inv_rms,
                                  const float* __restrict__ resume, const Geometry g, int source,
                                  int last, int parts_log2) {
  const int64_t warps = int64_t(gridDim.x) * (blockDim.x >> 5);
  for (int64_t wi = int64_t(blockIdx.x) * (blockDim.x >> 5) + (threadIdx.x >> 5);
       wi < (g.N << parts_log2); wi += warps)
    value_ring_token<NT, PF, false>(val, nullptr, weights, ubar, site_dx, x, v, inv_rms, nullptr,
                                    resume, g, source, last, parts_log2, wi, nullptr, 0);
}

template <int NT, int PF, bool RADIAL = false>
__global__ void __launch_bounds__(32 * kWarpsPerBlock, span_blocks_per_sm(NT))
    source_value_fused_ring_kernel(bf16* __restrict__ dv, float* __restrict__ weights,
                                   float* __restrict__ ubar, const SiteRows site_dx,
                                   const bf16* __restrict__ x, const bf16* __restrict__ v,
                                   const float* __restrict__ inv_rms, const float* __restrict__ qg,
                                   const float* __restrict__ resume, const Geometry g, int source,
                                   int last, int parts_log2) {
  __shared__ float xch[2][kWarpsPerBlock];
  const int64_t warps = int64_t(gridDim.x) * (blockDim.x >> 5);
  int round = 0;
  for (int64_t wi = int64_t(blockIdx.x) * (blockDim.x >> 5) + (threadIdx.x >> 5);
       wi < (g.N << parts_log2); wi += warps, ++round)
    value_ring_token<NT, PF, true, RADIAL>(nullptr, dv, weights, ubar, site_dx, x, v, inv_rms, qg,
                                           resume, g, source, last, parts_log2, wi, xch, round);
}

// One site k of both slots of a backward tile, token n: value_site for each slot from the
// one dx_k row, each accumulator's operations in value_site's order (written out, not two
// value_site calls, so that each dx_k element is unpacked once: the pair kernels are
// register-bound).
template <int NT, class RV>
__device__ __forceinline__ void pair_site(float (&acc0)[NT][8], float (&acc1)[NT][8], float& ds0,
                                          float& ds1, const Row<NT>& rdx, const RV& rv0,
                                          const RV& rv1, float a0, float a1, float ub, int G,
                                          float* u0 = nullptr, float* u1 = nullptr) {
  float p0 = 0.f, p1 = 0.f;
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
constexpr int kBackTileMaxNT = 5;  // d <= 1280: 234 registers, no spills (NT 6: 239; 7, 8 spill)
constexpr int pair_blocks_per_sm(int NT, int version) { return version >= 2 && NT <= 4 ? 3 : 2; }
constexpr bool pair_on_tensor_cores(int version) { return version == 12 || version == 13; }
// The lanes a head G = 32 / H as a compile-time constant (pair version 11 on, value
// version 7): H 4 or 8, the paper shapes (with_lanes_a_head).
constexpr bool lanes_a_head_constant(int heads) { return heads == 4 || heads == 8; }
// Whether a fused pair tile of whole rows (fused parts 0) runs version 16's stream kernel,
// whose radial sums come at the end in their own order (routing_backward_sum_order).
constexpr bool pair_sums_radial_at_end(int version, int fused_parts_log2, int heads) {
  return version == 16 && fused_parts_log2 == 0 && lanes_a_head_constant(heads);
}
constexpr int kPairRing = 4;
constexpr int kPairRingMaxNT = 2;
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

// ---------------------------------------------------------------- pair kernel, streamed
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
template <int NT>
struct StreamSlot {  // one item of a stream kernel's ring: a row, three scalars
  uint4 row[NT * 32];
  float scalar[3][32];
};
constexpr int stream_slots(int NT) { return NT <= 4 ? 7 : 9; }
template <int NT>
constexpr size_t stream_smem() {
  return size_t(kWarpsPerBlock) * stream_slots(NT) * sizeof(StreamSlot<NT>);
}
// The shared-memory carveout, in percent of sm_90's 228 KiB, of the smallest capacity it
// offers that holds `blocks` blocks of `smem` bytes (plus the 1 KiB a block the system
// reserves): the rest stays L1. At d 1024 and 1280 that is all 228 KiB; at d 512, 132.
int stream_carveout(size_t smem, int blocks) {
  const size_t need = size_t(blocks) * (smem + 1024);
  for (int kib : {0, 8, 16, 32, 64, 100, 132, 164, 196})
    if (size_t(kib) * 1024 >= need) return (100 * kib + 227) / 228;
  return 100;
}
// Version 8's position of chunk c of a row: c XOR (c / 8 mod NT) where NT is a power of two,
// so that the 8 lanes of a 16-byte shared load (chunks NT l + t) hit 8 distinct bank
// groups; odd NT (3, 5, 7) are conflict-free unswizzled; NT 6 has 2-way conflicts.
template <int NT>
__device__ __forceinline__ int stream_pos(int c) {
  return (NT & (NT - 1)) == 0 ? c ^ ((c >> 3) & (NT - 1)) : c;
}

// cp.async for the stream kernels. attention_mma.cuh has 16-byte .cg, commit and wait
// twins without "memory" clobbers (the attention kernels order them by __syncthreads);
// here each one must also keep the compiler from moving a slot's shared-memory reads
// across its refill or its wait, and version 7 has no barrier. One set for both is left
// for a session that can time the attention kernels with the clobbers.
__device__ __forceinline__ void cp_async_ca(void* dst, const void* src, int bytes16or4) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  if (bytes16or4 == 16)
    asm volatile("cp.async.ca.shared.global [%0], [%1], 16;" ::"r"(smem_addr(dst)), "l"(src)
                 : "memory");
  else
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4;" ::"r"(smem_addr(dst)), "l"(src)
                 : "memory");
#else
  __trap();
#endif
}
__device__ __forceinline__ void cp_async_cg16(void* dst, const void* src) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(smem_addr(dst)), "l"(src)
               : "memory");
#else
  __trap();
#endif
}
__device__ __forceinline__ void cp_async_group() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile("cp.async.commit_group;" ::: "memory");
#endif
}
template <int N>
__device__ __forceinline__ void cp_async_wait_groups() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile("cp.async.wait_group %0;" ::"n"(N) : "memory");
#endif
}

// A warp's ring of R slots in shared memory, filled one cp.async group an item by the
// kernel's `issue(slot)` (which copies the next item of its stream into the slot, or nothing
// past the stream's end), R - 1 items ahead of the consumer.
template <int NT, int R, bool SYNC>
struct SlotRing {
  StreamSlot<NT>* slots;
  int fill = 0, next = 0;
  template <class Issue>
  __device__ __forceinline__ void refill(Issue& issue) {
    issue(slots[fill]);
    cp_async_group();  // one group an item, empty past the end: the waits count items
    if (++fill == R) fill = 0;
  }
  // The next item's slot, once the copies into it have landed (SYNC: every lane's, hence
  // the warp barrier, which also orders every lane's reads of the slot taken before it
  // ahead of its refill here; else each lane waits for its own copies only). The slot
  // taken before it, whose values were all read out then, is refilled.
  template <class Issue>
  __device__ __forceinline__ const StreamSlot<NT>& take(Issue& issue) {
    cp_async_wait_groups<R - 2>();
    if constexpr (SYNC) __syncwarp();
    refill(issue);
    const StreamSlot<NT>& slot = slots[next];
    if (++next == R) next = 0;
    return slot;
  }
  __device__ __forceinline__ const StreamSlot<NT>& taken() const {
    return slots[next == 0 ? R - 1 : next - 1];
  }
};

// Version 8's copy of NT * 32 chunks (a bf16 row, or half an fp32 row) into a slot: lane l
// copies chunks l + 32 u, whole sectors, at their stream_pos.
template <int NT>
__device__ __forceinline__ void copy_chunks_async(StreamSlot<NT>& slot, const uint4* src) {
  const int lane = threadIdx.x & 31;
#pragma unroll
  for (int u = 0; u < NT; ++u)
    cp_async_cg16(&slot.row[stream_pos<NT>(lane + 32 * u)], src + lane + 32 * u);
}
// This lane's span (chunks NT lane + t) of a row that copy_chunks_async staged.
template <int NT>
__device__ __forceinline__ void slot_span(const StreamSlot<NT>& slot, Row<NT>& r) {
  const int lane = threadIdx.x & 31;
#pragma unroll
  for (int t = 0; t < NT; ++t) r.raw[t] = slot.row[stream_pos<NT>(lane * NT + t)];
}

template <int NT, int MIN_BLOCKS, bool COALESCED, bool KEY = false, int GC = 0, bool F32 = false,
          bool QAHEAD = false, bool RADIAL = false>
__global__ void __launch_bounds__(32 * kWarpsPerBlock, MIN_BLOCKS)
    source_value_pair_stream_kernel(float* __restrict__ val, bf16* __restrict__ dv0,
                                    float* __restrict__ partial, float* __restrict__ weights,
                                    float* __restrict__ ubar, const SiteRows site_dx,
                                    const bf16* __restrict__ x, const bf16* __restrict__ v0,
                                    const bf16* __restrict__ v1, const float* __restrict__ inv_rms0,
                                    const float* __restrict__ inv_rms1,
                                    const float* __restrict__ qg, const Geometry g, int source) {
  static_assert(!KEY || COALESCED, "the fused form is version 9: version 8's copies");
  static_assert(GC == 0 || (COALESCED && GC <= 32 && (GC & (GC - 1)) == 0),
                "version 11: version 8's copies, G a power of two");
  static_assert(!F32 || (KEY && GC > 0), "version 14 is version 11's fused form");
  static_assert(!QAHEAD || F32, "version 15 is version 14 with qg one site ahead");
  static_assert(!RADIAL || QAHEAD, "version 16 is version 15 with the radial sums at the end");
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
    const bf16* src = ci == 0 ? v0 : ci == 1 ? v1 : ci == 2 ? x : site_dx.dx[source + ci - 3];
    const uint4* p = reinterpret_cast<const uint4*>(src + cn * g.d);
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
    {
      const StreamSlot<NT>& s0 = ring.take(issue);
      row_of(s0, rv0);
      r0 = s0.scalar[0][rs], r1 = s0.scalar[1][rs];
    }
    row_of(ring.take(issue), rv1);
    float ub;
    {
      Row<NT> rx;
      row_of(ring.take(issue), rx);
      row_of(ring.take(issue), rdx);
      ub = span_ubar_row(ubar, rdx, rx, g, source, n, G);
    }
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
      float* w0h = w0 + int64_t(h) * g.N;
      float* w1h = w1 + int64_t(h) * g.N;
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
        // The shuffles synchronise the warp: no lane still needs the weights overwritten here.
        const int64_t off = (k - source) * HN + n;
        if (leader) w0h[off] = ds0 * r0, w1h[off] = ds1 * r1;
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

// token_blocks(warps) capped at the blocks of `kernel` that are resident at once: a grid of
// one wave (a last, partial wave would leave most SMs idle at its end; the pair kernels).
// routing_set_grid_cap (tests) caps it further.
template <class K>
int one_wave_blocks(K kernel, int64_t warps, size_t smem = 0) {
  const int64_t blocks = std::min<int64_t>(
      token_blocks(warps),
      int64_t(sm_count()) * resident_blocks_per_sm(kernel, 32 * kWarpsPerBlock, smem));
  return int(g_grid_cap > 0 ? std::min<int64_t>(blocks, g_grid_cap) : blocks);
}

// A stream kernel (source_value_pair_stream_kernel, source_value_stream_kernel) on a grid
// of one wave of the blocks that fit beside `smem` bytes each, `blocks_per_sm` of them
// with the carveout they need.
template <class K, class... Args>
void launch_stream(cudaStream_t s, K kernel, size_t smem, int blocks_per_sm, int64_t warps,
                   Args... args) {
  allow_smem(kernel, smem);
  CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributePreferredSharedMemoryCarveout,
                                  stream_carveout(smem, blocks_per_sm)));
  const int blocks = one_wave_blocks(kernel, warps, smem);
  kernel<<<blocks, 32 * kWarpsPerBlock, smem, s>>>(args...);
  CUDA_CHECK_LAUNCH();
}

// A whole-row span kernel in one of three instantiations: with the lanes a head G = 32 / H
// as a compile-time constant where `constant` (pair version 11) and H is 4
// or 8 (G 8 or 4: the paper shapes), else `runtime`, whose G is 32 / g.H at run time.
template <class K>
K with_lanes_a_head(bool constant, int heads, K runtime, K g8, K g4) {
  if (!constant || !lanes_a_head_constant(heads)) return runtime;
  return heads == 4 ? g8 : g4;
}

// log2 of the row parts (RowPart) of at most `chunks` chunks a lane that split the span
// geometry g's row and heads evenly; -1 where none do (1B's d 1280: 5 chunks a lane).
int row_parts_log2(const Geometry& g, int chunks) {
  const int nt = g.d / 256;
  int parts_log2 = 0;
  while ((nt >> parts_log2) > chunks) ++parts_log2;
  const int parts = 1 << parts_log2;
  return nt % parts == 0 && g.H % parts == 0 ? parts_log2 : -1;
}

// The row parts' chunks a lane that each lab version asks for (0: whole rows): value
// versions 3, 5 and 7 at most 2, 4 at most 1; pair versions 5 at most 2, 6 at most 1.
int value_part_chunks(int version) {
  return version == 3 || version == 5 || version == 7 ? 2 : version == 4 ? 1 : 0;
}
int pair_part_chunks(int version) { return version == 5 ? 2 : version == 6 ? 1 : 0; }
// row_parts_log2 for `chunks` (0: the whole row, log2 0).
int parts_log2_for(const Geometry& g, int chunks) { return chunks ? row_parts_log2(g, chunks) : 0; }

// Calls f(std::integral_constant<int, NT>) for a row part's chunks a lane (1 or 2).
template <class F>
void dispatch_part_span(int nt, F&& f) {
  MHAR_CHECK(nt == 1 || nt == 2, "CUDA routing: row parts of ", nt, " chunks a lane");
  if (nt == 1)
    f(std::integral_constant<int, 1>{});
  else
    f(std::integral_constant<int, 2>{});
}

// The older slot of a backward depth tile that starts at `source` (the pair kernel).
struct TileSlot {
  const bf16* v = nullptr;
  const float* inv_rms = nullptr;
};

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
  const int value_version = source_value_version(g.d);
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
  // Pair versions 7-11 (source_value_pair_stream_kernel).
  auto launch_pair_stream = [&](auto kernel, size_t smem, int blocks_per_sm, float* val_out,
                                bf16* dv0, float* partial, const float* key_qg) {
    launch_stream(s, kernel, smem, blocks_per_sm, N, val_out, dv0, partial, weights.ptr<float>(),
                  ubar.ptr<float>(), rows, x_in, v_in, older->v, inv_rms.ptr<float>(),
                  older->inv_rms, key_qg, g, source);
  };
  if (older && ring_fused) {
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
        // radial sums at the end (with the constant lanes a head: pair_sums_radial_at_end).
        auto lanes_a_head = [&](auto gc) {
          constexpr int GC = decltype(gc)::value;
          return g_pair_version == 16
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
  } else if (older && pair_on_tensor_cores(g_pair_version) && pair_mma_applies(g.d, heads)) {
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
  } else if (older) {
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
  } else if (span_layout(g)) {
    const float* resume =
        resume_last >= 0 ? static_cast<const float*>(ctx.scratch(ScratchSlot::RoutingBackTile, 0))
                         : nullptr;
    const int last = resume_last >= 0 ? resume_last : layout.last_site(source);
    auto value_ring_kernel = [&](auto ntp, int parts_log2) {
      constexpr int NT = decltype(ntp)::value;
      source_value_ring_span_kernel<NT, value_ring(NT)>
          <<<token_blocks(N << parts_log2), 32 * kWarpsPerBlock, 0, s>>>(
              val, weights.ptr<float>(), ubar.ptr<float>(), rows, x_in, v_in, inv_rms.ptr<float>(),
              resume, g, source, last, parts_log2);
      CUDA_CHECK_LAUNCH();
    };
    // Versions 3-4: the ring on row parts, where the row splits.
    const int parts_log2 =
        !fused && !delta ? parts_log2_for(g, value_part_chunks(value_version)) : 0;
    if (ring_fused) {
      dispatch_part_span(g.d / 256 >> fused_parts_log2, [&](auto ntp) {
        constexpr int NT = decltype(ntp)::value;
        auto kernel = value_version == 7 ? source_value_fused_ring_kernel<NT, value_ring(NT), true>
                                         : source_value_fused_ring_kernel<NT, value_ring(NT)>;
        kernel<<<token_blocks(N << fused_parts_log2), 32 * kWarpsPerBlock, 0, s>>>(
            dv_out, weights.ptr<float>(), ubar.ptr<float>(), rows, x_in, v_in, inv_rms.ptr<float>(),
            qg, resume, g, source, last, fused_parts_log2);
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
    if (delta) delta_add_partials(s, dalpha, delta->partial, token_blocks(N));
  } else {
    MHAR_CHECK(resume_last < 0, "CUDA ", what, ": a backward depth tile outside the span layout");
    const size_t smem = sizeof(float) * kWarpsPerBlock * heads;
    dispatch_rows(g, [&](auto nt, auto al) {
      auto kernel = source_value_kernel<decltype(nt)::value, decltype(al)::value>;
      allow_smem(kernel, smem);
      kernel<<<token_blocks(N), 32 * kWarpsPerBlock, smem, s>>>(val, weights.ptr<float>(),
                                                                ubar.ptr<float>(), rows, x_in, v_in,
                                                                inv_rms.ptr<float>(), g, source);
      CUDA_CHECK_LAUNCH();
    });
  }
  if (!fused) {
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
  if (!span_layout(d, heads) || d > 256 * kMaxNT) return key_grads;
  Geometry g{};
  g.d = int(d);
  g.H = heads;
  auto lane_chunks = [&](int parts_log2) { return g.d / 256 >> std::max(parts_log2, 0); };
  const int value = source_value_version(d);
  const int value_parts = parts_log2_for(g, value_part_chunks(value));
  if (value_fuses_every_slot(value) && value_parts >= 0) {  // every slot fused, the pair's form too
    // The radial sums at the end (key_site_chunks): value version 7's plain calls, pair
    // version 16's stream kernel (whole rows).
    return key_grads + 256 + lane_chunks(value_parts) + (value == 7 ? 4096 : 0) +
           (pair_sums_radial_at_end(g_pair_version, value_parts, heads) ? 8192 : 0);
  }
  const int pair_mma_order =
      pair_on_tensor_cores(g_pair_version) && pair_mma_applies(g.d, heads) ? 2048 : 0;
  return key_grads + pair_mma_order +
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
