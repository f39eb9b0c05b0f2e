// routing_rows.cuh: the routing kernels' shared device code (cuda/routing.cu has the
// overview): the launch geometry and per-site tables that travel as kernel parameters, a
// token's row as a warp's 16-byte chunks in either layout (interleaved, or the span
// layout of the model widths), the online softmax, the per-head sums, and the per-token
// bodies that two ops share (the mix of one site, the logits of one slot: the routing
// kernels and the fused delta forward run the same code, so the same bits).
// Namespace routing_detail; every kernel stays in its own file's anonymous namespace.
#pragma once

#include "cuda/common.cuh"
#include "cuda/kernels.h"

namespace mhar::cuda::routing_detail {

constexpr int kMaxNT = 8;          // d <= 2048
constexpr int kMaxSites = 256;     // per-site pointer tables travel as kernel parameters
constexpr int kWarpsPerBlock = 4;  // small blocks: ~130-255 registers per thread

struct SiteParams {
  const bf16* q[kMaxSites];
  const bf16* g[kMaxSites];
};
struct SiteGrads {
  float* dq[kMaxSites];
  float* dg[kMaxSites];
};
struct SiteRows {  // the input gradient [N, d] of every site (the model plans each apart)
  const bf16* dx[kMaxSites];
};

struct Geometry {  // of one launch, uniform over the grid
  int64_t N;
  int d, H, dh;
  int nchunks;        // d / 8
  RoutingLayout lay;  // which slots each site reads (backend.h)
};

// ---------------------------------------------------------------- row chunks
template <int NT>
struct Row {  // one token's row, as this lane's chunks (bf16x8 each)
  uint4 raw[NT];
};

template <int NT>
__device__ __forceinline__ void load_row(Row<NT>& r, const bf16* row, int nchunks) {
  const int lane = threadIdx.x & 31;
  const uint4* p = reinterpret_cast<const uint4*>(row);
#pragma unroll
  for (int t = 0; t < NT; ++t) {
    const int ch = lane + 32 * t;
    r.raw[t] = ch < nchunks ? p[ch] : make_uint4(0, 0, 0, 0);
  }
}

__device__ __forceinline__ float elem(const uint4& raw, int e) {
  const uint32_t w = e < 2 ? raw.x : e < 4 ? raw.y : e < 6 ? raw.z : raw.w;
  const uint32_t bits = (e & 1) ? (w & 0xffff0000u) : (w << 16);
  return __uint_as_float(bits);
}

// A row's chunks widened to fp32 once (pair version 14's slot rows); at() reads either
// form, so a site helper written with it gives the same bits from both.
template <int NT>
struct RowF32 {
  float f[NT][8];
};
template <int NT>
__device__ __forceinline__ float at(const Row<NT>& r, int t, int e) {
  return elem(r.raw[t], e);
}
template <int NT>
__device__ __forceinline__ float at(const RowF32<NT>& r, int t, int e) {
  return r.f[t][e];
}
// r in fp32, each value passed through an empty asm: opaque to the compiler, which then
// keeps them in registers instead of re-deriving them from the bf16 words at every use
// (it sinks plain unpacks back into the loops that read them).
template <int NT>
__device__ __forceinline__ RowF32<NT> unpacked(const Row<NT>& r) {
  RowF32<NT> u;
#pragma unroll
  for (int t = 0; t < NT; ++t)
#pragma unroll
    for (int e = 0; e < 8; ++e) {
      u.f[t][e] = elem(r.raw[t], e);
      asm volatile("" : "+f"(u.f[t][e]));
    }
  return u;
}

// This lane's share of the dot product of two rows it holds (either layout): the sum over
// its chunks, in chunk and element order, of a * b.
template <int NT>
__device__ __forceinline__ float lane_dot(const Row<NT>& a, const Row<NT>& b) {
  float p = 0.f;
#pragma unroll
  for (int t = 0; t < NT; ++t)
#pragma unroll
    for (int e = 0; e < 8; ++e) p += elem(a.raw[t], e) * elem(b.raw[t], e);
  return p;
}

__device__ __forceinline__ uint32_t pack2(float lo, float hi) {
  const __nv_bfloat162 b = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<const uint32_t*>(&b);
}

// One 16-byte chunk of 8 values: as bf16 (round to nearest), or as fp32 (two float4).
// (common.cuh's pack8 computes the same values, but kernels compiled with it order their
// instructions otherwise: this one stays, so that the routing kernels keep their PTX.)
__device__ __forceinline__ uint4 pack8(const float (&f)[8]) {
  return make_uint4(pack2(f[0], f[1]), pack2(f[2], f[3]), pack2(f[4], f[5]), pack2(f[6], f[7]));
}
__device__ __forceinline__ void store8_f32(float4* p, const float (&f)[8]) {
  p[0] = make_float4(f[0], f[1], f[2], f[3]);
  p[1] = make_float4(f[4], f[5], f[6], f[7]);
}

// Online softmax statistics (max m, sum l of e^(s - m)) over the logits seen so far,
// from m = -inf, l = 0.
__device__ __forceinline__ void online_add(float& m, float& l, float s) {
  if (s > m)
    l = l * __expf(m - s) + 1.f, m = s;  // exp(-inf) = 0 on the first
  else
    l += __expf(s - m);
}
// online_add of this lane's logits logit(i), i = first, first + G, ... < end, in that
// order, loaded kStatsBatch at a time: online_add's branch ends a basic block, so a plain
// loop issues each load only after the previous logit's branch (one round trip each).
constexpr int kStatsBatch = 4;
template <class Logit>
__device__ __forceinline__ void online_add_strided(float& m, float& l, Logit&& logit, int first,
                                                   int end, int G) {
  for (int i0 = first; i0 < end; i0 += kStatsBatch * G) {
    float s[kStatsBatch];
#pragma unroll
    for (int u = 0; u < kStatsBatch; ++u)
      if (i0 + u * G < end) s[u] = *logit(i0 + u * G);
#pragma unroll
    for (int u = 0; u < kStatsBatch; ++u)
      if (i0 + u * G < end) online_add(m, l, s[u]);
  }
}
// Merges state (m2, l2) into (m, l); a state that saw no logit (m = -inf) adds nothing.
// Symmetric: merging (m, l) into (m2, l2) gives the same bits (the two terms commute).
__device__ __forceinline__ void online_merge(float& m, float& l, float m2, float l2) {
  const float M = fmaxf(m, m2);  // finite once one of the two states saw a logit
  l = (m == -INFINITY ? 0.f : l * __expf(m - M)) + (m2 == -INFINITY ? 0.f : l2 * __expf(m2 - M));
  m = M;
}
// Merges the states of each run of G lanes (G a power of two) by xor shuffles.
__device__ __forceinline__ void online_merge_lanes(float& m, float& l, int G) {
  for (int o = G >> 1; o > 0; o >>= 1) {
    const float m2 = __shfl_xor_sync(0xffffffffu, m, o), l2 = __shfl_xor_sync(0xffffffffu, l, o);
    online_merge(m, l, m2, l2);
  }
}
// Every weight logit(i), i = first, first + step, ... < end, replaced in place by
// exp(w - mx) * linv; B weights loaded before any of them is rewritten (the compiler cannot
// move a load above the previous weight's store, so one at a time waits a round trip each).
template <int B, class Logit>
__device__ __forceinline__ void normalise_strided(Logit&& logit, int first, int end, int step,
                                                  float mx, float linv) {
  for (int i0 = first; i0 < end; i0 += B * step) {
    float v[B];
#pragma unroll
    for (int u = 0; u < B; ++u)
      if (i0 + u * step < end) v[u] = *logit(i0 + u * step);
#pragma unroll
    for (int u = 0; u < B; ++u)
      if (i0 + u * step < end) *logit(i0 + u * step) = __expf(v[u] - mx) * linv;
  }
}

template <int NT>
__device__ __forceinline__ void store_row(bf16* row, const float (&f)[NT][8], int nchunks) {
  const int lane = threadIdx.x & 31;
  uint4* p = reinterpret_cast<uint4*>(row);
#pragma unroll
  for (int t = 0; t < NT; ++t) {
    const int ch = lane + 32 * t;
    if (ch < nchunks) p[ch] = pack8(f[t]);
  }
}

// ---------------------------------------------------------------- per-head sums
// Where this lane's chunks sit among the heads, computed once per thread: integer
// division by the runtime head size costs ~20 instructions, so it stays out of the token
// loops. Used by the ALIGNED path (every chunk inside one head).
template <int NT>
struct LaneHeads {
  int head[NT];            // head of the chunk in row t; -1 when the chunk is past d
  int seg_end[NT];         // last lane of this head's run of lanes in row t
  uint32_t scan[NT];       // bit b: lane - 2^b holds the same head (segmented scan step b)
  uint32_t from_prev[NT];  // bit u < t: the head's run in row u ends at lane 31
  uint32_t from_next[NT];  // bit u > t: the head's run in row u starts at lane 0
  uint32_t leader;         // bit t: the chunk in row t is its head's first
};

template <int NT>
__device__ __forceinline__ LaneHeads<NT> lane_heads(const Geometry& g) {
  const int lane = threadIdx.x & 31;
  const int cph = max(g.dh / 8, 1);  // chunks per head (ALIGNED)
  auto head_of = [&](int ch) { return ch >= 0 && ch < g.nchunks ? ch / cph : -1; };
  LaneHeads<NT> L;
  L.leader = 0;
#pragma unroll
  for (int t = 0; t < NT; ++t) {
    const int ch = lane + 32 * t, h = head_of(ch);
    L.head[t] = h;
    L.seg_end[t] = h < 0 ? 31 : min((h + 1) * cph - 1 - 32 * t, 31);
    L.scan[t] = L.from_prev[t] = L.from_next[t] = 0;
    if (h < 0) continue;
    for (int b = 0; b < 5; ++b)
      if (lane >= (1 << b) && head_of(ch - (1 << b)) == h) L.scan[t] |= 1u << b;
    for (int u = 0; u < NT; ++u) {
      if (u < t && head_of(31 + 32 * u) == h) L.from_prev[t] |= 1u << u;
      if (u > t && head_of(32 * u) == h) L.from_next[t] |= 1u << u;
    }
    if (ch % cph == 0) L.leader |= 1u << t;
  }
  return L;
}

// tot = sum of val over the head of feature 8*(lane + 32t) + e, for every valid feature
// (per chunk when ALIGNED, per feature otherwise). ALIGNED: the chunks' sums go through a
// segmented inclusive scan per row (heads are runs of lanes), then heads that span rows
// add their parts from the neighbouring rows. Otherwise head by head: each lane adds its
// features of the head in feature order, then warp_sum's fixed butterfly adds the lanes.
// Both orders are fixed, so the same bits every run. (The unaligned form added each
// feature into shared memory by atomics until the forty-first session: an order that
// varied from run to run.)
// Per-head values of this lane's features: one per chunk when ALIGNED, else one per
// feature (hv() reads either).
template <bool ALIGNED>
constexpr int kHeadVals = ALIGNED ? 1 : 8;
template <bool ALIGNED, int NT>
__device__ __forceinline__ float hv(const float (&a)[NT][kHeadVals<ALIGNED>], int t, int e) {
  return a[t][ALIGNED ? 0 : e];
}

template <int NT, bool ALIGNED>
__device__ __forceinline__ void head_totals(const float (&val)[NT][8],
                                            float (&tot)[NT][kHeadVals<ALIGNED>], const Geometry& g,
                                            const LaneHeads<NT>& L) {
  const int lane = threadIdx.x & 31;
  if constexpr (ALIGNED) {
    float row_tot[NT], row_last[NT], row_first[NT];
#pragma unroll
    for (int t = 0; t < NT; ++t) {
      float x = 0.f;
#pragma unroll
      for (int e = 0; e < 8; ++e) x += val[t][e];
#pragma unroll
      for (int b = 0; b < 5; ++b) {
        const float y = __shfl_up_sync(0xffffffffu, x, 1 << b);
        if (L.scan[t] & (1u << b)) x += y;
      }
      row_tot[t] = __shfl_sync(0xffffffffu, x, L.seg_end[t]);
      row_last[t] = __shfl_sync(0xffffffffu, x, 31);
    }
#pragma unroll
    for (int u = 0; u < NT; ++u) row_first[u] = __shfl_sync(0xffffffffu, row_tot[u], 0);
#pragma unroll
    for (int t = 0; t < NT; ++t) {
      float total = row_tot[t];
#pragma unroll
      for (int u = 0; u < NT; ++u) {
        if (L.from_prev[t] & (1u << u)) total += row_last[u];
        if (L.from_next[t] & (1u << u)) total += row_first[u];
      }
      tot[t][0] = total;
    }
  } else {
#pragma unroll
    for (int t = 0; t < NT; ++t)
#pragma unroll
      for (int e = 0; e < 8; ++e) tot[t][e] = 0.f;
    // f(t, e) for each of this lane's valid features in [lo, hi), in feature order.
    auto each_in = [&](int lo, int hi, auto&& f) {
#pragma unroll
      for (int t = 0; t < NT; ++t) {
        const int f0 = 8 * (lane + 32 * t);
        if (lane + 32 * t < g.nchunks)
#pragma unroll
          for (int e = 0; e < 8; ++e)
            if (f0 + e >= lo && f0 + e < hi) f(t, e);
      }
    };
    for (int h = 0; h < g.H; ++h) {
      const int lo = h * g.dh, hi = lo + g.dh;  // the head's features
      float part = 0.f;
      each_in(lo, hi, [&](int t, int e) { part += val[t][e]; });
      const float total = warp_sum(part);
      each_in(lo, hi, [&](int t, int e) { tot[t][e] = total; });
    }
  }
}

// Calls f(t, e, h) for every valid feature that is the first of its head h: the lane that
// writes a per-head value.
template <int NT, bool ALIGNED, class F>
__device__ __forceinline__ void for_head_leaders(const Geometry& g, const LaneHeads<NT>& L, F&& f) {
  const int lane = threadIdx.x & 31;
#pragma unroll
  for (int t = 0; t < NT; ++t) {
    if constexpr (ALIGNED) {
      if (L.leader & (1u << t)) f(t, 0, L.head[t]);
    } else {
      const int ch = lane + 32 * t;
      if (ch >= g.nchunks) continue;
#pragma unroll
      for (int e = 0; e < 8; ++e)
        if ((8 * ch + e) % g.dh == 0) f(t, e, (8 * ch + e) / g.dh);
    }
  }
}

// out = base[head(feature) * N] (a per-head value of this token; base already
// points at element [h = 0][n]). Invalid chunks get 0.
template <int NT, bool ALIGNED>
__device__ __forceinline__ void load_per_head(float (&out)[NT][kHeadVals<ALIGNED>],
                                              const float* base, const Geometry& g,
                                              const LaneHeads<NT>& L) {
  const int lane = threadIdx.x & 31;
#pragma unroll
  for (int t = 0; t < NT; ++t) {
    if constexpr (ALIGNED) {
      out[t][0] = L.head[t] >= 0 ? base[int64_t(L.head[t]) * g.N] : 0.f;
    } else {
      const int ch = lane + 32 * t;
#pragma unroll
      for (int e = 0; e < 8; ++e)
        out[t][e] = ch < g.nchunks ? base[int64_t((8 * ch + e) / g.dh) * g.N] : 0.f;
    }
  }
}

// x as bf16 hi + lo parts: hi = bf16(x), lo = bf16(x - hi) (x to ~2^-17 relative).
__device__ __forceinline__ void split_bf16(float x, bf16& hi, bf16& lo) {
  const bf16 h = __float2bfloat16_rn(x);
  hi = h;
  lo = __float2bfloat16_rn(x - __bfloat162float(h));
}

// ---------------------------------------------------------------- span layout
// The model widths' fast path. When d % 256 == 0 and H divides 32, lane l owns the
// contiguous features [8 NT l, 8 NT (l+1)) (NT = d / 256 chunks of 8) and head h is
// exactly the G = 32 / H lanes [G h, G (h+1)): a per-head sum is the lane's own sum plus
// log2(G) xor shuffles, and a lane holds one per-head value (its head's), where the
// interleaved layout above keeps per-chunk head tables and a segmented scan (~200
// registers at d = 1280, which spilled and left a few warps per SM). A warp's load
// instruction reads 16-byte pieces at a stride of 16 NT bytes; the row's bytes still
// come from DRAM once (the other pieces of each sector are the lane's next loads, from L1).
// At least 4 blocks (16 warps) per SM up to d = 1280: <= 128 registers, so that enough
// rows are in flight (unbounded, the compiler keeps v unpacked in fp32: 156 registers at
// d = 1280). Wider rows need more: 2 blocks (<= 255 registers) there, which do not spill.
constexpr int span_blocks_per_sm(int NT) { return NT <= 5 ? 4 : 2; }

inline bool span_layout(int64_t d, int heads) {
  return d % 256 == 0 && heads >= 1 && 32 % heads == 0;
}
inline bool span_layout(const Geometry& g) { return span_layout(g.d, g.H); }

template <int NT>
__device__ __forceinline__ void load_span(Row<NT>& r, const bf16* row) {
  const uint4* p = reinterpret_cast<const uint4*>(row) + (threadIdx.x & 31) * NT;
#pragma unroll
  for (int t = 0; t < NT; ++t) r.raw[t] = p[t];
}

template <int NT>
__device__ __forceinline__ void store_span(bf16* row, const float (&f)[NT][8]) {
  uint4* p = reinterpret_cast<uint4*>(row) + (threadIdx.x & 31) * NT;
#pragma unroll
  for (int t = 0; t < NT; ++t) p[t] = pack8(f[t]);
}

template <int NT>
__device__ __forceinline__ void store_span_row(bf16* row, const Row<NT>& r) {
  uint4* p = reinterpret_cast<uint4*>(row) + (threadIdx.x & 31) * NT;
#pragma unroll
  for (int t = 0; t < NT; ++t) p[t] = r.raw[t];
}

template <int NT>
__device__ __forceinline__ void store_span_f32(float* row, const float (&f)[NT][8]) {
  float4* p = reinterpret_cast<float4*>(row) + (threadIdx.x & 31) * 2 * NT;
#pragma unroll
  for (int t = 0; t < NT; ++t) store8_f32(p + 2 * t, f[t]);
}

template <int NT>
__device__ __forceinline__ void load_span_f32(float (&f)[NT][8], const float* row) {
  const float4* p = reinterpret_cast<const float4*>(row) + (threadIdx.x & 31) * 2 * NT;
#pragma unroll
  for (int t = 0; t < NT; ++t) {
    const float4 a = p[2 * t], b = p[2 * t + 1];
    f[t][0] = a.x, f[t][1] = a.y, f[t][2] = a.z, f[t][3] = a.w;
    f[t][4] = b.x, f[t][5] = b.y, f[t][6] = b.z, f[t][7] = b.w;
  }
}

// Chunk t of this lane's span of an fp32 q*g row (qrow: the lane's first float4).
__device__ __forceinline__ void load_qg8(float (&q)[8], const float4* qrow, int t) {
  const float4 q0 = qrow[2 * t], q1 = qrow[2 * t + 1];
  q[0] = q0.x, q[1] = q0.y, q[2] = q0.z, q[3] = q0.w;
  q[4] = q1.x, q[5] = q1.y, q[6] = q1.z, q[7] = q1.w;
}

// Sum over the G lanes of this lane's head (G a power of two <= 32).
__device__ __forceinline__ float head_sum(float x, int G) {
  for (int o = G >> 1; o > 0; o >>= 1) x += __shfl_xor_sync(0xffffffffu, x, o);
  return x;
}

// routing_mix of one site for token n, span layout: acc = the sum of its sources weighted
// by their softmax weights, which are written over the site's logits. The softmax
// statistics of head h come from its G lanes, each taking every G-th source (online
// max/sum), merged by shuffles; then the sources are summed with the next row and logit
// prefetched. load_source(row, t) gives this lane's span of source t (t = 0 .. src - 1,
// each once, in order): mix_span_token reads them from hist, the fused delta forward's stream
// form takes them from its ring.
template <int NT, class LoadSource>
__device__ __forceinline__ void mix_span_token_from(float (&acc)[NT][8], float* weights,
                                                    const Geometry& g, int site, int64_t n,
                                                    LoadSource&& load_source) {
  const int lane = threadIdx.x & 31, G = 32 / g.H, h = lane / G, sub = lane % G;
  const int src = g.lay.site_sources(site), closed = site / g.lay.block;
  auto logit = [&](int t) {
    return weights + (g.lay.site_pair(site, t, closed) * g.H + h) * g.N + n;
  };
  float m = -INFINITY, l = 0.f;
  online_add_strided(m, l, logit, sub, src, G);
  online_merge_lanes(m, l, G);
  const float linv = 1.f / l;
#pragma unroll
  for (int t = 0; t < NT; ++t)
#pragma unroll
    for (int e = 0; e < 8; ++e) acc[t][e] = 0.f;
  Row<NT> cur, nxt;
  load_source(cur, 0);
  float s_cur = *logit(0), s_nxt = 0.f;
  for (int i = 0; i < src; ++i) {
    if (i + 1 < src) {
      load_source(nxt, i + 1);
      s_nxt = *logit(i + 1);
    }
    const float a = __expf(s_cur - m) * linv;
    __syncwarp();  // every lane of the head has read logit i before it is overwritten
    if (sub == 0) *logit(i) = a;
#pragma unroll
    for (int t = 0; t < NT; ++t)
#pragma unroll
      for (int e = 0; e < 8; ++e) acc[t][e] += a * elem(cur.raw[t], e);
    if (i + 1 < src) cur = nxt, s_cur = s_nxt;
  }
}
// mix_span_token_from with the sources read from hist. OWN: the site's last source is the
// row `own` this lane already holds (the fused delta forward's new slot), not read back.
template <int NT, bool OWN>
__device__ __forceinline__ void mix_span_token(float (&acc)[NT][8], float* weights,
                                               const bf16* hist, const Geometry& g, int site,
                                               int64_t n, const Row<NT>& own) {
  const int src = g.lay.site_sources(site), closed = site / g.lay.block;
  mix_span_token_from(acc, weights, g, site, n, [&](Row<NT>& row, int t) {
    if (OWN && t == src - 1)
      row = own;
    else
      load_span(row, hist + (int64_t(t <= closed ? t * g.lay.block : site) * g.N + n) * g.d);
  });
}

// A slot's inv_rms and its logits for its ns sites, token n, span layout, from the slot's
// row rv in registers: qg8(k, t, q) fills q with chunk t of this lane's span of site k's
// q*g (exact in fp32: the product of two bf16 values).
template <int NT, class QG>
__device__ __forceinline__ void logits_span_token(float* w_src, float* inv_rms, const Row<NT>& rv,
                                                  QG&& qg8, const Geometry& g, int ns, float eps,
                                                  int64_t n) {
  const int lane = threadIdx.x & 31, G = 32 / g.H, h = lane / G;
  const float r = rsqrtf(warp_sum(lane_dot(rv, rv)) / float(g.d) + eps);
  if (lane == 0) inv_rms[n] = r;
  for (int k = 0; k < ns; ++k) {
    float p = 0.f;
#pragma unroll
    for (int t = 0; t < NT; ++t) {
      float q[8];
      qg8(k, t, q);
#pragma unroll
      for (int e = 0; e < 8; ++e) p += q[e] * elem(rv.raw[t], e);
    }
    p = head_sum(p, G);
    if (lane % G == 0) w_src[(int64_t(k) * g.H + h) * g.N + n] = r * p;
  }
}

}  // namespace mhar::cuda::routing_detail
