// routing_delta_forward.cu: routing_delta_site_forward (Backend::delta_site_forward in one
// pass, delta mode) for a slot read by its own site only: the stream advance, the slot's
// logit, the site's mix and the gate, each with its op's roundings (the same bits as the
// op sequence). Conventions: cuda/routing.cu.
#include "cuda/routing_host.h"

namespace mhar::cuda {
namespace routing_detail {
namespace {

// Backend::delta_site_forward for a slot read by its own site only (a block's partial
// sum), span layout, one warp per token, each step with the operations and roundings of
// its op (delta.cu's advance and gate, routing_rows.cuh's logits and mix), so the same bits:
//   stream += v; slot = v + prev (continues); the slot's inv_rms and logit (from the new
//   slot row in registers); the site's mix (its closed slots and its own slot); r stored;
//   x = stream + alpha r.
// It reads the stream, v, prev and the closed slots once from DRAM and writes the stream,
// the slot, r and x: 5-7 rows and the closed slots, where the four ops move 9-11 and the
// closed slots.
// Kernel-lab versions (routing_set_kernel_version(DeltaForward, v); the same operations, so
// the same bits):
// 1 (default) keeps the advanced stream and the new slot row in registers through the
//   mix (160 registers at d = 1280: 3 blocks per SM; at 4, 92 bytes spill);
// 2 re-reads both after the mix from where this lane just stored them (L2, not DRAM: the
//   rows were written microseconds before), which frees their registers: 4 blocks per SM
//   up to d = 1280, so more rows in flight.
// Measured at 1B (OpTiming.DISABLED_DeltaRouting1B, 64 sites a step, eleventh session):
// the op sequence 12.92 ms, v1 12.32, v2 13.10: the re-reads cost more than the extra
// warps gain. The kernel is latency-bound (2.6 TB/s by its bytes): each token's rows
// are loaded, then used, in turn.
// A version 3, 1 with every row it reads staged in shared memory by cp.async a few rows
//   ahead across tokens, lost and was removed (code at 3776da1). Measured (twenty-second
//   session), ms, op sequence / v1 / v2 / v3: H200 12.87 / 12.38 / 13.02 / 13.57; H100
//   16.78 / 14.87 / 16.06 / 16.47. Version 1 is the default.
constexpr int delta_forward_blocks_per_sm(int NT, int version) {
  return NT <= 4 || (version == 2 && NT == 5) ? 4 : NT == 5 ? 3 : 2;
}
// One token n of the fused delta site forward (the kernel below); the rows arrive through
// loaders (kept from the lab's staged version 3, removed: the same operations in the same
// order whichever way the rows arrive). lead_row(row, i) gives this lane's span
// of the stream (i = 0), the slot's v (1) and, where the slot continues its block, prev
// (2), in that order; closed_row(row, t) the closed slot t (t = 0 .. closed, in order).
// KEEP: the advanced stream and the new slot row stay in registers through the mix; else
// they are read back from where this lane stored them (version 2).
template <int NT, bool KEEP, class QG, class LeadRow, class ClosedRow>
__device__ __forceinline__ void delta_forward_token(bf16* x, bf16* r_out, bf16* stream, bf16* slot,
                                                    float* weights, float* w_site, float* inv_rms,
                                                    QG&& qg8, const Geometry& g, int site,
                                                    bool continues, float a, float eps, int64_t n,
                                                    LeadRow&& lead_row, ClosedRow&& closed_row) {
  Row<NT> sv, own;
  {
    Row<NT> vv;
    lead_row(sv, 0);
    lead_row(vv, 1);
    if (continues) {
      Row<NT> pv;
      lead_row(pv, 2);
#pragma unroll
      for (int t = 0; t < NT; ++t) {
        float f[8];
#pragma unroll
        for (int e = 0; e < 8; ++e) f[e] = __fadd_rn(elem(vv.raw[t], e), elem(pv.raw[t], e));
        own.raw[t] = pack8(f);
      }
    } else {
      own = vv;
    }
#pragma unroll
    for (int t = 0; t < NT; ++t) {
      float f[8];
#pragma unroll
      for (int e = 0; e < 8; ++e) f[e] = __fadd_rn(elem(sv.raw[t], e), elem(vv.raw[t], e));
      sv.raw[t] = pack8(f);  // now the advanced stream
    }
  }
  store_span_row(stream + n * g.d, sv);
  if (continues) store_span_row(slot + n * g.d, own);
  logits_span_token(w_site, inv_rms, own, qg8, g, 1, eps, n);
  __syncwarp();  // the head's leader lane stored the logit the mix reads
  float acc[NT][8];
  const int src = g.lay.site_sources(site);
  mix_span_token_from(acc, weights, g, site, n, [&](Row<NT>& row, int t) {
    if (t < src - 1)
      closed_row(row, t);
    else if (KEEP)
      row = own;
    else
      load_span(row, slot + n * g.d);  // version 2: from this lane's store above
  });
  Row<NT> rr;
#pragma unroll
  for (int t = 0; t < NT; ++t) rr.raw[t] = pack8(acc[t]);
  store_span_row(r_out + n * g.d, rr);
  if (!KEEP) load_span(sv, stream + n * g.d);
#pragma unroll
  for (int t = 0; t < NT; ++t) {
    float f[8];
#pragma unroll
    for (int e = 0; e < 8; ++e)
      f[e] = __fadd_rn(elem(sv.raw[t], e), __fmul_rn(a, elem(rr.raw[t], e)));
    sv.raw[t] = pack8(f);
  }
  store_span_row(x + n * g.d, sv);
}

// The site's q*g, chunk t of this lane's span, as the logits take it.
template <int NT>
__device__ __forceinline__ void delta_site_qg8(const bf16* query, const bf16* gain, int t,
                                               float (&q)[8]) {
  const int lane = threadIdx.x & 31;
  const uint4 qc = reinterpret_cast<const uint4*>(query)[lane * NT + t];
  const uint4 gc = reinterpret_cast<const uint4*>(gain)[lane * NT + t];
#pragma unroll
  for (int e = 0; e < 8; ++e) q[e] = __fmul_rn(elem(qc, e), elem(gc, e));
}

template <int NT, int V>
__global__ void __launch_bounds__(32 * kWarpsPerBlock, delta_forward_blocks_per_sm(NT, V))
    delta_site_forward_span_kernel(bf16* __restrict__ x, bf16* __restrict__ r_out, bf16* stream,
                                   bf16* hist, float* weights, float* __restrict__ inv_rms,
                                   const bf16* __restrict__ query, const bf16* __restrict__ gain,
                                   const bf16* __restrict__ alpha, const Geometry g, int site,
                                   bool continues, float eps) {
  const int64_t warps = int64_t(gridDim.x) * (blockDim.x >> 5), Nd = g.N * g.d;
  const float a = __bfloat162float(alpha[0]);
  bf16* slot = hist + int64_t(site) * Nd;
  const bf16* lead[3] = {stream, slot, slot - Nd};  // the stream, v, prev
  float* w_site = weights + g.lay.pair_base(site) * g.H * g.N;
  auto qg8 = [&](int, int t, float(&q)[8]) { delta_site_qg8<NT>(query, gain, t, q); };
  for (int64_t n = int64_t(blockIdx.x) * (blockDim.x >> 5) + (threadIdx.x >> 5); n < g.N;
       n += warps) {
    delta_forward_token<NT, V == 1>(
        x, r_out, stream, slot, weights, w_site, inv_rms, qg8, g, site, continues, a, eps, n,
        [&](Row<NT>& row, int i) { load_span(row, lead[i] + n * g.d); },
        [&](Row<NT>& row, int t) {
          load_span(row, hist + (int64_t(t) * g.lay.block * g.N + n) * g.d);  // closed slot t
        });
  }
}

}  // namespace
}  // namespace routing_detail

using namespace routing_detail;

bool routing_delta_site_forward_fuses(const DeltaSiteForward& a) {
  if (a.history.ndim != 3 || a.heads < 1 || !a.params) return false;
  const int64_t N = a.history.dim(1), d = a.history.dim(2);
  const RoutingLayout& lay = a.layout;
  bool ok =
      N > 0 && a.history.dim(0) == lay.sources && span_layout(d, a.heads) && d <= 256 * kMaxNT &&
      a.site >= 1 && a.site < lay.sources && lay.last_site(a.site) == a.site &&
      (!a.continues || a.site >= 2) && lay.sites <= kMaxSites && a.params->sites() == lay.sites &&
      a.history.dtype == DType::BF16 && aligned16(a.history.data) && a.alpha.dtype == DType::BF16 &&
      a.alpha.numel() == 1 && a.inv_rms.dtype == DType::F32 && a.inv_rms.numel() == N &&
      a.weights.dtype == DType::F32 && a.weights.numel() == lay.pairs() * a.heads * N;
  for (const Tensor* t : {&a.stream, &a.x, &a.r})
    ok = ok && t->dtype == DType::BF16 && t->numel() == N * d && aligned16(t->data);
  if (!ok) return false;
  for (const Tensor* t : {&a.params->query[size_t(a.site)], &a.params->gain[size_t(a.site)]})
    ok = ok && t->dtype == DType::BF16 && t->numel() == d && aligned16(t->data);
  return ok;
}

bool routing_delta_site_forward(cudaStream_t s, RoutingContext& ctx, const DeltaSiteForward& a) {
  if (!routing_delta_site_forward_fuses(a)) return false;
  const int64_t N = a.history.dim(1);
  const Geometry g = geometry("delta_site_forward", N, a.history.dim(2), a.heads, a.layout);
  ctx.tile = MixTile{};  // as routing_mix: a plain mix ends any depth tile in flight
  dispatch_span(g, [&](auto nt) {
    constexpr int NT = decltype(nt)::value;
    auto* x = static_cast<bf16*>(a.x.data);
    auto* r = static_cast<bf16*>(a.r.data);
    auto* stream = static_cast<bf16*>(a.stream.data);
    auto* hist = static_cast<bf16*>(a.history.data);
    const auto* query = static_cast<const bf16*>(a.params->query[size_t(a.site)].data);
    const auto* gain = static_cast<const bf16*>(a.params->gain[size_t(a.site)].data);
    const auto* alpha = static_cast<const bf16*>(a.alpha.data);
    auto kernel = g_delta_forward_version == 1 ? delta_site_forward_span_kernel<NT, 1>
                                               : delta_site_forward_span_kernel<NT, 2>;
    kernel<<<token_blocks(N), 32 * kWarpsPerBlock, 0, s>>>(
        x, r, stream, hist, a.weights.ptr<float>(), a.inv_rms.ptr<float>(), query, gain, alpha, g,
        a.site, a.continues, float(a.eps));
    CUDA_CHECK_LAUNCH();
  });
  return true;
}

}  // namespace mhar::cuda
