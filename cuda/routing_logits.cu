// routing_logits.cu: routing_source_logits (backend.h), one read of a new source: its
// inv_rms and its logits for every later site, by the token kernel, the tensor cores
// (routing_logits_mma.cu) or per-head cuBLAS GEMMs (the kernel lab's Logits versions
// below); and the q*g tables those and the backward's key path read, per op or once a
// bound pass (QgPassTables, kernels.h). Conventions: cuda/routing.cu.
#include <algorithm>

#include "cuda/routing_host.h"
#include "cuda/routing_logits_mma.h"

namespace mhar::cuda {
namespace routing_detail {
namespace {

// ---------------------------------------------------------------- source logits
// The logits of slot i against its sites k = i .. last are, per head h, one GEMM:
//   raw[k, h, n] = sum_{c in h} qg_k[c] v[n, c]      (qg = q * g, token-independent)
// run by cuBLAS on tensor cores (bf16 in, fp32 accumulate) as a batch over the heads,
// written straight into the pair slots [k - i, h, n] (ldc = H*N). qg is split into
// bf16 hi + lo parts (hi = bf16(qg), lo = bf16(qg - hi)): two GEMMs, so that the logits
// carry the fp32 product q*g as the CPU reference does, not its bf16 rounding. Then
// every logit is multiplied by its token's inv_rms.

// The per-site tables for sites first .. first+ns-1, [ns, d] each: hi/lo bf16 parts of
// q*g (for the logits) or q*g in fp32 (for the backward's key path). q*g of two bf16
// values is exact in fp32.
__global__ void qg_tables_kernel(bf16* __restrict__ hi, bf16* __restrict__ lo,
                                 float* __restrict__ f32, const SiteParams sp, int first, int ns,
                                 int d) {
  for (int64_t e = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; e < int64_t(ns) * d;
       e += int64_t(gridDim.x) * blockDim.x) {
    const int k = first + int(e / d), c = int(e % d);
    const float qg = load(sp.q[k][c]) * load(sp.g[k][c]);
    if (f32)
      f32[e] = qg;
    else
      split_bf16(qg, hi[e], lo[e]);
  }
}

// inv_rms[n] = 1/sqrt(mean_c v[n,c]^2 + eps), one warp per token.
template <int NT>
__global__ void __launch_bounds__(32 * kWarpsPerBlock)
    inv_rms_kernel(float* __restrict__ inv_rms, const bf16* __restrict__ v, const Geometry g,
                   float eps) {
  const int64_t warps = int64_t(gridDim.x) * (blockDim.x >> 5);
  for (int64_t n = int64_t(blockIdx.x) * (blockDim.x >> 5) + (threadIdx.x >> 5); n < g.N;
       n += warps) {
    Row<NT> rv;
    load_row(rv, v + n * g.d, g.nchunks);
    const float ss = warp_sum(lane_dot(rv, rv));
    if ((threadIdx.x & 31) == 0) inv_rms[n] = rsqrtf(ss / float(g.d) + eps);
  }
}

// w[row, n] *= r[n] for rows x N values (the logits of one slot, [ns * H, N]).
__global__ void scale_by_token_kernel(float* __restrict__ w, const float* __restrict__ r,
                                      int64_t rows, int64_t N) {
  if (N % 4 == 0) {
    const int64_t n4 = N / 4;
    for (int64_t e = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; e < rows * n4;
         e += int64_t(gridDim.x) * blockDim.x) {
      float4 x = reinterpret_cast<float4*>(w)[e];
      const float4 s = reinterpret_cast<const float4*>(r)[e % n4];
      x.x *= s.x, x.y *= s.y, x.z *= s.z, x.w *= s.w;
      reinterpret_cast<float4*>(w)[e] = x;
    }
  } else {
    for (int64_t e = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; e < rows * N;
         e += int64_t(gridDim.x) * blockDim.x)
      w[e] *= r[e % N];
  }
}

// Kernel-lab versions of routing_source_logits (routing_set_kernel_version(Logits, v)):
// 1 the token kernel, one token a warp, for slots read by at most kFusedKeyMaxSites
//   sites; the GEMM path (q*g hi and lo per head on cuBLAS, a scaling pass) for the rest;
// 2 as 1 with four tokens a warp (source_logits_span_kernel's TPW);
// 3 four tokens a warp also wherever the fp32 q*g table (ns d 4 bytes) fits in
//   kLogitsTableL1Bytes, so that its reads stay in L1 (the 100M model's every slot:
//   25 x 512 x 4 = 50 KiB);
// 4 four tokens a warp for every slot (the sweep's other end).
// Every version's token kernel computes the same bits; the GEMM path's differ within fp32
// rounding (both within the CPU parity bound).
// Measured (sixteenth session, OpTiming.DISABLED_RoutingLogitsVersions, a step's logits,
// ms, v1 / v2 / v3 / v4): 100M 0.76 / 0.69 / 1.03 / 1.03, 350M 2.96 / 2.46 / 2.78 / 6.89,
// 1B 5.48 / 5.33 / 5.31 / 8.97, 1B block9 2.17 / 1.97 / 1.97 / 2.43. Four tokens a warp
// gain where the token kernel already ran; past 8 sites the GEMMs stay faster even with
// the table in L1 (v3 at 100M), so the prediction behind v3 was wrong: the token kernel
// there is bound by its ns d FMAs and per-head shuffles a token, not by the table's
// reads. Version 2 was the default until version 5.
// 5 tensor cores (routing_logits_mma.cu: a warp takes 16 tokens and every head, v read
//   once a site group as mma.m16n8k16's A straight from global memory, q*g's hi and lo
//   records staged in shared memory) where its shapes allow, else version 2's rule. Its
//   sums differ from the GEMM path's and the token kernel's (the CPU parity bound).
//   Measured (twenty-fifth session, BENCHMARKS.md call 1, the same test, v2 / v5, two
//   rounds), when it took head_dim 128 only and one group a slot (4 heads and ns <= 32, or
//   8 and ns <= 16): 100M 0.857 / **0.358** and 0.825 / **0.388** ms, 350M (its slots of
//   up to 16 sites) 2.424 / **2.186**, 1B (head_dim 160: not taken) 5.248 / 5.243.
//   Default since. Then extended to any ns by site groups and to head_dim 160:
//   version 5 keeps head_dim 128 (4 or 8 heads, every slot); versions 6-7 take 160 too.
// 6 tensor cores at head_dim 128 and 160 (4 or 8 heads), the widest site groups.
// 7 as 6 with groups of 8 sites: smaller shared tables and more blocks for v read more
//   often (from L2). Versions 5-8 give the same bits where they all take a slot.
//   Measured (twenty-fifth session, BENCHMARKS.md call 3, the same test, v2 / v5 (then
//   what is now 6) / v7, ms, two rounds): 100M 0.675 / 0.374 / 0.418, 350M (every slot
//   now) 2.473 / 2.116 / 2.091 and 2.466 / 2.146 / 2.110, 1B 5.308 / 6.986 / 7.941, 1B
//   block9 1.975 / 2.852 / 2.961. At head_dim 160 the tensor cores lose to the token
//   kernel and the GEMMs: its <8, 160, 2> kernel gets 112 registers (ptxas), so the next
//   head's loads are not in flight during this head's products as they are at 128 (158);
//   hence version 5's rule. The 350M step with version 5 against 2, two alternating
//   rounds: 0.846 / 0.861 and 0.870 / 0.872 (within the rounds' spread).
//   Twenty-sixth session (BENCHMARKS.md calls 1 and 4): a token block's site groups
//   adjacent in one 1-D grid (they had re-read v from DRAM on grid.y) took v6 / v7 to
//   2.03 / 1.95 ms at 350M and 6.40 / 6.61 at 1B (v2 5.34). A version that loaded the
//   next head's rows in place, a k-step at a time after its products (no second buffer;
//   the same bits; numbered 8 while it lived, code at 5c90190), lost at every shape: 100M
//   0.462 against v5's 0.366, 350M 2.39 against 2.00, 1B 5.87 (v6 6.25, v2 5.25). So the
//   registers were not what slows head_dim 160. What else differs, found by arithmetic
//   after the session's device time ran out: the staged table is 81 KB a block at 8
//   heads of 160 (NT 2), so shared memory allows 2 blocks (8 warps) an SM there against
//   3 (12) at 128, and no register saving could raise that.
// 8 as 6 with blocks of 8 warps (128 tokens) where a slot takes several site groups and
//   such blocks keep more warps resident an SM (the occupancy calculator decides: at 1B's
//   slots past 16 sites, not at 350M's, whose 158 registers would allow one block of 8):
//   one staged table serves twice the tokens, so an SM holds 16 warps at head_dim 160
//   (was 8) and each token's share of the table's staging halves. Slots of one group keep
//   4 warps (N / 64 blocks fill the GPU; N / 128 would not at 16,384 tokens). Built after
//   the twenty-sixth session's last device call. Run in the twenty-seventh (BENCHMARKS.md):
//   the same bits as 6; 1B 4.26 ms (v2 5.29, v6 6.25), 350M and 100M as v6; but 1B block
//   routing (blocks of 9) 2.64 against v2's 1.97, its slots mostly of one group, where v6
//   loses (2.87).
// 9 as 5, and at head_dim 160 as 8 where the wide blocks apply (logits_mma_takes_wide_blocks:
//   several site groups, more warps resident), the rest as 2: each slot at the kernel that
//   won its shape. The default since the twenty-seventh session (BENCHMARKS.md, call 2:
//   every GPU test passes with it; the same test, ms, two rounds, v2 / v5 / v8 / v9): 1B
//   5.28 / 5.28 / 4.33 / **4.39**, 1B block9 1.95 / 1.95 / 2.65 / **1.83**, 100M and 350M
//   as v5 (no wide blocks at head_dim 128). The 1B mhar step with v9 against v5, two
//   alternating rounds: 302.4 / 302.1 and 301.7 / 302.5 ms (the 0.9 ms is within the
//   spread).
constexpr int64_t kLogitsTableL1Bytes = 64 * 1024;
// Whether the version in force takes a slot on tensor cores (routing_logits_mma.cu).
bool logits_by_tensor_cores(int64_t N, int d, int H, int ns, const void* v) {
  if (g_logits_version < 5 || !logits_mma_applies(N, d, H, ns, v)) return false;
  if (g_logits_version == 9) return d == 128 * H || logits_mma_takes_wide_blocks(d, H, ns);
  return g_logits_version > 5 || d == 128 * H;
}
bool logits_token_kernel_applies(const Geometry& g, int ns) {
  if (!span_layout(g)) return false;
  if (logits_by_tensor_cores(1, g.d, g.H, ns, nullptr)) return false;
  if (ns <= kFusedKeyMaxSites || g_logits_version == 4) return true;
  return g_logits_version == 3 && int64_t(ns) * g.d * 4 <= kLogitsTableL1Bytes;
}

// routing_source_logits of a slot read by few sites (ns <= kFusedKeyMaxSites), span
// layout: one read of v gives its inv_rms and its logits for every site, from the fp32 q*g
// table [ns, d] (L1-resident). The general path (inv_rms kernel, two per-head GEMMs over v
// for q*g's hi and lo parts, a scaling pass) took 52 us a slot at ns = 1 (ncu, tenth
// session: delta's partial block sums at 1B), 4 launches and 3 reads of v for a row of
// logits per head that this kernel writes from one.
// TPW > 1 (kernel-lab versions 2-4 of RoutingKernel::Logits): a warp takes TPW
// consecutive tokens at once, so that TPW rows are in flight a warp, each q*g chunk it
// loads from L1 serves TPW rows, and a head's TPW logits leave as one 16-byte store
// (9-17% faster than TPW = 1 where the token kernel runs). Each token's sums meet their
// terms in the order of TPW = 1 (logits_span_token): the same bits.
template <int NT, int TPW>
__global__ void __launch_bounds__(32 * kWarpsPerBlock, span_blocks_per_sm(NT))
    source_logits_span_kernel(float* __restrict__ w_src, float* __restrict__ inv_rms,
                              const bf16* __restrict__ v, const float* __restrict__ qg,
                              const Geometry g, int ns, float eps) {
  const int lane = threadIdx.x & 31;
  const int64_t warps = int64_t(gridDim.x) * (blockDim.x >> 5);
  const int64_t warp = int64_t(blockIdx.x) * (blockDim.x >> 5) + (threadIdx.x >> 5);
  const float4* qrow = reinterpret_cast<const float4*>(qg) + lane * 2 * NT;
  if constexpr (TPW == 1) {
    auto qg8 = [&](int k, int t, float(&q)[8]) { load_qg8(q, qrow + int64_t(k) * g.d / 4, t); };
    for (int64_t n = warp; n < g.N; n += warps) {
      Row<NT> rv;
      load_span(rv, v + n * g.d);
      logits_span_token(w_src, inv_rms, rv, qg8, g, ns, eps, n);
    }
  } else {
    static_assert(TPW == 4, "the logits of a head leave as one float4");
    const int G = 32 / g.H, h = lane / G;
    // Whole float4 stores need 16-byte aligned rows of logits: N % 4 == 0 (w_src itself
    // is a pair row of the weights, whose rows are N floats).
    const bool vector_store = g.N % 4 == 0 && reinterpret_cast<uintptr_t>(w_src) % 16 == 0;
    for (int64_t n0 = warp * TPW; n0 < g.N; n0 += warps * TPW) {
      Row<NT> rv[TPW];
      float r[TPW];
#pragma unroll
      for (int i = 0; i < TPW; ++i) {
        if (n0 + i < g.N)
          load_span(rv[i], v + (n0 + i) * g.d);
        else
          rv[i] = Row<NT>{};
      }
#pragma unroll
      for (int i = 0; i < TPW; ++i) {
        r[i] = rsqrtf(warp_sum(lane_dot(rv[i], rv[i])) / float(g.d) + eps);
        if (lane == i && n0 + i < g.N) inv_rms[n0 + i] = r[i];
      }
      for (int k = 0; k < ns; ++k) {
        float p[TPW] = {};
#pragma unroll
        for (int t = 0; t < NT; ++t) {
          float q[8];
          load_qg8(q, qrow + int64_t(k) * g.d / 4, t);
#pragma unroll
          for (int i = 0; i < TPW; ++i)
#pragma unroll
            for (int e = 0; e < 8; ++e) p[i] += q[e] * elem(rv[i].raw[t], e);
        }
#pragma unroll
        for (int i = 0; i < TPW; ++i) p[i] = r[i] * head_sum(p[i], G);
        if (lane % G != 0) continue;
        float* out = w_src + (int64_t(k) * g.H + h) * g.N + n0;
        if (vector_store && n0 + TPW <= g.N) {
          *reinterpret_cast<float4*>(out) = make_float4(p[0], p[1], p[2], p[3]);
        } else {
#pragma unroll
          for (int i = 0; i < TPW; ++i)
            if (n0 + i < g.N) out[i] = p[i];
        }
      }
    }
  }
}

// RoutingKernel::QgTables (kernel lab): 1 (the default) each op computes its slot's q*g
// rows into the RoutingTables scratch (two small launches a slot a step: the logits'
// records in the forward, the key paths' fp32 rows in the backward); 2 a bound pass
// computes every site's rows once, at its first need (QgPassTables, kernels.h). The same
// bits: the same rows, read at the slot's first site. Version 2 passes its tests on an H100
// (thirty-seventh session) but does not move the 100M mhar step (-0.2% in two alternating
// rounds, inside their spread; BENCHMARKS.md), so 1 stays the default (cuda/NOTES.md,
// lead 6).

static_assert(kMaxSites == kQgPassMaxSites, "QgPassTables holds every site's parameters");

// Whether an op of these parameters may read the pass's q*g tables (QgPassTables): a bound
// pass at QgTables version 2. Where they hold other parameters they are emptied and now
// stand for these.
bool qg_pass_for(QgPassTables& t, const SiteParams& sp, int sites, int d) {
  if (!t.pass || g_qg_tables_version != 2 || sites < 1 || sites > kMaxSites) return false;
  bool same = t.sites == sites && t.d == d;
  for (int k = 0; same && k < sites; ++k)
    same = t.params[k] == sp.q[k] && t.params[kMaxSites + k] == sp.g[k];
  if (!same) {
    t.sites = sites, t.d = d, t.f32 = nullptr, t.records = nullptr;
    for (int k = 0; k < sites; ++k) t.params[k] = sp.q[k], t.params[kMaxSites + k] = sp.g[k];
  }
  return true;
}
// The pass's tables in their scratch: fp32 rows [sites, d], then the records [sites, d / 4].
float* qg_pass_memory(RoutingContext& ctx) {
  return static_cast<float*>(ctx.scratch(ScratchSlot::RoutingPassTables,
                                         routing_pass_tables_bytes(ctx.qg.sites, ctx.qg.d)));
}

// routing_logits_mma's records of sites source .. from the pass's table (filled at the
// pass's first need), or null where the op fills its own.
const void* qg_pass_records(cudaStream_t s, RoutingContext& ctx, const SiteParams& sp, int sites,
                            int source, int d) {
  QgPassTables& t = ctx.qg;
  if (!qg_pass_for(t, sp, sites, d)) return nullptr;
  if (!t.records) {
    t.records = qg_pass_memory(ctx) + int64_t(sites) * d;
    LogitsMmaSites all{};
    for (int k = 0; k < sites; ++k) all.q[k] = sp.q[k], all.g[k] = sp.g[k];
    logits_mma_fill_table(s, t.records, all, sites, d);
  }
  return static_cast<const char*>(t.records) + logits_mma_table_bytes(d, source);
}

}  // namespace

// qg_rows_f32 (routing_host.h).
const float* qg_rows_f32(cudaStream_t s, RoutingContext& ctx, const SiteParams& sp, int sites,
                         int source, int ns, int d) {
  QgPassTables& t = ctx.qg;
  if (qg_pass_for(t, sp, sites, d)) {
    if (!t.f32) {
      t.f32 = qg_pass_memory(ctx);
      const int64_t all = int64_t(sites) * d;
      qg_tables_kernel<<<grid_stride_blocks(all, 256), 256, 0, s>>>(nullptr, nullptr, t.f32, sp, 0,
                                                                    sites, d);
      CUDA_CHECK_LAUNCH();
    }
    return t.f32 + int64_t(source) * d;
  }
  const int64_t table = int64_t(ns) * d;
  auto* qg = static_cast<float*>(ctx.scratch(ScratchSlot::RoutingTables, table * sizeof(float)));
  qg_tables_kernel<<<grid_stride_blocks(table, 256), 256, 0, s>>>(nullptr, nullptr, qg, sp, source,
                                                                  ns, d);
  CUDA_CHECK_LAUNCH();
  return qg;
}

}  // namespace routing_detail

using namespace routing_detail;

size_t routing_pass_tables_bytes(int sites, int64_t d) {
  // fp32 rows, then records of 4 channels in 16 bytes: 4 bytes a channel each.
  return size_t(std::max(sites, 0)) * size_t(std::max<int64_t>(d, 0)) * 2 * sizeof(float);
}

void routing_source_logits(cudaStream_t s, RoutingContext& ctx, Tensor weights, Tensor inv_rms,
                           Tensor v, const RoutingParams& params, const RoutingLayout& layout,
                           int source, int heads, double eps) {
  const char* what = "routing_source_logits";
  const Geometry g = source_geometry(what, weights, inv_rms, v, params, layout, source, heads);
  if (source <= ctx.tile.first) ctx.tile = MixTile{};  // new logits for a tile's old slot
  const int64_t N = g.N;
  const SiteParams sp = site_params(what, params, g.d);
  const int ns = layout.last_site(source) - source + 1;
  const int64_t table = int64_t(ns) * g.d;
  float* w = weights.ptr<float>() + g.lay.pair_base(source) * g.H * N;
  if (logits_by_tensor_cores(N, g.d, g.H, ns, v.data)) {
    LogitsMmaSites sites{};
    for (int k = 0; k < ns; ++k) sites.q[k] = sp.q[source + k], sites.g[k] = sp.g[source + k];
    const void* filled = qg_pass_records(s, ctx, sp, params.sites(), source, g.d);
    void* table = filled ? const_cast<void*>(filled)
                         : ctx.scratch(ScratchSlot::RoutingTables, logits_mma_table_bytes(g.d, ns));
    logits_mma(s, w, inv_rms.ptr<float>(), static_cast<const bf16*>(v.data), sites, table,
               filled != nullptr, N, g.d, g.H, ns, g_logits_version == 7 ? 8 : 0,
               g_logits_version >= 8, float(eps));
    return;
  }
  if (logits_token_kernel_applies(g, ns)) {  // one pass over v (see the kernel)
    const float* qg = qg_rows_f32(s, ctx, sp, params.sites(), source, ns, g.d);
    dispatch_span(g, [&](auto nt) {
      constexpr int NT = decltype(nt)::value;
      if (g_logits_version == 1) {
        source_logits_span_kernel<NT, 1><<<token_blocks(N), 32 * kWarpsPerBlock, 0, s>>>(
            w, inv_rms.ptr<float>(), static_cast<const bf16*>(v.data), qg, g, ns, float(eps));
      } else {
        source_logits_span_kernel<NT, 4>
            <<<token_blocks(ceil_div(N, int64_t(4))), 32 * kWarpsPerBlock, 0, s>>>(
                w, inv_rms.ptr<float>(), static_cast<const bf16*>(v.data), qg, g, ns, float(eps));
      }
      CUDA_CHECK_LAUNCH();
    });
    return;
  }
  auto* hi = static_cast<bf16*>(ctx.scratch(ScratchSlot::RoutingTables, 2 * table * sizeof(bf16)));
  bf16* lo = hi + table;
  qg_tables_kernel<<<grid_stride_blocks(table, 256), 256, 0, s>>>(hi, lo, nullptr, sp, source, ns,
                                                                  g.d);
  CUDA_CHECK_LAUNCH();
  dispatch_rows(g, [&](auto nt, auto) {
    inv_rms_kernel<decltype(nt)::value><<<token_blocks(N), 32 * kWarpsPerBlock, 0, s>>>(
        inv_rms.ptr<float>(), static_cast<const bf16*>(v.data), g, float(eps));
    CUDA_CHECK_LAUNCH();
  });
  for (const bf16* part : {static_cast<const bf16*>(hi), static_cast<const bf16*>(lo)})
    head_gemm(s, ctx.blas, CUBLAS_OP_T, CUBLAS_OP_N, N, ns, g.dh, v.data, CUDA_R_16BF, g.d, g.dh,
              part, CUDA_R_16BF, g.d, g.dh, part == lo ? 1.f : 0.f, w, int64_t(g.H) * N, N, g.H);
  const int64_t rows = int64_t(ns) * g.H;
  scale_by_token_kernel<<<grid_stride_blocks(rows * N / 4 + 1, 256), 256, 0, s>>>(
      w, inv_rms.ptr<float>(), rows, N);
  CUDA_CHECK_LAUNCH();
}

bool routing_logits_by_token_kernel(int64_t d, int heads, int sites) {
  Geometry g{};
  g.d = int(d);
  g.H = heads;
  return logits_token_kernel_applies(g, sites);
}

bool routing_logits_by_tensor_cores(int64_t d, int heads, int sites) {
  return logits_by_tensor_cores(1, int(d), heads, sites, nullptr);
}

}  // namespace mhar::cuda
